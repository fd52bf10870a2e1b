"""What the response cache costs and saves: a hit against a miss, and single flight.

    .venv/bin/python -m bench.cache [--duration 8] [--rounds 2] [--flight 50,200] [--snapshot HEAD]

One gateway (hypercorn, one Trio worker, pinned to CPU 0; auth on) serves two routes
in front of the same upstream: ``/v1/chat/completions`` without a cache and
``/v1/cached`` with one (memory backend). The requests are deterministic
(``temperature: 0``), so the cached route may store them.

1. Hit against miss (wrk, ``bench/node/upstream.js``: zero delay, 16 deltas, on CPU 1;
   the :mod:`bench.ab` helpers): non-streamed and streamed at c = 1, 16, 64, for
   the route without a cache, the cached route asked ``Cache-Control: no-cache``
   (every request a miss: the model through a flight, then stored), and the cached
   route's hits. Rounds interleave the variants; each point keeps its best round.
2. Single flight (``aiserve-sim``: 500 ms to the first token, then 64 tokens 10 ms
   apart): N identical streams sent at once, with and without the cache; the
   sim's own request count (``GET /sim/stats``), the time until the last stream
   ended, and the streams' p50 / p99.

Writes ``bench/results/<date>/cache.md`` (and ``cache.json``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import trio

from . import systems
from .ab import node_upstream, wrk
from .loadgen import Connection, Sample, Target, percentile
from .systems import LOAD_CPU, ROOT, SYSTEM_CPU, Running

CACHED = "/v1/cached"
PLAIN = "/v1/chat/completions"
#: Fields post.lua puts in front of "stream" (BENCH_EXTRA): a deterministic request.
DETERMINISTIC = '"temperature":0,'
SIM_ARGS = ["--prefill-overhead-ms", "500", "--prefill-per-token-ms", "0", "--itl-ms", "10",
            "--itl-std-ms", "0", "--ttft-std-ms", "0", "--output-tokens-mean", "64",
            "--output-tokens-std", "0"]  # fmt: skip


def cached_route(upstream: str) -> str:
    """TOML: an adapter on ``upstream`` and the cached route on it."""
    return f"""
[adapters.cached]
kind = "openai"
base_url = "{upstream}/v1"
models = ["sim-model"]
max_connections = 20000
max_retries = 2

