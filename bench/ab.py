"""Side-by-side throughput of the gateway at several git revisions (wrk, Node upstream).

    .venv/bin/python -m bench.ab BEFORE AFTER [--duration 8] [--rounds 2]
    .venv/bin/python -m bench.ab HEAD@bench/configs/hypercorn-accesslog.toml HEAD

``REV@FILE`` serves ``REV`` with the hypercorn config ``FILE`` instead of
``bench/configs/hypercorn-bench.toml``; ``REV+FILE`` appends the gateway TOML in
``FILE`` to the generated config (both may be given: ``REV@FILE+FILE``). The audit
log's cost, on and off in one run (prices set in both)::

    .venv/bin/python -m bench.ab HEAD+bench/configs/audit-off.toml \
        HEAD+bench/configs/audit-on.toml --conc 16 --duration 8 --rounds 3

``--modes json`` measures only the non-streamed requests (``stream`` only the streamed).

``--together`` serves every revision at once, all on the gateway's CPU, each driven by a
wrk of its own, and compares their CPU per request (each round fresh processes, started
in turn, in reverse order every other round). Consecutive points of the interleaved
mode see a different machine (two 8 s points of one build differ by up to 12 % here),
which buries a 3 % effect under 16 rounds; gateways served together see the same
moment's machine, and what separates two runs of one build is the process's own luck
(hash seed, memory layout), 1-3 % here. The audit log's cost measured that way::

    .venv/bin/python -m bench.ab HEAD+bench/configs/audit-off.toml \
        HEAD+bench/configs/audit-on.toml --together --conc 16 --modes json --warmup 5 \
        --rounds 12

Sharing one CPU makes each request dearer (~800 against ~630 µs here): the change in µs
is the figure to carry over to a worker alone on its CPU, the change in % understates it.

Each revision's ``src/`` is exported with ``git archive`` (``systems.snapshot``)
and served by hypercorn (one Trio worker, pinned to CPU 0) in front of
``bench/node/upstream.js`` (a zero-delay OpenAI-compatible server, 16 deltas);
``wrk`` drives it from CPU 1, non-streamed and streamed, at each concurrency.
Revisions alternate within each round, so drift of the machine hits them
alike; the table keeps each point's best round (noise only ever slows a
point). Each point also reports the gateway's CPU time per request (its
processes' user + system time over the requests wrk counted): on a shared
machine the steadier of the two numbers. wrk does ~14,000 streamed req/s against the upstream alone on one
core here: far above what it measures.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import systems
from .stats import mean_interval, paired_changes
from .systems import LOAD_CPU, ROOT, SYSTEM_CPU, WORK, Running, free_port, pinned

NODE_DIR = ROOT / "bench" / "node"
_JSON = re.compile(r"^JSON (\{.*\})$", re.M)


@contextlib.contextmanager
def node_upstream(
    deltas: int = 16, cpu: str | None = LOAD_CPU, tls: systems.UpstreamPKI | None = None,
    http2: bool = False,
) -> Iterator[Running]:
    """bench/node/upstream.js on the load generator's CPU (``cpu``; None: any); over HTTPS
    with ``tls``'s certificate, and HTTP/2 over ALPN as well with ``http2``."""
    node = shutil.which("node")
    if node is None:
        raise RuntimeError("node is not installed (apt-get install nodejs)")
    port = free_port()
    cmd = [node, str(NODE_DIR / "upstream.js"), str(port), str(deltas)]
    env = {} if tls is None else {
        "UPSTREAM_CERT": str(tls.cert), "UPSTREAM_KEY": str(tls.key),
        "UPSTREAM_H2": "1" if http2 else "0",
    }
    with systems.start("upstream", cmd, port=port, health="/v1/models", cpu=cpu, env=env,
                       ours=False, tls=tls) as r:
        yield r


def wrk(
    url: str, conc: int, seconds: float, *, stream: bool, key: str | None, headers: str = "",
    cpu: str | None = LOAD_CPU,
) -> dict[str, Any]:
    """One wrk point: req/s, latency percentiles (ms), errors.

    ``headers``: more request headers, ``"Name: value|Name: value"``; ``cpu``: where
    wrk runs (None: anywhere).
    """
    return wrk_result(wrk_start(url, conc, seconds, stream=stream, key=key, headers=headers,
                                cpu=cpu, threads=1 if conc < 4 else 2))


