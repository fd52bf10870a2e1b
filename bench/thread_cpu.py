"""CPU per request of each thread of the gateway under load: which thread pays for what.

    .venv/bin/python -m bench.thread_cpu HEAD+bench/configs/audit-off.toml \
        HEAD+bench/configs/audit-on.toml --rounds 4

Each ``REV[@HYPERCORN.toml][+GATEWAY.toml]`` (as ``python -m bench.ab`` takes them) is served by one
hypercorn Trio worker on CPU 0 in front of ``bench/node/upstream.js``; wrk drives
non-streamed requests at ``--conc`` from CPU 1 for ``--duration`` seconds. Around the
point, every thread's user and system time is read from ``/proc/PID/task/TID/stat``,
so the event loop's share (the worker's main thread) and a helper thread's (the audit
log's writer) are told apart: ``bench.ab`` sees only their sum. Revisions alternate
within each round, as in ``bench.ab``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from . import systems
from .ab import _spec, interleaved, wrk


def thread_times(pids: list[int]) -> dict[tuple[int, str], float]:
    """CPU seconds so far of every thread of ``pids``, by (thread id, name); a process's
    first thread (the event loop's, in a worker) is named ``main``."""
    out: dict[tuple[int, str], float] = {}
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            name = "main" if int(task.name) == pid else stat.split("(", 1)[1].rsplit(")", 1)[0]
            out[int(task.name), name] = systems.stat_seconds(stat)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.thread_cpu",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("revs", nargs="+", help="REV[@HYPERCORN.toml][+GATEWAY.toml], as bench.ab takes them")
    ap.add_argument("--conc", type=int, default=16)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=3)
    ns = ap.parse_args(argv)
    snaps = {rev: systems.snapshot(_spec(rev)[0]) for rev in ns.revs}
    for rnd, rev, _sha, gw, key in interleaved(ns.revs, snaps, ns.rounds, "threads"):
        url = gw.base + "/v1/chat/completions"
        wrk(url, 4, 1.0, stream=True, key=key)
        time.sleep(1.5)  # let helper threads (a writer's first batch) start
        pids = gw.pids()
        before = thread_times(pids)
        point = wrk(url, ns.conc, ns.duration, stream=False, key=key)
        after = thread_times(pids)
        n = max(point["requests"], 1)
        per = {k: (after[k] - before.get(k, 0.0)) / n * 1e6 for k in after}
        busy = {k: v for k, v in per.items() if v >= 0.5}
        threads = ", ".join(f"{name} {tid}: {us:.1f}" for (tid, name), us in sorted(busy.items()))
        print(f"round {rnd + 1} {rev}: {point['rps']:.0f} req/s, "
              f"{sum(per.values()):.1f} µs CPU/req ({threads})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
