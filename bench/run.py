"""Run the bench's scenario set and write ``bench/results/<YYYY-MM-DD>/report.md`` + plots.

    .venv/bin/python -m bench.run            # the default set (about 15 minutes)
    .venv/bin/python -m bench.run --quick    # a few minutes, fewer/shorter points
    .venv/bin/python -m bench.run --only a,b # some scenarios

Scenarios (see bench/README.md): (a) overhead, (b) streaming sweep, (c) idle
streams, (d) P99 sensitivity matrix. Systems: ``direct`` (the sim itself),
``ceiling`` (bench/ceiling_relay.py), ``aiserve`` (memory bus), ``aiserve-redis``,
``litellm`` (its own venv under bench/work/). The system under test runs on CPU 0,
the simulator, Redis and the load generator on CPU 1.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.metadata as md
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import systems
from .stats import bucket_quantile, diff_buckets, parse_stage_buckets
from .systems import BIN, LOAD_CPU, ROOT, WORK, Running

RESULTS = ROOT / "bench" / "results"
CHAT = "/v1/chat/completions"


# ---------------------------------------------------------------- progress


class Progress:
    """A one-line progress display on stderr: step counter, elapsed time, what runs."""

    def __init__(self, total: int) -> None:
        self.total = max(1, total)
        self.done = 0
        self.t0 = time.monotonic()

    def step(self, what: str) -> None:
        self.done += 1
        self.show(what)

    def show(self, what: str) -> None:
        width = 30
        filled = int(width * min(self.done, self.total) / self.total)
        bar = "#" * filled + "." * (width - filled)
        el = time.monotonic() - self.t0
        line = f"[{bar}] {self.done}/{self.total} {el:6.0f}s  {what}"
        if sys.stderr.isatty():
            sys.stderr.write("\r\x1b[2K" + line[:160])
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def note(self, text: str) -> None:
        sys.stderr.write(("\n" if sys.stderr.isatty() else "") + text + "\n")
        sys.stderr.flush()


# ---------------------------------------------------------------- load


LOAD_COMMANDS: list[str] = []


def load(
    url: str,
    mode: list[str],
    *,
    headers: dict[str, str] | None = None,
    prompt: str = "hi",
    max_tokens: int | None = None,
    duration: float = 5.0,
    warmup: float = 0.5,
) -> dict[str, Any]:
    """Run bench.loadgen in a subprocess on the load CPU; its JSON summary."""
    cmd = [
        sys.executable, "-m", "bench.loadgen", "--url", url, *mode,
        "--duration", str(duration), "--warmup", str(warmup), "--raw",
    ]
    if prompt != "hi":
        cmd += ["--prompt", prompt]
    if max_tokens is not None:
        cmd += ["--max-tokens", str(max_tokens)]
    for k, v in (headers or {}).items():
        cmd += ["--header", f"{k}: {v}"]
    full = systems.pinned(cmd, LOAD_CPU)
    LOAD_COMMANDS.append(" ".join(("'" + a + "'" if " " in a else a) for a in full))
    out = subprocess.run(full, cwd=ROOT, capture_output=True, text=True, check=False, timeout=duration * 4 + 120)
    if out.returncode != 0:
        raise RuntimeError(f"loadgen failed: {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def warm(url: str, headers: dict[str, str]) -> None:
    """A few requests so that lazy start-up costs (tokenizer, pools) are not measured.

    Raises:
        RuntimeError: no request succeeded (the system is misconfigured or down).
    """
    body = json.dumps({"model": "sim-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    req = urllib.request.Request(
        url, data=body.encode(), headers={"Content-Type": "application/json", **headers}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        resp.read()
    r = load(url, ["--concurrency", "2"], headers=headers, duration=3.0, warmup=0.0)
    if r["ok"] == 0:
        raise RuntimeError(f"no request succeeded during warm-up: {r['errors']}")


def scrape(base: str) -> str:
    """The system's ``/metrics`` page."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        return str(r.read().decode())


# ---------------------------------------------------------------- systems


@dataclass
class Endpoint:
    """A running system: its URL for chat requests, the headers it needs, its process."""

    name: str
    url: str
    headers: dict[str, str]
    proc: Running | None


SystemFactory = Callable[[Running], AbstractContextManager[Endpoint]]


@contextlib.contextmanager
def _direct(sim: Running) -> Iterator[Endpoint]:
    yield Endpoint("direct", sim.base + CHAT, {}, None)