def wrk_start(
    url: str, conc: int, seconds: float, *, stream: bool, key: str | None, headers: str = "",
    cpu: str | None = LOAD_CPU, threads: int = 2, timeout_s: float | None = None,
) -> subprocess.Popen[str]:
    """A wrk point started (:func:`wrk_result` waits for it): several run at once in
    ``--together`` mode. ``timeout_s``: wrk's request timeout (its default is 2 s)."""
    exe = shutil.which("wrk")
    if exe is None:
        raise RuntimeError("wrk is not installed (apt-get install wrk)")
    cmd = pinned(
        [exe, f"-t{threads}", f"-c{conc}", f"-d{seconds:g}s", "--latency",
         *(["--timeout", f"{timeout_s:g}s"] if timeout_s is not None else []),
         "-s", str(NODE_DIR / "post.lua"), url],
        cpu,
    )
    env = {**os.environ, "BENCH_STREAM": "1" if stream else "0", "BENCH_KEY": key or "",
           "BENCH_HEADERS": headers}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)


def wrk_result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """A started wrk point's req/s, latency percentiles (ms) and errors."""
    out, _ = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"wrk exited with {proc.returncode}:\n{out}")
    m = _JSON.search(out)
    if m is None:
        raise RuntimeError(f"wrk printed no summary:\n{out}")
    raw = json.loads(m.group(1))
    return {
        "rps": raw["requests"] / (raw["duration_us"] / 1e6),
        "p50_ms": raw["p50_us"] / 1000,
        "p90_ms": raw["p90_us"] / 1000,
        "p99_ms": raw["p99_us"] / 1000,
        "errors": raw["errors"] + raw["non2xx"],
        "requests": raw["requests"],
    }


@contextlib.contextmanager
def gateway_at(
    rev_src: Path, upstream: Running, name: str, hypercorn_config: Path | None = None,
    extra: str = "",
) -> Iterator[tuple[Running, str | None]]:
    """The gateway from one snapshot, auth on with a fresh bench key."""
    saved = systems.SNAPSHOT
    systems.SNAPSHOT = rev_src
    try:
        auth = systems.gateway_auth()
        with systems.gateway(name, {"/v1/chat/completions": upstream.base}, auth=auth,
                             hypercorn_config=hypercorn_config, extra=extra) as gw:
            yield gw, auth.plain if auth is not None else None
    finally:
        systems.SNAPSHOT = saved


def paired(base: list[dict[str, Any]], other: list[dict[str, Any]]) -> dict[str, float]:
    """``other``'s points against ``base``'s of the same round: the median, smallest and
    largest change of req/s (percent) and of CPU per request (µs); and the median change
    of CPU per request over the even rounds (0, 2...) and over the odd ones apart.

    Rounds interleave the revisions, so a round's two points saw the same machine;
    their difference cancels the drift that a best-of-rounds comparison keeps. With
    ``--together`` the even rounds start the first revision first and the odd ones
    last: the worker started first is dearer, and a build with a process of its own
    swings far more with the order (docs/architecture.md), so the two medians say
    whether the overall one stands for both.

    Also the mean change of req/s and of CPU per request (percent) with a 95 %
    bootstrap interval over the rounds (``stats.mean_interval``): how far the mean
    could be off with this many rounds.
    """
    rps_changes, cpu_changes = paired_changes(base, other)
    rps = sorted(rps_changes)
    diffs = [o["cpu_us"] - b["cpu_us"] for b, o in zip(base, other, strict=True)]
    cpu = sorted(diffs)
    cpu_pct = sorted(cpu_changes)
    odd = diffs[1::2]
    rps_mean = mean_interval(rps)
    cpu_mean = mean_interval(cpu_pct)
    return {
        "rps_mean": rps_mean[0], "rps_mean_lo": rps_mean[1], "rps_mean_hi": rps_mean[2],
        "cpu_pct_mean": cpu_mean[0], "cpu_pct_mean_lo": cpu_mean[1],
        "cpu_pct_mean_hi": cpu_mean[2],
        "rps_pct": statistics.median(rps), "rps_pct_lo": rps[0], "rps_pct_hi": rps[-1],
        "cpu_us": statistics.median(cpu), "cpu_us_lo": cpu[0], "cpu_us_hi": cpu[-1],
        "cpu_pct": statistics.median(cpu_pct), "cpu_pct_lo": cpu_pct[0],
        "cpu_pct_hi": cpu_pct[-1],
        "cpu_us_even": statistics.median(diffs[::2]),
        "cpu_us_odd": statistics.median(odd) if odd else float("nan"),
    }