[[routes]]
path = "{CACHED}"
name = "cached"
adapter = "cached"
default_model = "sim-model"
cache = {{ ttl_s = 3600 }}
"""


def hit_vs_miss(ns: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """wrk points per variant: {variant: {tag: best point}}."""
    variants = {
        "no cache": (PLAIN, ""),
        "miss (no-cache)": (CACHED, "no-cache"),
        "hit": (CACHED, ""),
    }
    concs = [int(c) for c in ns.conc.split(",")]
    rounds: dict[str, dict[str, list[dict[str, Any]]]] = {v: {} for v in variants}
    os.environ["BENCH_EXTRA"] = DETERMINISTIC
    with node_upstream() as up:
        auth = systems.gateway_auth()
        key = auth.plain if auth is not None else None
        with systems.gateway("cache", {PLAIN: up.base}, auth=auth, extra=cached_route(up.base)) as gw:
            for rnd in range(ns.rounds):
                for variant, (path, control) in variants.items():
                    os.environ["BENCH_CACHE_CONTROL"] = control
                    url = gw.base + path
                    wrk(url, 4, ns.warmup, stream=True, key=key)  # warm (and store the hit)
                    for stream in (False, True):
                        for c in concs:
                            point = wrk(url, c, ns.duration, stream=stream, key=key)
                            tag = f"{'stream' if stream else 'json'}-c{c}"
                            rounds[variant].setdefault(tag, []).append(point)
                            print(f"round {rnd + 1} {variant} {tag}: {point['rps']:.0f} req/s "
                                  f"p50 {point['p50_ms']:.2f} ms p99 {point['p99_ms']:.2f} ms "
                                  f"errors {point['errors']}", flush=True)
            stats = _metrics(gw, key)
    os.environ.pop("BENCH_CACHE_CONTROL", None)
    best = {
        v: {tag: max(points, key=lambda p: p["rps"]) for tag, points in tags.items()}
        for v, tags in rounds.items()
    }
    return {"best": best, "rounds": rounds, "metrics": stats}  # type: ignore[dict-item]


def _metrics(gw: Running, key: str | None) -> dict[str, float]:
    """The gateway's cache counters after the run."""
    req = urllib.request.Request(gw.base + "/metrics")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    text = urllib.request.urlopen(req, timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(("aiserve_cache_requests_total", "aiserve_cache_stores_total")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def _burst(url: str, n: int, key: str | None, question: str) -> tuple[list[Sample], float]:
    """``n`` identical streams sent at once, each on its own connection."""
    body = json.dumps(
        {"model": "sim-model", "stream": True, "temperature": 0,
         "messages": [{"role": "user", "content": question}]}
    ).encode()  # fmt: skip
    headers = [("Authorization", f"Bearer {key}")] if key else []
    target = Target.from_url(url, body, headers)
    conns = [Connection(target) for _ in range(n)]
    samples = [Sample(start=0.0) for _ in range(n)]
    t0 = time.perf_counter()
    with trio.move_on_after(60):
        async with trio.open_nursery() as nursery:
            for conn, sample in zip(conns, samples, strict=True):
                nursery.start_soon(conn.run, sample, t0)
    span = time.perf_counter() - t0
    for conn in conns:
        await conn.aclose()
    return samples, span


def _sim(sim: Running, what: str) -> dict[str, Any]:
    method = "POST" if what == "reset" else "GET"
    req = urllib.request.Request(f"{sim.base}/sim/{what}", method=method)
    data: dict[str, Any] = json.loads(urllib.request.urlopen(req, timeout=5).read() or b"{}")
    return data


def single_flight(ns: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    with systems.sim(SIM_ARGS, name="cache-sim") as sim:
        auth = systems.gateway_auth()
        key = auth.plain if auth is not None else None
        extra = cached_route(sim.base)
        with systems.gateway("cache-flight", {PLAIN: sim.base}, auth=auth, extra=extra) as gw:
            for n in (int(x) for x in ns.flight.split(",")):
                for label, path in (("no cache", PLAIN), ("cache", CACHED)):
                    _sim(sim, "reset")
                    # A question of its own per burst: nothing stored yet for it.
                    question = f"what is single flight? ({label}, {n})"
                    samples, span = trio.run(_burst, gw.base + path, n, key, question)
                    calls = _sim(sim, "stats")["requests"]
                    ok = [s for s in samples if s.error is None and s.total is not None]
                    totals = [s.total * 1000 for s in ok if s.total is not None]
                    point = {
                        "n": n, "variant": label, "upstream_calls": calls,
                        "complete": len(ok), "errors": n - len(ok),
                        "last_ms": max(totals) if totals else None,
                        "p50_ms": percentile(totals, 50), "p99_ms": percentile(totals, 99),
                        "span_ms": span * 1000,
                    }  # fmt: skip
                    out.append(point)
                    print(f"single flight n={n} {label}: {calls} upstream calls, "
                          f"{len(ok)}/{n} complete, last stream ended at "
                          f"{point['last_ms']:.0f} ms", flush=True)
    return out


def report(ns: argparse.Namespace, hm: dict[str, Any], sf: list[dict[str, Any]], took: float) -> str:
    best = hm["best"]
    tags = list(next(iter(best.values())))
    load = " → ".join(" ".join(f"{x:.2f}" for x in avg) for avg in ns.load)
    lines = [
        f"# Response cache: a hit against a miss, and single flight ({dt.date.today().isoformat()})",
        "",
        f"Command: `python -m bench.cache {' '.join(sys.argv[1:])}` ({took:.0f} s), "
        f"serving `{ns.sha}` (`git archive`). One hypercorn Trio worker on CPU {SYSTEM_CPU}, auth on; the "
        f"upstream and the load generators on CPU {LOAD_CPU}. Deterministic requests "
        f"(`temperature: 0`). Load average at the start and the end: {load} (two cores, "
        "shared with other work).",
        "",
        "## A hit against a miss",
        "",
        f"wrk, `bench/node/upstream.js` (zero delay, 16 deltas); {ns.duration:g} s per "
        f"point, best of {ns.rounds} interleaved rounds. *no cache*: the route without a "
        "cache; *miss*: the cached route asked `Cache-Control: no-cache` (the model "
        "through a flight, the answer stored); *hit*: the cached route, answered from "
        "the memory backend.",
        "",
        "| variant | " + " | ".join(tags) + " |",
        "|---|" + "---|" * len(tags),
    ]
    for variant, points in best.items():
        cells = [f"{p['rps']:.0f} req/s, p50 {p['p50_ms']:.2f} / p99 {p['p99_ms']:.2f} ms"
                 + (f", {p['errors']} errors" if p["errors"] else "")
                 for p in points.values()]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    lines += ["", "Cache counters at the end of the run:", "", "```"]
    lines += [f"{k} {v:g}" for k, v in sorted(hm["metrics"].items())]
    lines += ["```", "", "## Single flight", "",
              "`aiserve-sim`: 500 ms to the first token, then 64 tokens 10 ms apart. N "
              "identical streams sent at once, each on its own connection (bench/loadgen.py's "
              "client); upstream calls from the sim's own count (`GET /sim/stats`).", "",
              "| N | variant | upstream calls | complete | last stream ended | p50 | p99 |",
              "|---|---|---|---|---|---|---|"]
    for p in sf:
        lines.append(
            f"| {p['n']} | {p['variant']} | {p['upstream_calls']} | {p['complete']}/{p['n']} | "
            f"{p['last_ms']:.0f} ms | {p['p50_ms']:.0f} ms | {p['p99_ms']:.0f} ms |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cache", description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=8.0, help="seconds per wrk point")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--conc", default="1,16,64")
    ap.add_argument("--flight", default="50,200", help="streams sent at once")
    ap.add_argument("--out", default=None)
    ap.add_argument("--snapshot", default="HEAD", help="the git revision whose src/ is served")
    ns = ap.parse_args(argv)
    # The gateway and the sim run this commit's code, not the installed package.
    systems.SNAPSHOT, ns.sha = systems.snapshot(ns.snapshot)
    started = time.monotonic()
    ns.load = [os.getloadavg()]
    hm = hit_vs_miss(ns)
    sf = single_flight(ns)
    ns.load.append(os.getloadavg())
    text = report(ns, hm, sf, time.monotonic() - started)
    out = Path(ns.out) if ns.out else ROOT / "bench" / "results" / dt.date.today().isoformat() / "cache.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"hit_vs_miss": hm, "single_flight": sf}, indent=1))
    print(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