@contextlib.contextmanager
def _ceiling(sim: Running) -> Iterator[Endpoint]:
    with systems.ceiling(sim) as r:
        yield Endpoint("ceiling", r.base + CHAT, {}, r)


def _aiserve(bus: str, extra_toml: str = "") -> SystemFactory:
    @contextlib.contextmanager
    def factory(sim: Running) -> Iterator[Endpoint]:
        auth = systems.gateway_auth()
        headers = {"Authorization": f"Bearer {auth.plain}"} if auth else {}
        name = "aiserve" if bus == "memory" else "aiserve-redis"
        with contextlib.ExitStack() as stack:
            url = stack.enter_context(systems.redis()).base if bus == "redis" else None
            r = stack.enter_context(
                systems.gateway(name, {CHAT: sim.base}, bus=bus, redis_url=url, auth=auth, extra=extra_toml)
            )
            yield Endpoint(name, r.base + CHAT, headers, r)

    return factory


@contextlib.contextmanager
def _litellm(sim: Running) -> Iterator[Endpoint]:
    with systems.litellm(sim) as r:
        yield Endpoint("litellm", r.base + CHAT, {"Authorization": f"Bearer {systems.LITELLM_KEY}"}, r)


SYSTEMS: dict[str, SystemFactory] = {
    "direct": _direct,
    "ceiling": _ceiling,
    "aiserve": _aiserve("memory"),
    "aiserve-redis": _aiserve("redis"),
    "litellm": _litellm,
}


# ---------------------------------------------------------------- scenarios


@dataclass
class Plan:
    quick: bool
    systems: list[str]

    @property
    def dur(self) -> float:
        return 3.0 if self.quick else 6.0


ZERO_SIM = [
    "--prefill-overhead-ms", "0", "--prefill-per-token-ms", "0",
    "--itl-ms", "0", "--output-tokens-mean", "16",
]


def scenario_a(plan: Plan, prog: Progress, out: dict[str, Any]) -> None:
    """(a) overhead: zero-delay upstream, 16 short deltas, c = 1/16/64, open loop, h2."""
    res: dict[str, Any] = {"closed": {}, "paired": {}, "open": {}, "h2": {}, "notes": []}
    out["a"] = res
    conc = [1, 16, 64]
    rate = 100.0
    with systems.sim(ZERO_SIM, "sim-a") as sim:
        for name in plan.systems:
            prog.show(f"(a) starting {name}")
            try:
                with SYSTEMS[name](sim) as ep:
                    warm(ep.url, ep.headers)
                    rows: dict[str, Any] = {}
                    for c in conc:
                        prog.show(f"(a) {name} c={c}")
                        if name != "direct":
                            # A paired baseline right before: the machine is shared, and
                            # "added" must compare moments with the same background load.
                            res["paired"].setdefault(name, {})[str(c)] = load(
                                sim.base + CHAT, ["--concurrency", str(c)], duration=plan.dur
                            )
                        rows[str(c)] = load(ep.url, ["--concurrency", str(c)], headers=ep.headers, duration=plan.dur)
                        prog.step(f"(a) {name} c={c}: {rows[str(c)]['rps']:.0f} req/s")
                    res["closed"][name] = rows
                    prog.show(f"(a) {name} open loop {rate:g}/s")
                    res["open"][name] = load(ep.url, ["--rate", str(rate)], headers=ep.headers, duration=plan.dur)
                    prog.step(f"(a) {name} open loop")
                    if name in ("direct", "ceiling", "aiserve"):
                        res["h2"][name] = h2load(ep.url, ep.headers)
                    if name == "aiserve" and ep.proc is not None:
                        prog.show("(a) profiling aiserve at c=16")
                        res["profile"] = profile(ep, plan)
            except Exception as exc:
                res["notes"].append(f"{name}: not measured: {exc!s:.300}")
                prog.note(f"(a) {name} failed: {exc!s:.300}")
                prog.done += len(conc) + 1