def _spec(rev: str) -> tuple[str, str | None, str | None]:
    """``REV[@HYPERCORN.toml][+GATEWAY.toml]`` -> (revision, hypercorn config, extra TOML)."""
    rev, _, more = rev.partition("+")
    rev, _, hypercorn = rev.partition("@")
    return rev, hypercorn or None, more or None


@contextlib.contextmanager
def _serving(
    rev: str, snaps: dict[str, tuple[Path, str]], up: Running, prefix: str
) -> Iterator[tuple[str, Running, str | None]]:
    """``REV[@HYPERCORN.toml][+GATEWAY.toml]`` served: (sha, the gateway, its bench key)."""
    src, sha = snaps[rev]
    _, hc, more = _spec(rev)
    cfg = ROOT / hc if hc else None
    extra = (ROOT / more).read_text() if more else ""
    name = f"{prefix}-{sha}" + (f"-{Path(more).stem}" if more else "")
    with gateway_at(src, up, name, cfg, extra) as (gw, key):
        yield sha, gw, key


def by_name(upstream: Running, host: str | None) -> Running:
    """``upstream`` as the gateway is to reach it: by ``host`` instead of 127.0.0.1 (None:
    as it is). A host name is resolved by the gateway (``trio.open_tcp_stream`` runs
    ``getaddrinfo`` in a thread), as a hosted provider's or a Kubernetes service's is."""
    if host is None:
        return upstream
    scheme, sep, rest = upstream.base.partition("://127.0.0.1:")
    if not sep:
        raise ValueError(f"not an upstream on 127.0.0.1: {upstream.base}")
    return dataclasses.replace(upstream, base=f"{scheme}://{host}:{rest}")


def interleaved(
    revs: list[str], snaps: dict[str, tuple[Path, str]], rounds: int, tag: str,
    upstream_host: str | None = None,
) -> Iterator[tuple[int, str, str, Running, str | None]]:
    """Each ``REV[@HYPERCORN.toml][+GATEWAY.toml]`` served in turn, ``rounds`` times, in
    front of one Node upstream: (round, rev, sha, the gateway, its bench key) while it runs.

    Revisions alternate within each round, so drift of the machine hits them alike.
    ``upstream_host``: the gateways reach the upstream by this name (:func:`by_name`).
    """
    with node_upstream() as up:
        target = by_name(up, upstream_host)
        for rnd in range(rounds):
            for rev in revs:
                with _serving(rev, snaps, target, tag) as (sha, gw, key):
                    yield rnd, rev, sha, gw, key


def together(
    revs: list[str], snaps: dict[str, tuple[Path, str]], rounds: int, tag: str,
    upstream_host: str | None = None,
) -> Iterator[tuple[int, list[tuple[str, str, Running, str | None]]]]:
    """Every ``REV[@HYPERCORN.toml][+GATEWAY.toml]`` served at once, all on the gateway's
    one CPU, ``rounds`` times (fresh processes each round, started in turn, in the
    reverse order every other round): (round, [(rev, sha, the gateway, its bench key)]).

    Driven at the same time, the gateways share every moment of the machine, so the
    drift that separates the points of :func:`interleaved` (a few % between two
    consecutive 8 s points here) hits them alike; what is left between two runs of
    the same build is the process's own luck (hash seed, memory layout), ~1-2 %, which
    fresh processes each round average out. ``upstream_host``: as in :func:`interleaved`.
    """
    with node_upstream() as up:
        target = by_name(up, upstream_host)
        for rnd in range(rounds):
            order = list(enumerate(revs))
            if rnd % 2:
                order.reverse()
            with contextlib.ExitStack() as stack:
                served: dict[int, tuple[str, str, Running, str | None]] = {}
                for i, rev in order:
                    sha, gw, key = stack.enter_context(_serving(rev, snaps, target, f"{tag}{i}"))
                    served[i] = (rev, sha, gw, key)
                yield rnd, [served[i] for i in range(len(revs))]


