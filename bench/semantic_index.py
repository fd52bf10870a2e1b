"""The semantic index's search: exact (numpy, one thread) against an HNSW graph (usearch).

    .venv/bin/python -m bench.semantic_index [--sizes 1000,10000,100000] [--dims 512]
    .venv/bin/pip install usearch    # for the HNSW column (not a dependency of the gateway)

For each size N: N random unit vectors (one guard's bucket), 200 queries near
some of them; the time of one search (best of 5 passes) for the gateway's exact
search (``cache/semantic.py``: ``np.einsum``, in slices of ``_CHUNK`` rows), the
same through ``VectorIndex.search`` itself (its bucket, the expiry check, the
``Found``; in one Trio run), for a BLAS matrix product (``matrix @ query``, as many
threads as BLAS takes), and for usearch's HNSW (``Index(metric="cos")``), with its
build time and its recall of the exact nearest.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from typing import Any

import numpy as np


def _best(fn: Any, queries: Any, passes: int = 5) -> float:
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        for q in queries:
            fn(q)
        best = min(best, (time.perf_counter() - t) / len(queries))
    return best * 1e6


def _index_search(x: Any, queries: Any, passes: int = 5) -> float:
    """One search's time (us, best of ``passes``) through the gateway's ``VectorIndex``
    holding ``x`` under one guard."""
    import trio

    from aiserve_trio.cache.semantic import Item, VectorIndex

    try:  # bounded in bytes since issue 55: room for the whole bucket here
        index = VectorIndex(len(x), max_bytes=1 << 40)  # type: ignore[call-arg,unused-ignore]
    except TypeError:
        index = VectorIndex(len(x))
    for i, row in enumerate(x):
        index.add(Item("g", f"k{i}", row, "", 1e12))
    now = time.time()

    async def run() -> float:
        best = float("inf")
        for _ in range(passes):
            t = time.perf_counter()
            for q in queries:
                await index.search("g", q, now)
            best = min(best, (time.perf_counter() - t) / len(queries))
        return best * 1e6

    return trio.run(run)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.semantic_index")
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--dims", type=int, default=512)
    args = ap.parse_args(argv)
    try:
        index_class: Any = importlib.import_module("usearch.index").Index
    except ImportError:
        index_class = None
    from aiserve_trio.cache.semantic import _CHUNK

    rng = np.random.default_rng(1)
    print(
        "size     exact einsum (us)  index.search (us)  BLAS matmul (us)  HNSW (us)"
        "  HNSW build (s)  recall"
    )
    for n in (int(s) for s in args.sizes.split(",")):
        x = rng.standard_normal((n, args.dims)).astype(np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        picks = rng.integers(0, n, 200)
        noise = 0.05 * rng.standard_normal((200, args.dims)).astype(np.float32)
        queries = x[picks] + noise

        def exact(q: Any, x: Any = x) -> int:
            best, at = -2.0, -1
            for s in range(0, len(x), _CHUNK):
                scores = np.einsum("ij,j->i", x[s : s + _CHUNK], q)
                j = int(scores.argmax())
                if scores[j] > best:
                    best, at = float(scores[j]), s + j
            return at

        ex = _best(exact, queries)
        ix = _index_search(x, queries)
        mm = _best(lambda q, x=x: int((x @ q).argmax()), queries)
        hnsw = build = recall = float("nan")
        if index_class is not None:
            index = index_class(ndim=args.dims, metric="cos", dtype="f32")
            t = time.perf_counter()
            index.add(np.arange(n), x)
            build = time.perf_counter() - t
            hnsw = _best(lambda q, index=index: index.search(q, 1), queries)
            truth = [exact(q) for q in queries]
            got = [int(index.search(q, 1).keys[0]) for q in queries]
            recall = sum(a == b for a, b in zip(truth, got, strict=True)) / len(truth)
        print(
            f"{n:<8} {ex:>17.0f} {ix:>18.0f} {mm:>17.0f} {hnsw:>10.0f} {build:>15.2f}"
            f" {recall:>7.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
