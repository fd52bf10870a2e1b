"""CPU seconds of the gateway's worker per request, by concurrency, revisions interleaved.

    .venv/bin/python -m bench.cpu_per_request --revs HEAD~1,HEAD --concs 64,256,1024

A figure that a shared machine's load moves little, unlike req/s: the worker's
utime + stime (``/proc/<pid>/stat``) over a wrk point, divided by the requests wrk
saw finish. If it grows with concurrency, something costs per connection or per
pass; if it does not and req/s falls, the worker waits. ``--gc``: each worker also
times its collections by generation (``gc.callbacks``, a ``sitecustomize`` on its
``PYTHONPATH``), printed per point. Upstream: ``bench/node/upstream.js`` (16 deltas,
zero delay), wrk on the load CPU, the workers on the other; at each (mode, c), every
revision in turn. Prints one line a point; nothing is written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from . import systems
from .ab import _JSON, node_upstream, wrk_start
from .systems import LOAD_CPU, WORK
from .throughput import System, aiserve

GC_PROBE = """import gc, json, os, threading, time
_s = {"0": [0, 0.0, 0.0], "1": [0, 0.0, 0.0], "2": [0, 0.0, 0.0]}
_t = [0.0]
def _cb(phase, info):
    if phase == "start":
        _t[0] = time.thread_time()
        return
    d = time.thread_time() - _t[0]
    s = _s[str(info["generation"])]
    s[0] += 1; s[1] += d; s[2] = max(s[2], d)
gc.callbacks.append(_cb)
def _dump():
    while True:
        time.sleep(0.1)
        with open(os.path.join(%(dir)r, "gc-%%d.json" %% os.getpid()), "w") as f:
            json.dump(_s, f)
threading.Thread(target=_dump, daemon=True).start()
"""


def gc_stats(probe: Path, pid: int) -> dict[str, list[float]] | None:
    try:
        data: dict[str, list[float]] = json.loads((probe / f"gc-{pid}.json").read_text())
    except (OSError, ValueError):
        return None
    return data


def measure(s: System, c: int, seconds: float, stream: bool, probe: Path | None) -> str:
    warm = wrk_start(s.url, c, 2, stream=stream, key=s.key, cpu=LOAD_CPU, threads=2,
                     timeout_s=30)
    warm.communicate()
    assert s.running is not None
    pid = s.running.worker_pid()
    g0 = gc_stats(probe, pid) if probe else None
    c0, t0 = systems.cpu_seconds([pid]), time.monotonic()
    proc = wrk_start(s.url, c, seconds, stream=stream, key=s.key, cpu=LOAD_CPU, threads=2,
                     timeout_s=30)
    out, _ = proc.communicate()
    c1, t1 = systems.cpu_seconds([pid]), time.monotonic()
    m = _JSON.search(out or "")
    if proc.returncode or m is None:
        raise RuntimeError(f"wrk failed ({proc.returncode}):\n{out}")
    raw: dict[str, Any] = json.loads(m.group(1))
    n = max(1, raw["requests"])
    line = (f"{s.name:22} {'stream' if stream else 'json':6} c={c:<5} "
            f"{n / (raw['duration_us'] / 1e6):6.0f} req/s  cpu {c1 - c0:5.2f} s of "
            f"{t1 - t0:4.1f} s  {(c1 - c0) / n * 1e6:5.0f} us/req  p50 "
            f"{raw['p50_us'] / 1000:.0f} p99 {raw['p99_us'] / 1000:.0f} p99.9 "
            f"{raw['p999_us'] / 1000:.0f} ms  errors {raw['errors']} non-2xx {raw['non2xx']}")
    if probe is not None:
        time.sleep(0.2)
        g1 = gc_stats(probe, pid)
        if g0 is not None and g1 is not None:
            line += "\n    gc: " + "  ".join(
                f"gen{g} {int(g1[g][0] - g0[g][0])}x {g1[g][1] - g0[g][1]:.2f} s"
                for g in "012")
    return line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_per_request",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--revs", default="HEAD", help="gateway revisions, interleaved")
    ap.add_argument("--concs", default="64,256,1024")
    ap.add_argument("--modes", default="json,stream")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds a point")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--gc", action="store_true", help="time each worker's collections")
    ap.add_argument("--max-starting", default="",
                    help="fixed bounds ([deadline] max_starting = min_starting): a worker of "
                         "each revision for each")
    args = ap.parse_args(argv)
    probe: Path | None = None
    if args.gc:
        probe = WORK / "gcprobe"
        probe.mkdir(parents=True, exist_ok=True)
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    with contextlib.ExitStack() as stack:
        up = stack.enter_context(node_upstream(deltas=16))
        targets: list[System] = []
        for rev in args.revs.split(","):
            src, sha = systems.snapshot(rev)
            if probe is not None:
                # A copy of the snapshot with the probe as its sitecustomize (the shared
                # snapshot stays as it is).
                own = WORK / f"cpu-per-request-{sha}" / "src"
                if own.exists():
                    shutil.rmtree(own)
                shutil.copytree(src, own)
                (own / "sitecustomize.py").write_text(GC_PROBE % {"dir": str(probe)})
                src = own
            systems.SNAPSHOT = src
            # A fixed bound: the floor where the ceiling is (else it follows the load),
            # on a revision that has the floor.
            paced = "min_starting" in (src / "aiserve_trio" / "core" / "budgets.py").read_text()
            for ms in [m for m in args.max_starting.split(",") if m] or [""]:
                floor = f"min_starting = {ms}\n" if paced else ""
                extra = f"\n[deadline]\nmax_starting = {ms}\n{floor}" if ms else ""
                name = f"aiserve-{sha}" + (f"-ms{ms}" if ms else "")
                targets.append(stack.enter_context(aiserve(up, name=name, extra=extra)))
        for _ in range(args.rounds):
            for mode in args.modes.split(","):
                for c in (int(x) for x in args.concs.split(",")):
                    for s in targets:
                        print(measure(s, c, args.duration, mode == "stream", probe), flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