def _together_points(
    ns: argparse.Namespace, modes: list[str], concs: list[int],
    snaps: dict[str, tuple[Path, str]], results: dict[str, dict[str, list[dict[str, Any]]]],
) -> None:
    for rnd, served in together(ns.revs, snaps, ns.rounds, "ab", ns.upstream_host):
        urls = [gw.base + "/v1/chat/completions" for _, _, gw, _ in served]
        warm = [wrk_start(u, 4, ns.warmup, stream=True, key=k, threads=1)
                for u, (_, _, _, k) in zip(urls, served, strict=True)]
        for proc in warm:
            wrk_result(proc)
        for stream in [m == "stream" for m in modes]:
            for c in concs:
                cpu0 = [gw.cpu_seconds() for _, _, gw, _ in served]
                procs = [wrk_start(u, c, ns.duration, stream=stream, key=k, threads=1)
                         for u, (_, _, _, k) in zip(urls, served, strict=True)]
                points = [wrk_result(proc) for proc in procs]
                tag = f"{'stream' if stream else 'json'}-c{c}"
                for (rev, sha, gw, _), point, before in zip(served, points, cpu0, strict=True):
                    point["cpu_us"] = (gw.cpu_seconds() - before) / max(point["requests"], 1) * 1e6
                    results[rev].setdefault(tag, []).append(point)
                    print(f"round {rnd + 1} {sha} {tag}: {point['rps']:.0f} req/s "
                          f"{point['cpu_us']:.0f} us CPU/req errors {point['errors']} ({rev})",
                          flush=True)


