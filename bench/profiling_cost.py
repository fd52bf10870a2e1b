"""What a running /debug/profile or /debug/trace costs the worker it looks at (wrk, Node upstream).

    .venv/bin/python -m bench.profiling_cost [--rev HEAD] [--duration 8] [--rounds 3]

One hypercorn Trio worker (CPU 0) serves ``git archive REV src`` in front of
``bench/node/upstream.js`` (zero delay, 16 deltas); wrk drives it from CPU 1, as in
``bench/ab.py``. Each point runs three ways, interleaved within a round so drift of
the machine hits them alike: nothing running; a CPU profile running for the whole
wrk run; a run-loop trace running for the whole wrk run. The profile or trace is
asked for just before wrk starts and lasts a second longer than it; its rendering
happens after wrk has finished, so what is measured is the cost of sampling or
recording while serving. The table keeps each point's median round.

Writes bench/results/<date>/profiling.md (and .json with every round).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from . import systems
from .ab import node_upstream, wrk
from .systems import LOAD_CPU, ROOT, SYSTEM_CPU, GatewayAuth

VARIANTS = ("none", "profile", "trace")
POINTS = (("stream", 16), ("stream", 64), ("json", 16))


class Background(threading.Thread):
    """GET a debug endpoint in a thread; keeps the status, body size and how long it took."""

    def __init__(self, url: str, key: str) -> None:
        super().__init__(daemon=True)
        self.request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
        self.status = 0
        self.size = 0
        self.elapsed = 0.0
        self.body = b""

    def run(self) -> None:
        t0 = time.monotonic()
        with urllib.request.urlopen(self.request, timeout=300) as r:
            self.status = r.status
            self.body = r.read()
        self.size = len(self.body)
        self.elapsed = time.monotonic() - t0


def admin_auth() -> GatewayAuth:
    auth = systems.gateway_auth()
    if auth is None:
        raise RuntimeError("this build has no auth; the debug endpoints need an admin key")
    # gateway_auth's TOML ends inside its one [[auth.keys]] table: make that key an admin.
    return GatewayAuth(auth.plain, auth.toml + "admin = true\n")


def one_point(base: str, key: str, variant: str, mode: str, conc: int, seconds: float) -> dict[str, Any]:
    url = base + "/v1/chat/completions"
    bg: Background | None = None
    if variant != "none":
        path = "profile" if variant == "profile" else "trace"
        bg = Background(f"{base}/debug/{path}?seconds={seconds + 1:g}", key)
        bg.start()
        time.sleep(0.3)  # the profiler or instrument is in place before wrk starts
    point = wrk(url, conc, seconds, stream=mode == "stream", key=key)
    if bg is not None:
        bg.join()
        point["debug_status"] = bg.status
        point["debug_bytes"] = bg.size
        point["debug_seconds"] = round(bg.elapsed, 2)
        if variant == "trace" and bg.status == 200:
            other = json.loads(bg.body)["otherData"]
            point["trace_events"] = other["events"]
            point["trace_dropped"] = other["events_dropped"]
    return point


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.profiling_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--rev", default="HEAD", help="git revision to measure (default HEAD)")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds per wrk run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    src, sha = systems.snapshot(ns.rev)
    systems.SNAPSHOT = src
    auth = admin_auth()
    load_before = loadavg()
    results: dict[str, dict[str, list[dict[str, Any]]]] = {v: {} for v in VARIANTS}
    started = time.monotonic()
    with node_upstream() as up, systems.gateway(
        f"profiling-{sha}", {"/v1/chat/completions": up.base}, auth=auth
    ) as gw:
        wrk(gw.base + "/v1/chat/completions", 4, 1.0, stream=True, key=auth.plain)  # warm-up
        for rnd in range(ns.rounds):
            for mode, conc in POINTS:
                tag = f"{mode}-c{conc}"
                for variant in VARIANTS:
                    p = one_point(gw.base, auth.plain, variant, mode, conc, ns.duration)
                    results[variant].setdefault(tag, []).append(p)
                    extra = ""
                    if "trace_events" in p:
                        extra = f" (trace: {p['trace_events']} events, {p['trace_dropped']} dropped)"
                    print(f"round {rnd + 1} {tag} {variant}: {p['rps']:.0f} req/s p50 {p['p50_ms']:.2f} "
                          f"p99 {p['p99_ms']:.2f} ms errors {p['errors']}{extra}", flush=True)
    load_after = loadavg()
    median = {
        v: {tag: _median(points) for tag, points in tags.items()} for v, tags in results.items()
    }
    cmd = "python -m bench.profiling_cost " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [
        f"# Throughput while a profile or a trace runs ({dt.date.today().isoformat()})",
        "",
        f"Command: `.venv/bin/{cmd.strip()}` ({time.monotonic() - started:.0f} s), revision {sha}. "
        f"One hypercorn Trio worker on CPU {SYSTEM_CPU}; `bench/node/upstream.js` (16 deltas, zero "
        f"delay) and wrk on CPU {LOAD_CPU}; auth on (an admin key); {ns.duration:g} s per point, "
        f"median of {ns.rounds} rounds, the three variants interleaved within each round. "
        f"{os.cpu_count()} CPUs; load average before {load_before}, after {load_after}.",
        "",
        "- **none**: nothing running.",
        "- **profile**: `GET /debug/profile?seconds=N` (the SIGPROF sampler, 1 ms of CPU time, at most one sample per kernel tick) for the whole wrk run.",
        "- **trace**: `GET /debug/trace?seconds=N` (the run-loop instrument, default cap of "
        "200,000 events) for the whole wrk run.",
        "",
        "| point | none | profile | trace |",
        "|---|---|---|---|",
    ]
    for mode, conc in POINTS:
        tag = f"{mode}-c{conc}"
        base = median["none"][tag]["rps"]
        cells = []
        for v in VARIANTS:
            p = median[v][tag]
            delta = "" if v == "none" else f" ({100 * (p['rps'] / base - 1):+.0f} %)"
            cells.append(f"{p['rps']:.0f} req/s{delta}, p50 {p['p50_ms']:.2f} / p99 {p['p99_ms']:.2f} ms"
                         + (f", {p['errors']} errors" if p["errors"] else ""))
        lines.append(f"| {tag} | " + " | ".join(cells) + " |")
    traces = [tags[0] for tags in results["trace"].values() if "trace_events" in tags[0]]
    if traces:
        lines += [
            "",
            "Traces: " + ", ".join(
                f"{p['trace_events']:,} events kept / {p['trace_dropped']:,} dropped, "
                f"{p['debug_bytes'] / 1e6:.1f} MB, answered {p['debug_seconds']:.1f} s after asking"
                for p in traces[: len(POINTS)]
            ) + " (first round).",
        ]
    profiles = [tags[0] for tags in results["profile"].values() if "debug_bytes" in tags[0]]
    if profiles:
        lines += [
            "",
            "Profiles (speedscope JSON): " + ", ".join(
                f"{p['debug_bytes'] / 1e3:.0f} kB, answered {p['debug_seconds']:.1f} s after asking"
                for p in profiles[: len(POINTS)]
            ) + " (first round).",
        ]
    out = Path(ns.out) if ns.out else ROOT / "bench" / "results" / dt.date.today().isoformat() / "profiling.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))
    print(f"wrote {out}")
    return 0


def _median(points: list[dict[str, Any]]) -> dict[str, Any]:
    ranked = sorted(points, key=lambda p: p["rps"])
    mid = ranked[len(ranked) // 2]
    return {**mid, "rps": statistics.median(p["rps"] for p in points)}


if __name__ == "__main__":
    sys.exit(main())
