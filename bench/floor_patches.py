"""What the gateway's hypercorn patches save on hypercorn's own part of a request.

    .venv/bin/python -m bench.floor_patches [--duration 4] [--rounds 2]

The floor app (``bench/ceiling_app.py``: a fixed reply, no upstream) on hypercorn as it
ships and on hypercorn with the patches the gateway installs at start-up (write
coalescing, the keep-alive timer, the ``Date`` header, direct socket reads and writes:
``ceiling_app:patched``), one worker pinned to CPU 0, wrk on CPU 1, non-streamed at
c = 1 and c = 16; the servers alternate within each round and the best round counts.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from . import systems
from .ab import wrk
from .systems import ROOT, SYSTEM_CPU, Running, free_port

APPS = {"hypercorn as shipped": "bench.ceiling_app:app",
        "with the gateway's patches": "bench.ceiling_app:patched"}


@contextlib.contextmanager
def serve(spec: str) -> Iterator[Running]:
    port = free_port()
    cmd = systems.hypercorn_cmd(port, spec, [])
    env = {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    with systems.start(spec.split(":")[1], cmd, port=port, cpu=SYSTEM_CPU, env=env,
                       health="/v1/models", ours=False) as r:
        yield r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.floor_patches", description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=2)
    ns = ap.parse_args(argv)
    best: dict[tuple[str, int], dict[str, float]] = {}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(serve(spec)).base + "/v1/chat/completions"
                for name, spec in APPS.items()}
        for url in urls.values():
            wrk(url, 4, 1, stream=False, key=None)
        for _ in range(ns.rounds):
            for conc in (1, 16):
                for name, url in urls.items():
                    p = wrk(url, conc, ns.duration, stream=False, key=None)
                    if (name, conc) not in best or p["rps"] > best[name, conc]["rps"]:
                        best[name, conc] = p
    print("| floor app (fixed reply) | req/s c=1 | p50 c=1 | req/s c=16 |\n|---|---|---|---|")
    for name in APPS:
        one, many = best[name, 1], best[name, 16]
        print(f"| {name} | {one['rps']:,.0f} | {one['p50_ms']:.2f} ms | {many['rps']:,.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