def _interleaved_points(
    ns: argparse.Namespace, modes: list[str], concs: list[int],
    snaps: dict[str, tuple[Path, str]], results: dict[str, dict[str, list[dict[str, Any]]]],
) -> None:
    for rnd, rev, sha, gw, key in interleaved(ns.revs, snaps, ns.rounds, "ab", ns.upstream_host):
        url = gw.base + "/v1/chat/completions"
        wrk(url, 4, ns.warmup, stream=True, key=key)
        for stream in [m == "stream" for m in modes]:
            for c in concs:
                cpu0 = gw.cpu_seconds()
                point = wrk(url, c, ns.duration, stream=stream, key=key)
                cpu = gw.cpu_seconds() - cpu0
                point["cpu_us"] = cpu / max(point["requests"], 1) * 1e6
                tag = f"{'stream' if stream else 'json'}-c{c}"
                results[rev].setdefault(tag, []).append(point)
                print(f"round {rnd + 1} {sha} {tag}: {point['rps']:.0f} req/s "
                      f"p50 {point['p50_ms']:.2f} ms p99 {point['p99_ms']:.2f} ms "
                      f"{point['cpu_us']:.0f} us CPU/req errors {point['errors']}",
                      flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n")[0])
    ap.add_argument("revs", nargs="+", help="git revisions to compare, e.g. faf2680 HEAD")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds per point")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--conc", default="1,16,64")
    ap.add_argument("--modes", default="json,stream",
                    help="json (non-streamed), stream, or both (the default)")
    ap.add_argument("--together", action="store_true",
                    help="serve all revisions at once on the gateway's CPU, each driven by "
                    "its own wrk: CPU per request compared under the same moment's machine")
    ap.add_argument("--upstream-host", default=None, metavar="NAME",
                    help="the gateways reach the upstream by this host name (e.g. localhost) "
                    "instead of 127.0.0.1: resolved in a thread, as a provider's name is")
    ap.add_argument("--out", default=None, help="markdown report (default bench/results/<date>/ab.md)")
    ns = ap.parse_args(argv)
    concs = [int(c) for c in ns.conc.split(",")]
    modes = [m.strip() for m in ns.modes.split(",")]
    if not modes or any(m not in ("json", "stream") for m in modes):
        ap.error(f"--modes: json, stream or json,stream, not {ns.modes!r}")
    snaps = {rev: systems.snapshot(_spec(rev)[0]) for rev in ns.revs}
    results: dict[str, dict[str, list[dict[str, Any]]]] = {rev: {} for rev in ns.revs}
    started = time.monotonic()
    load0 = os.getloadavg()[0]
    ticks0 = systems.read_cpu_ticks()
    if ns.together and len(set(ns.revs)) != len(ns.revs):
        ap.error("--together: name each revision once (the results are kept by name)")
    points = _together_points if ns.together else _interleaved_points
    points(ns, modes, concs, snaps, results)
    best = {
        rev: {tag: max(points, key=lambda p: p["rps"]) for tag, points in tags.items()}
        for rev, tags in results.items()
    }
    reached = f"the upstream reached as `{ns.upstream_host}`; " if ns.upstream_host else ""
    lines = [
        f"# Gateway throughput by revision ({dt.date.today().isoformat()})",
        "",
        f"Command: `python -m bench.ab {' '.join(sys.argv[1:] if argv is None else argv)}` "
        f"({time.monotonic() - started:.0f} s). "
        + (f"All {len(ns.revs)} revisions served at once, each by one hypercorn Trio worker, "
           f"all on CPU {SYSTEM_CPU} (fresh processes each round); each driven by a wrk of its "
           f"own on CPU {LOAD_CPU}, beside `bench/node/upstream.js` (16 deltas, zero delay); "
           + reached + "auth on. Sharing one CPU, a worker's req/s is its share of it: the figure to "
           "compare is the CPU per request. "
           if ns.together else
           f"One hypercorn Trio worker on CPU {SYSTEM_CPU}; `bench/node/upstream.js` (16 "
           f"deltas, zero delay) and wrk on CPU {LOAD_CPU}; " + reached + "auth on. ")
        + f"{ns.duration:g} s per point, best of {ns.rounds} "
        f"{'rounds' if ns.together else 'interleaved rounds'} (req/s; the "
        f"lowest CPU per request). Load average {load0:.2f} at the start, "
        f"{os.getloadavg()[0]:.2f} at the end; "
        f"{systems.stolen_pct(ticks0, systems.read_cpu_ticks()):.1f} % of the CPU time "
        f"stolen by the hypervisor. Host: {systems.host()}.",
        "",
        "| revision | " + " | ".join(best[ns.revs[0]]) + " |",
        "|---|" + "---|" * len(best[ns.revs[0]]),
    ]
    for rev in ns.revs:
        cells = [f"{p['rps']:.0f} req/s, p50 {p['p50_ms']:.2f} / p99 {p['p99_ms']:.2f} ms, "
                 f"{min(q['cpu_us'] for q in results[rev][tag]):.0f} µs CPU/req"
                 + (f", {p['errors']} errors" if p["errors"] else "")
                 for tag, p in best[rev].items()]
        lines.append(f"| {snaps[rev][1]} ({rev}) | " + " | ".join(cells) + " |")
    if len(ns.revs) > 1:
        lines += ["", f"Against {snaps[ns.revs[0]][1]} ({ns.revs[0]}) in the same round: the median "
                  "change of req/s and of CPU per request over the rounds, with the smallest and "
                  "largest (a difference smaller than its spread is noise); then the mean change with "
                  "a 95 % bootstrap interval over the rounds (how far the mean could be off).", "",
                  "| revision | " + " | ".join(best[ns.revs[0]]) + " |",
                  "|---|" + "---|" * len(best[ns.revs[0]])]
        for rev in ns.revs[1:]:
            cells = []
            for tag in best[rev]:
                d = paired(results[ns.revs[0]][tag], results[rev][tag])
                cells.append(
                    f"{d['rps_pct']:+.1f} % req/s ({d['rps_pct_lo']:+.1f} to {d['rps_pct_hi']:+.1f}), "
                    f"{d['cpu_us']:+.0f} µs CPU/req ({d['cpu_us_lo']:+.0f} to {d['cpu_us_hi']:+.0f}), "
                    f"{d['cpu_pct']:+.1f} % CPU/req ({d['cpu_pct_lo']:+.1f} to "
                    f"{d['cpu_pct_hi']:+.1f}); mean {d['rps_mean']:+.1f} % req/s (95 % interval "
                    f"{d['rps_mean_lo']:+.1f} to {d['rps_mean_hi']:+.1f}), {d['cpu_pct_mean']:+.1f} % "
                    f"CPU/req ({d['cpu_pct_mean_lo']:+.1f} to {d['cpu_pct_mean_hi']:+.1f})"
                    + (f"; {d['cpu_us_even']:+.0f} µs started after it, {d['cpu_us_odd']:+.0f} "
                       "before it" if ns.together and ns.rounds > 1 else "")
                )
            lines.append(f"| {snaps[rev][1]} ({rev}) | " + " | ".join(cells) + " |")
    out = Path(ns.out) if ns.out else ROOT / "bench" / "results" / dt.date.today().isoformat() / "ab.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    (out.with_suffix(".json")).write_text(json.dumps(results, indent=1))
    print("\n".join(lines))
    print(f"wrote {out}")
    WORK.mkdir(parents=True, exist_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
