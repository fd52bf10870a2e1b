"""What the semantic index costs a worker: 15,000 distinct guards, RSS before and after.

    .venv/bin/python -m bench.semantic_memory [--guards 15000] [--dims 512] [--budget BYTES]

A client may pick a new guard with every request (a ``seed``, ``top_p``, the system
prompt), so each question may land in a bucket of its own. This files ``--guards``
questions, each under a guard of its own, the way the service does after a stored
miss (``Cache.semantic.insert(probe, key, ttl)`` on a ``Cache`` built from a default
``[cache]``, ``semantic_max_bytes`` set to ``--budget`` when given), with fresh
vectors the script does not keep. It prints the process's RSS growth (``VmRSS``,
after a collection), the index's own account of its bytes where it keeps one
(``VectorIndex.bytes``), and the bound. The done criterion of issue 55: growth at
most the budget plus 32 MB.

It runs against whichever ``aiserve_trio`` is on the path: for the code before the
bound, ``git archive HEAD~N src | tar -x -C /tmp/old`` and ``PYTHONPATH=/tmp/old/src``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import sys
from typing import Any

import numpy as np
import trio

MB = 1_000_000


def rss() -> int:
    """This process's resident set (bytes), after a collection."""
    gc.collect()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def fill(cache: Any, guards: int, dims: int) -> None:
    from aiserve_trio.cache.semantic import Probe, unit

    rng = np.random.default_rng(55)
    for i in range(guards):
        guard = hashlib.blake2b(f"guard {i}".encode(), digest_size=32).hexdigest()
        key = "aiserve:cache:" + hashlib.blake2b(f"key {i}".encode(), digest_size=16).hexdigest()
        vector = unit(rng.standard_normal(dims))
        assert vector is not None
        question = f"What is the annual fee of card number {i} for a customer who asks twice?"
        await cache.semantic.insert(Probe(guard, vector, question), key, 600.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.semantic_memory")
    ap.add_argument("--guards", type=int, default=15_000)
    ap.add_argument("--dims", type=int, default=512)
    ap.add_argument("--budget", type=int, default=None, help="[cache] semantic_max_bytes")
    args = ap.parse_args(argv)

    import msgspec

    from aiserve_trio.cache.backend import MemoryBackend
    from aiserve_trio.cache.service import Cache
    from aiserve_trio.config import CacheConfig

    config = CacheConfig()
    if args.budget is not None:
        config = msgspec.structs.replace(config, semantic_max_bytes=args.budget)
    budget = getattr(config, "semantic_max_bytes", None)
    cache = Cache(config, {}, MemoryBackend(config.max_bytes))
    # Warm: numpy's and trio's first calls, so the growth is the index's.
    trio.run(fill, Cache(config, {}, MemoryBackend(config.max_bytes)), 50, args.dims)
    before = rss()
    trio.run(fill, cache, args.guards, args.dims)
    after = rss()
    index = cache.semantic.index
    accounted = getattr(index, "bytes", None)
    print(f"guards filed        {args.guards:>12,}  ({args.dims} dims)")
    print(f"questions held      {len(index):>12,}")
    print(f"RSS growth          {(after - before) / MB:>12.1f} MB")
    if accounted is not None:
        print(f"index's account     {accounted / MB:>12.1f} MB")
    if budget is None:
        print(
            "bound               none in bytes (semantic_max_entries "
            f"{config.semantic_max_entries:,})"
        )
        return 0
    limit = budget + 32 * 1024 * 1024
    print(f"semantic_max_bytes  {budget / MB:>12.1f} MB  (+ 32 MiB: {limit / MB:.1f} MB)")
    ok = after - before <= limit
    print("within the bound" if ok else "OVER the bound")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