def h2load(url: str, headers: dict[str, str]) -> dict[str, Any]:
    """HTTP/2 (h2c prior knowledge) throughput with h2load: 4 connections x 4 streams."""
    exe = shutil.which("h2load")
    if exe is None:
        return {"error": "h2load not installed (apt-get install nghttp2-client)"}
    body = WORK / "h2-body.json"
    body.write_text(json.dumps({"model": "sim-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}))
    cmd = [exe, "-n", "3000", "-c", "4", "-m", "4", "-d", str(body), "-H", "content-type: application/json"]
    for k, v in headers.items():
        cmd += ["-H", f"{k}: {v}"]
    cmd.append(url)
    full = systems.pinned(cmd, LOAD_CPU)
    LOAD_COMMANDS.append(" ".join(a if " " not in a else f"'{a}'" for a in full))
    out = subprocess.run(full, capture_output=True, text=True, check=False, timeout=120)
    res: dict[str, Any] = {"raw": out.stdout[-1500:]}
    for line in out.stdout.splitlines():
        if line.startswith("finished in"):
            res["rps"] = float(line.split(",")[1].split()[0])
        if line.startswith("requests:"):
            parts = line.replace(",", "").split()
            res["succeeded"] = int(parts[parts.index("succeeded") - 1])
            res["failed"] = int(parts[parts.index("failed") - 1])
        if line.startswith("time for request:"):
            vals = line.split()[3:7]
            res["req_min_mean_max"] = [vals[0], vals[2], vals[1]]
    return res


def profile(ep: Endpoint, plan: Plan) -> dict[str, Any]:
    """py-spy on the gateway's worker during a c=16 load: the top functions by own time."""
    exe = BIN / "py-spy"
    if not exe.exists() or ep.proc is None:
        return {"error": "py-spy not installed (pip install -e '.[bench]')"}
    dur = int(plan.dur)
    raw = WORK / "profile-aiserve.txt"
    svg = WORK / "profile-aiserve.svg"
    pid = str(ep.proc.worker_pid())
    cmd = [str(exe), "record", "--pid", pid, "--duration", str(dur), "--rate", "200",
           "--nonblocking", "--format", "raw", "--output", str(raw)]
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    systems.RECORDER.add({}, cmd)
    try:
        load(ep.url, ["--concurrency", "16"], headers=ep.headers, duration=dur)
    finally:
        spy.wait(60)
    if not raw.exists():
        return {"error": "py-spy wrote no profile"}
    return summarize_profile(raw.read_text(), svg)


def summarize_profile(text: str, svg: Path) -> dict[str, Any]:
    """Own and inclusive sample shares per function from py-spy's collapsed stacks."""
    own: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in text.splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack or not count_s.isdigit():
            continue
        n = int(count_s)
        total += n
        frames = stack.split(";")
        leaf = frames[-1]
        own[leaf] = own.get(leaf, 0) + n
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n
    def top(d: dict[str, int], k: int) -> list[tuple[str, float]]:
        return [(f, 100.0 * n / total) for f, n in sorted(d.items(), key=lambda x: -x[1])[:k]] if total else []
    ours = {f: n for f, n in incl.items() if "aiserve_trio" in f}
    return {"samples": total, "own": top(own, 15), "ours_inclusive": top(ours, 15)}


STREAM_SIM = [
    "--prefill-overhead-ms", "0", "--prefill-per-token-ms", "0",
    "--itl-ms", "20", "--output-tokens-mean", "64",
]


def scenario_b(plan: Plan, prog: Progress, out: dict[str, Any]) -> None:
    """(b) streaming: 64 deltas paced 20 ms; raise concurrency until p99 gap inflation > 5 ms.

    ``direct`` runs first over the whole sweep; another system stops at the first
    concurrency where its p99 gap exceeds direct's at the same concurrency by more
    than 5 ms (or that has errors).
    """
    sweep = [1, 16, 64, 128] if plan.quick else [1, 16, 64, 128, 256, 512]
    res: dict[str, Any] = {"sweep": {}, "notes": [], "limit_ms": 5.0}
    out["b"] = res
    names = [n for n in plan.systems if n != "aiserve-redis"]
    with systems.sim(STREAM_SIM, "sim-b") as sim:
        for name in names:
            prog.show(f"(b) starting {name}")
            try:
                with SYSTEMS[name](sim) as ep:
                    warm(ep.url, ep.headers)
                    rows: dict[str, Any] = {}
                    res["sweep"][name] = rows
                    for c in sweep:
                        prog.show(f"(b) {name} c={c}")
                        r = load(ep.url, ["--concurrency", str(c)], headers=ep.headers,
                                 duration=max(plan.dur, 5.0), warmup=1.5)
                        r.pop("ttft_raw_ms", None)
                        r.pop("total_raw_ms", None)
                        rows[str(c)] = r
                        p99 = r["gap_ms"]["p99"]
                        prog.step(f"(b) {name} c={c}: gap p99 {p99 if p99 is None else round(p99, 1)} ms")
                        # Inflation is measured against the upstream's own pacing as the
                        # client sees it straight (direct at the same concurrency).
                        ref = res["sweep"].get("direct", {}).get(str(c), {}).get("gap_ms", {}).get("p99")
                        base = ref if name != "direct" and ref is not None else 20.0
                        over = p99 is None or p99 - base > res["limit_ms"] or bool(r["errors"])
                        if over and name != "direct":
                            prog.done += len(sweep) - sweep.index(c) - 1
                            break
            except Exception as exc:
                res["notes"].append(f"{name}: not measured: {exc!s:.300}")
                prog.note(f"(b) {name} failed: {exc!s:.300}")


def _hold(
    prog: Progress, ep: Endpoint, sim: Running, count: int, ramp: float, itl_ms: int, tokens: int
) -> dict[str, Any]:
    """Open ``count`` streams through ``ep`` and hold them; RSS (worker and tree) and errors."""
    import threading

    assert ep.proc is not None
    proc = ep.proc
    res: dict[str, Any] = {
        "streams": count, "ramp_per_s": ramp, "itl_ms": itl_ms, "tokens": tokens,
        "rss_idle_mb": proc.rss_mb(), "worker_rss_idle_mb": proc.worker_rss_mb(),
    }
    samples: list[tuple[float, float, int, float]] = []
    stop = threading.Event()

    def sampler() -> None:
        t0 = time.monotonic()
        while not stop.is_set():
            try:
                with urllib.request.urlopen(sim.base + "/sim/stats", timeout=2) as r:
                    open_streams = int(json.loads(r.read())["open_streams"])
            except OSError:
                open_streams = -1
            samples.append((time.monotonic() - t0, proc.worker_rss_mb(), open_streams, proc.rss_mb()))
            stop.wait(1.0)

    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    prog.show(f"(c) {ep.name}: holding {count} streams")
    hold = count / ramp * 1.6 + tokens * itl_ms / 1000 + 60
    try:
        r = load(ep.url, ["--hold", str(count), "--ramp", str(ramp)], headers=ep.headers, duration=hold)
    finally:
        stop.set()
        th.join()
    r.pop("ttft_raw_ms", None)
    r.pop("total_raw_ms", None)
    res["load"] = r
    res["timeline"] = samples
    res["worker_rss_peak_mb"] = max((s[1] for s in samples), default=None)
    res["rss_peak_mb"] = max((s[3] for s in samples), default=None)
    res["open_peak"] = max((s[2] for s in samples), default=None)
    # Memory per held stream: the worker's growth at the moment most were open.
    at_peak = max(samples, key=lambda s: (s[2], s[1]), default=None)
    if at_peak is not None and at_peak[2] > 0:
        res["kb_per_stream"] = (at_peak[1] - res["worker_rss_idle_mb"]) * 1024 / at_peak[2]
    return res


def scenario_c(plan: Plan, prog: Progress, out: dict[str, Any]) -> None:
    """(c) many idle streams on one gateway worker: RSS and errors.

    The gateway speaks HTTP/2 (h2c) to the simulator here: 10,000 streams over
    HTTP/1.1 need 20,000 descriptors in the gateway (client + upstream), more
    than this sandbox's hard limit of 20,000 allows. Two reference runs at
    2,000 streams give the memory per stream of the bare relay (``ceiling``)
    and of the gateway with HTTP/1.1 upstream connections.
    """
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    room = 10_000 if hard == resource.RLIM_INFINITY else hard - 1000
    count = min(2000 if plan.quick else 10_000, room)
    ref = min(2000, count)
    # Opening a stream costs the gateway a whole request (parse, context, upstream
    # call) while the streams already open keep delivering tokens, so the ramp is
    # slow; 12 s between tokens stays under the 15 s heartbeat.
    ramp, itl_ms = 60.0, 12_000

    def tokens(n: int) -> int:
        # Each stream outlasts the ramp, so all are open at its end -- with room for
        # the gateway opening them slower than asked (about 50/s at 10,000 here).
        return 1 + int((n / ramp * 1.6 + 30) * 1000 / itl_ms)

    res: dict[str, Any] = {"fd_hard_limit": hard, "refs": {}}
    out["c"] = res
    extra = systems.HELD_STREAMS_TOML
    auth = systems.gateway_auth()
    headers = {"Authorization": f"Bearer {auth.plain}"} if auth else {}

    runs: list[tuple[str, int]] = [("aiserve", count), ("ceiling", ref), ("aiserve-http1", ref)]
    for name, n in runs:
        try:
            with systems.sim(systems.held_sim_args(itl_ms, tokens(n)), "sim-c") as sim, contextlib.ExitStack() as stack:
                if name == "ceiling":
                    ep = stack.enter_context(_ceiling(sim))
                else:
                    # hypercorn drops a connection whose client sent nothing for
                    # read_timeout (bench config: 120 s); these streams last longer.
                    r = stack.enter_context(systems.gateway(
                        name, {CHAT: sim.base}, auth=auth, extra=extra, http2=name == "aiserve",
                        hypercorn_args=["--read-timeout", "1800"]))
                    ep = Endpoint(name, r.base + CHAT, headers, r)
                got = _hold(prog, ep, sim, n, ramp, itl_ms, tokens(n))
        except Exception as exc:
            prog.note(f"(c) {name} failed: {exc!s:.300}")
            continue
        got["upstream"] = "h2c" if name == "aiserve" else "HTTP/1.1"
        if name == "aiserve":
            res.update(got)
        else:
            res["refs"][name] = got
        prog.step(
            f"(c) {name} {n} streams: worker RSS {got['worker_rss_peak_mb']:.0f} MB, "
            f"{got.get('kb_per_stream', 0):.0f} KB/stream, errors {got['load']['errors']}"
        )


def scenario_d(plan: Plan, prog: Progress, out: dict[str, Any]) -> None:
    """(d) P99 sensitivity: prompt length x upstream token rate x SSE chunk size."""
    prompts = [50, 500, 1500]
    rates = [128, 1024, 4096]
    chunks = [16, 64, 256]
    reply = 256
    res: dict[str, Any] = {"cells": [], "reply_tokens": reply}
    out["d"] = res
    with contextlib.ExitStack() as stack:
        sims: dict[tuple[int, int], Running] = {}
        for rate in rates:
            for chunk in chunks:
                itl = 1000.0 * chunk / rate
                # The first chunk leaves the model once `chunk` tokens are generated.
                args = ["--prefill-overhead-ms", f"{1 + itl:g}", "--prefill-per-token-ms", "0.02",
                        "--itl-ms", f"{itl:g}", "--output-tokens-mean", str(reply // chunk)]
                sims[(rate, chunk)] = stack.enter_context(systems.sim(args, f"sim-d-{rate}-{chunk}"))
        routes = {f"/v1/d/{r}/{c}": s.base for (r, c), s in sims.items()}
        auth = systems.gateway_auth()
        headers = {"Authorization": f"Bearer {auth.plain}"} if auth else {}
        gw = stack.enter_context(systems.gateway("aiserve-d", routes, auth=auth))
        warm(gw.base + f"/v1/d/{rates[-1]}/{chunks[0]}", headers)
        for p in prompts:
            text = " ".join(["hello"] * p)
            for rate in rates:
                for chunk in chunks:
                    prog.show(f"(d) prompt {p} rate {rate} chunk {chunk}")
                    before = parse_stage_buckets(scrape(gw.base))
                    # Long enough for a few replies even at the slowest rate (256 tokens at 128/s: 2 s).
                    dur = max(plan.dur / 2 if plan.quick else plan.dur, 2.5 * reply / rate)
                    r = load(gw.base + f"/v1/d/{rate}/{chunk}", ["--concurrency", "16"], headers=headers,
                             prompt=text, duration=dur, warmup=0.3)
                    after = parse_stage_buckets(scrape(gw.base))
                    delta = diff_buckets(after, before)
                    stages = {s: bucket_quantile(rows, 0.99) for s, rows in delta.items()}
                    counts = {s: rows[-1][1] for s, rows in delta.items() if rows}
                    res["cells"].append({
                        "prompt": p, "rate": rate, "chunk": chunk,
                        "requests": r["ok"], "errors": r["errors"],
                        "ttft_p99": r["ttft_ms"]["p99"], "total_p99": r["total_ms"]["p99"],
                        "stage_p99_s": stages, "stage_n": counts,
                    })
                    prog.step(f"(d) prompt {p} rate {rate} chunk {chunk}")


SCENARIOS = {"a": scenario_a, "b": scenario_b, "c": scenario_c, "d": scenario_d}


# ---------------------------------------------------------------- machine


def machine() -> dict[str, Any]:
    """Cores, CPU, Python, package versions, load average: what the numbers depend on."""
    cpu = systems.cpu_model()
    pkgs = {}
    for p in ("aiserve-trio", "trio", "hypercorn", "h11", "h2", "httpx2", "msgspec", "coredis", "prometheus-client"):
        with contextlib.suppress(md.PackageNotFoundError):
            pkgs[p] = md.version(p)
    pkgs["litellm (own venv)"] = systems.litellm_version() or "not installed"
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": pkgs,
        "loadavg_start": os.getloadavg(),
        "git": git.stdout.strip(),
        "nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
        "pinning": f"system under test on CPU {systems.SYSTEM_CPU}; simulator, Redis and load generator on CPU {LOAD_CPU} (taskset)"
        if shutil.which("taskset") and (os.cpu_count() or 1) >= 2 else "none (taskset missing or one CPU)",
    }


def raise_fd_limit() -> None:
    """Scenario (c): the gateway holds two sockets per stream (client + upstream).

    Raises the soft limit, and as root the hard limit too, to 65,536; the
    processes the run starts inherit it.
    """
    want = 65536
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            return
        want = hard
    if soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def main(argv: list[str] | None = None) -> int:
    """Run the scenario set and write the report."""
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few-minute run: shorter and fewer points")
    ap.add_argument("--only", default="a,b,c,d", help="scenarios to run, e.g. a,b")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="systems for (a) and (b)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results/<date>)")
    ap.add_argument("--merge", action="store_true", help="update the scenarios run in an existing results.json")
    ap.add_argument(
        "--snapshot", default=None, metavar="REV",
        help="run the gateway and sim from `git archive REV src` (e.g. HEAD), not the work tree",
    )
    ns = ap.parse_args(argv)
    if ns.snapshot:
        systems.SNAPSHOT, sha = systems.snapshot(ns.snapshot)
    raise_fd_limit()
    plan = Plan(quick=ns.quick, systems=[s for s in ns.systems.split(",") if s])
    chosen = [s for s in ns.only.split(",") if s]
    for s in chosen:
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s!r} (a, b, c, d)")
    steps = 0
    if "a" in chosen:
        steps += 4 * len(plan.systems)
    if "b" in chosen:
        steps += (4 if plan.quick else 6) * len([s for s in plan.systems if s != "aiserve-redis"])
    if "c" in chosen:
        steps += 3
    if "d" in chosen:
        steps += 27
    prog = Progress(steps)
    info = machine()
    if ns.snapshot:
        info["git"] = f"{sha} (git archive snapshot of src/, {systems.SNAPSHOT})"
    info["argv"] = ["python", "-m", "bench.run", *(argv if argv is not None else sys.argv[1:])]
    info["started"] = dt.datetime.now().isoformat(timespec="seconds")
    results: dict[str, Any] = {"machine": info}
    t0 = time.monotonic()
    for s in chosen:
        SCENARIOS[s](plan, prog, results)
    info["wall_s"] = time.monotonic() - t0
    info["loadavg_end"] = os.getloadavg()
    info["commands"] = systems.RECORDER.commands
    info["load_commands"] = LOAD_COMMANDS
    outdir = Path(ns.out) if ns.out else RESULTS / dt.date.today().isoformat()
    outdir.mkdir(parents=True, exist_ok=True)
    if ns.merge and (outdir / "results.json").exists():
        old = json.loads((outdir / "results.json").read_text())
        reruns = old["machine"].setdefault("reruns", [])
        reruns.append({k: info[k] for k in ("argv", "started", "git", "loadavg_start", "loadavg_end", "wall_s")})
        reruns[-1]["commands"] = info["commands"]
        reruns[-1]["load_commands"] = info["load_commands"]
        results = {**old, **{k: v for k, v in results.items() if k != "machine"}}
    (outdir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    from .report import write_report

    write_report(results, outdir)
    prog.note(f"wrote {outdir / 'report.md'} in {info['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
