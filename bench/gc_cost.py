"""What CPython's garbage collector costs a gateway worker, with and without ``gctune``.

    .venv/bin/python -m bench.gc_cost [--conc 64] [--seconds 6]

The gateway (the work tree's ``src/``, auth off) is served by hypercorn in a process
of this script's own (``hypercorn.trio.serve``, pinned to CPU 0), so that
``gc.callbacks`` can time every collection; wrk streams through it from CPU 1 against
``bench/node/upstream.js``. Twice: CPython's defaults, then :func:`aiserve_trio.util.gctune.tune`.
Per generation: collections, their time as a share of the process's CPU, objects
collected. Writes ``bench/results/<date>/gc_cost.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

from . import systems
from .ab import node_upstream, wrk
from .systems import ROOT, SYSTEM_CPU, WORK, free_port, pinned


def _serve(port: int, seconds: float, tuned: bool) -> dict[str, Any]:
    """In the measuring process: serve, time collections for ``seconds`` after a warm-up."""
    import functools
    import gc

    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve

    from aiserve_trio import app
    from aiserve_trio.util import gctune

    config = Config.from_toml(str(ROOT / "bench" / "configs" / "hypercorn-bench.toml"))
    config.bind = [f"127.0.0.1:{port}"]
    stats: dict[int, list[float]] = {}
    started = [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        s = stats.setdefault(info["generation"], [0, 0.0, 0])
        s[0] += 1
        s[1] += time.perf_counter() - started[0]
        s[2] += info["collected"]

    async def main() -> float:
        async with trio.open_nursery() as nursery:
            done = trio.Event()
            nursery.start_soon(functools.partial(serve, app, config, shutdown_trigger=done.wait))
            await trio.sleep(2.0)  # started, warmed up by the caller's first wrk
            if tuned:
                gctune.tune()
            gc.callbacks.append(timed)
            cpu0 = time.process_time()
            await trio.sleep(seconds)
            gc.callbacks.remove(timed)
            cpu = time.process_time() - cpu0
            done.set()
        return cpu

    cpu = trio.run(main)
    return {"cpu_s": cpu, "generations": {g: {"collections": n, "seconds": t, "collected": c}
                                          for g, (n, t, c) in sorted(stats.items())}}


def measure(up: systems.Running, conc: int, seconds: float, tuned: bool) -> dict[str, Any]:
    port = free_port()
    cfg = WORK / "gc_cost.toml"
    cfg.write_text(systems.gateway_toml({"/v1/chat/completions": up.base},
                                        extra="\n[auth]\nenabled = false\n"))
    env = {**os.environ, "AISERVE_CONFIG": str(cfg), "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    cmd = pinned([sys.executable, "-m", "bench.gc_cost", "--child", str(port), str(seconds),
                  "1" if tuned else "0"], SYSTEM_CPU)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        systems.wait_http(f"http://127.0.0.1:{port}/healthz", proc, 30, systems.LOGS / "none")
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        wrk(url, 4, 1, stream=True, key=None)
        load = threading.Thread(target=lambda: wrk(url, conc, int(seconds) + 2, stream=True, key=None))
        load.start()
        out, _ = proc.communicate(timeout=seconds + 60)
        load.join()
    finally:
        if proc.poll() is None:
            proc.kill()
    return dict(json.loads(out.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gc_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--conc", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        port, seconds, tuned = ns.child
        print(json.dumps(_serve(int(port), float(seconds), tuned == "1")))
        return 0
    load0 = os.getloadavg()[0]
    rows = []
    with node_upstream() as up:
        for tuned in (False, True):
            r = measure(up, ns.conc, ns.seconds, tuned)
            for g, s in r["generations"].items():
                rows.append(f"| {'gctune' if tuned else 'defaults'} | {g} | {s['collections']:,} | "
                            f"{s['seconds'] * 1000:,.0f} ms ({s['seconds'] / r['cpu_s'] * 100:.1f} %) | "
                            f"{s['collected']:,} |")
                print(rows[-1], flush=True)
    lines = [
        f"# The garbage collector's cost in a gateway worker ({dt.date.today().isoformat()})", "",
        f"Command: `python -m bench.gc_cost {' '.join(sys.argv[1:] if argv is None else argv)}`. "
        f"wrk streaming at c={ns.conc} through an in-process hypercorn (CPU {SYSTEM_CPU}), "
        f"collections timed with `gc.callbacks` over {ns.seconds:g} s. Load average {load0:.2f} "
        f"at the start, {os.getloadavg()[0]:.2f} at the end.", "",
        "| collector | generation | collections | time (share of the worker's CPU) | collected |",
        "|---|---|---|---|---|", *rows,
    ]
    out = ROOT / "bench" / "results" / dt.date.today().isoformat() / "gc_cost.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
