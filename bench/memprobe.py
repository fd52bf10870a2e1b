"""Where the gateway's memory per held stream goes.

Two halves. As a hypercorn app (``bench.memprobe:app``) it serves
``aiserve_trio:app`` and answers two signals: SIGUSR2 collects garbage and,
from the second signal on, prints the live objects by type that appeared since
the first (to the worker's log); SIGUSR1, when ``MEMPROBE_FRAMES`` > 0 turned
tracemalloc on, writes the allocation growth by line to ``$MEMPROBE_OUT``.

As a script it runs the whole measurement::

    python -m bench.memprobe --streams 2000 [--http2] [--tracemalloc 1] [--rev HEAD] [--itl-ms 1000]
                             [--prompt-bytes 8192]

With ``--tracemalloc`` N > 1 the file also lists the growth by whole traceback (N
frames), which names the caller of each coroutine frame and each trio object.

simulator + gateway (one worker) on the bench's CPUs, N streams held (one token
every 12 s), then the worker's RSS growth per stream and the object census from
``bench/work/logs/memprobe.log``.
"""

from __future__ import annotations

import os
import signal
import tracemalloc
from collections import Counter
from types import FrameType

if __name__ != "__main__" and os.environ.get("MEMPROBE_FRAMES", "0") != "0":
    tracemalloc.start(int(os.environ["MEMPROBE_FRAMES"]))

_base: list[tracemalloc.Snapshot] = []
_types: list[Counter[str]] = []


def _dump(signum: int, frame: FrameType | None) -> None:
    if not tracemalloc.is_tracing():
        return
    snap = tracemalloc.take_snapshot()
    if not _base:
        _base.append(snap)
        return
    out = os.environ.get("MEMPROBE_OUT", "bench/work/memprobe.txt")
    with open(out, "w") as f:
        for key in ("filename", "lineno"):
            stats = snap.compare_to(_base[0], key)
            total = sum(s.size_diff for s in stats)
            f.write(f"== by {key}: total growth {total / 1e6:.1f} MB\n")
            for s in stats[:40]:
                f.write(f"{s.size_diff / 1e3:10.0f} KB {s.count_diff:8d}  {s.traceback[0]}\n")
        if tracemalloc.get_traceback_limit() > 1:
            # Whole tracebacks: the line that allocated and the calls that led to it
            # (a coroutine's frame is allocated where it is called).
            stats = snap.compare_to(_base[0], "traceback")
            f.write("== by traceback, the allocating line first, then its callers\n")
            for s in stats[:60]:
                f.write(f"{s.size_diff / 1e3:10.0f} KB {s.count_diff:8d}\n")
                for fr in s.traceback.format(most_recent_first=True)[::2]:
                    f.write(f"      {fr.strip()}\n")


def _census(signum: int, frame: FrameType | None) -> None:
    import gc
    import sys
    gc.collect()
    hist = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())
    if not _types:
        _types.append(hist)
        return
    hist.subtract(_types[0])
    print(f"memprobe: {sum(hist.values())} more GC-tracked objects", file=sys.stderr)
    for name, n in hist.most_common(40):
        print(f"memprobe: {n:9d} {name}", file=sys.stderr, flush=True)


if __name__ != "__main__":
    from aiserve_trio import app

    signal.signal(signal.SIGUSR1, _dump)
    signal.signal(signal.SIGUSR2, _census)
    __all__ = ["app"]


def main() -> int:
    import argparse
    import json
    import subprocess
    import sys
    import time
    import urllib.request

    from bench import systems

    ap = argparse.ArgumentParser(prog="python -m bench.memprobe", description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=2000)
    ap.add_argument("--ramp", type=float, default=100.0, help="new streams per second")
    ap.add_argument("--http2", action="store_true", help="h2c to the simulator")
    ap.add_argument("--tracemalloc", type=int, default=0, help="frames to keep (0: off; slow)")
    ap.add_argument("--rev", default=None,
                    help="the gateway of this revision (a snapshot of its src/); default: the work tree")
    ap.add_argument("--itl-ms", type=int, default=12_000, help="the sim's time between tokens")
    ap.add_argument("--prompt-bytes", type=int, default=2,
                    help="the size of each stream's prompt (what a stream holds of it shows)")
    ns = ap.parse_args()
    if ns.rev is not None:
        systems.SNAPSHOT = systems.snapshot(ns.rev)[0]
    n, itl_ms = ns.streams, ns.itl_ms
    tokens = 1 + int((n / ns.ramp + 30) * 1000 / itl_ms)
    extra = systems.HELD_STREAMS_TOML
    with systems.sim(systems.held_sim_args(itl_ms, tokens), "sim-memprobe") as sim:
        auth = systems.gateway_auth()
        cfg = systems.WORK / "memprobe.toml"
        cfg.write_text(systems.gateway_toml(
            {"/v1/chat/completions": sim.base}, auth=auth, extra=extra, http2=ns.http2))
        env = {"AISERVE_CONFIG": str(cfg.relative_to(systems.ROOT)),
               "MEMPROBE_FRAMES": str(ns.tracemalloc),
               "MEMPROBE_OUT": str(systems.WORK / "memprobe.txt")}
        port = systems.free_port()
        with systems.start("memprobe", systems.hypercorn_cmd(port, "bench.memprobe:app"),
                           port=port, cpu=systems.SYSTEM_CPU, env=env) as gw:
            pid = gw.worker_pid()
            time.sleep(1)
            os.kill(pid, signal.SIGUSR2)
            os.kill(pid, signal.SIGUSR1)
            time.sleep(2)
            idle = gw.worker_rss_mb()
            cmd = [sys.executable, "-m", "bench.loadgen", "--url", gw.base + "/v1/chat/completions",
                   "--hold", str(n), "--ramp", str(ns.ramp), "--duration", str(n / ns.ramp + 60)]
            if auth is not None:
                cmd += ["--header", f"Authorization: Bearer {auth.plain}"]
            if ns.prompt_bytes != 2:
                cmd += ["--prompt", "x" * ns.prompt_bytes]
            load = subprocess.Popen(systems.pinned(cmd, systems.LOAD_CPU), cwd=systems.ROOT,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            open_ = 0
            try:
                for _ in range(int(n / ns.ramp * 3 + 30)):
                    time.sleep(1)
                    with urllib.request.urlopen(sim.base + "/sim/stats", timeout=5) as r:
                        open_ = int(json.loads(r.read())["open_streams"])
                    if open_ >= n:
                        break
                time.sleep(3)
                held = gw.worker_rss_mb()
                os.kill(pid, signal.SIGUSR2)
                os.kill(pid, signal.SIGUSR1)
                time.sleep(10 + (60 if ns.tracemalloc else 0))
            finally:
                load.kill()
    print(f"{open_} streams held ({'h2c' if ns.http2 else 'HTTP/1.1'} upstream): worker RSS "
          f"{idle:.0f} -> {held:.0f} MB, {(held - idle) * 1024 / max(open_, 1):.1f} KB per stream")
    for line in (systems.LOGS / "memprobe.log").read_text().splitlines():
        if line.startswith("memprobe:"):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
