"""Throughput, added TTFT, memory per held stream and worker scaling, against peers, in one run.

    .venv/bin/python -m bench.throughput [--quick] [--rev REV] [--systems ...] [--profile]
                                         [--upstream-tls]

Systems, all measured in the same run on the same machine:

- ``direct``: ``bench/node/upstream.js``, a zero-delay OpenAI-compatible upstream
  (16 deltas), the client straight to it;
- ``floor``: ``bench/ceiling_app.py`` on hypercorn-Trio, a fixed reply and no
  upstream: the least any app on this server costs;
- ``portkey``: the Portkey gateway (Node; ``npm install @portkey-ai/gateway`` in
  ``bench/work/portkey``), the upstream as an ``openai`` provider with a custom host;
- ``litellm``: the LiteLLM proxy, one worker (``bench/work/litellm-venv``);
- ``aiserve``: this gateway (``--rev``'s ``src/``, or the work tree), auth on.

Every system under test runs on CPU 0 (``taskset -c 0``), the upstream and the
load generators on CPU 1. Measured:

1. ``wrk`` (Lua, ``bench/node/post.lua``), non-streamed and streamed, c = 1, 16, 64:
   req/s and latency percentiles; best of the interleaved rounds;
2. time to first content byte at c = 1 (a blocking-socket client, one keep-alive
   connection), added = system - direct, p50 and p99;
3. memory per held stream: 1,000 streams held open through ``aiserve`` and
   ``litellm`` in front of ``aiserve-sim`` (first token at once, then one every
   12 s), the serving process's RSS growth divided by the streams;
4. ``aiserve`` with 1 and 2 hypercorn workers on both CPUs (the upstream and wrk
   share them): req/s and req/s per CPU-second of the gateway's processes.

``--upstream-tls`` serves the upstream over HTTPS with a private CA
(``systems.upstream_pki``) that each system is told of: the gateway by ``ca_file``,
Portkey by ``NODE_EXTRA_CA_CERTS``, LiteLLM by ``SSL_CERT_FILE``; ``direct`` and the
TTFT client speak TLS to it too. The report is then ``throughput-tls.md`` (beside
the plain-http one); the held-stream part stays on plain ``aiserve-sim``. A gateway
revision from before ``ca_file`` (``--rev``) needs ``--upstream-ca system`` and the CA
(``bench/work/tls/ca.pem``, kept between runs) in the system store.

``--profile`` records the gateway's worker with py-spy during a streamed c = 16
run. Writes ``bench/results/<date>/throughput.md`` (the table, targets marked
met / not met, the machine's load) and ``throughput.json``; ``--quick`` finishes
in under ~5 minutes, the full run in under ~20.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import systems
from .ab import node_upstream, wrk
from .systems import LOAD_CPU, ROOT, SYSTEM_CPU, WORK, Running, cpu_seconds, free_port, pinned

ALL = ("direct", "floor", "portkey", "litellm", "aiserve")
CONCS = (1, 16, 64)
PORTKEY_DIR = WORK / "portkey"
#: The first content delta of bench/node/upstream.js's reply, as any system frames it.
FIRST_CONTENT = b'"w0'


@dataclass
class Plan:
    """How long each part runs (``--quick`` or the full run)."""

    point_s: float
    warmup_s: float
    rounds: int
    ttft_samples: int
    held_streams: int
    hold_ramp: float
    worker_concs: tuple[int, ...]


QUICK = Plan(point_s=3.0, warmup_s=1.0, rounds=1, ttft_samples=300, held_streams=1000,
             hold_ramp=200.0, worker_concs=(64,))
FULL = Plan(point_s=8.0, warmup_s=1.0, rounds=2, ttft_samples=2000, held_streams=1000,
            hold_ramp=100.0, worker_concs=(16, 64))


@dataclass
class System:
    """A running system under test: where to send, with which headers."""

    name: str
    url: str
    key: str | None = None
    headers: str = ""  # "Name: value|Name: value" (wrk) -- also sent by the TTFT client
    running: Running | None = None
    #: The CA of an ``https://`` url (the upstream, for ``direct`` over TLS).
    ca: Path | None = None

    def header_pairs(self) -> list[tuple[str, str]]:
        out = [("Authorization", f"Bearer {self.key}")] if self.key else []
        for pair in filter(None, self.headers.split("|")):
            name, _, value = pair.partition(":")
            out.append((name.strip(), value.strip()))
        return out


@dataclass
class Results:
    load: list[tuple[str, float]] = field(default_factory=list)
    rps: dict[str, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)
    ttft: dict[str, dict[str, Any]] = field(default_factory=dict)
    memory: dict[str, dict[str, Any]] = field(default_factory=dict)
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    profile: str | None = None
    versions: dict[str, str] = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)


def progress(msg: str, t0: float) -> None:
    print(f"[{time.monotonic() - t0:6.0f} s] {msg}", flush=True)


# --- the systems -------------------------------------------------------------------


@contextlib.contextmanager
def floor() -> Iterator[System]:
    port = free_port()
    cmd = systems.hypercorn_cmd(port, "bench.ceiling_app:app")
    with systems.start("floor", cmd, port=port, health="/", cpu=SYSTEM_CPU, ours=False) as r:
        yield System("floor", r.base + "/v1/chat/completions", running=r)


@contextlib.contextmanager
def portkey(upstream: Running, ca_file: Path | None = None) -> Iterator[System]:
    script = PORTKEY_DIR / "node_modules" / "@portkey-ai" / "gateway" / "build" / "start-server.js"
    node = shutil.which("node")
    if node is None or not script.exists():
        raise RuntimeError(f"Portkey is not installed in {PORTKEY_DIR} (see bench/README.md)")
    port = free_port()
    cmd = [node, str(script), f"--port={port}", "--headless"]
    env = {"NODE_ENV": "production"}
    if ca_file is not None:
        env["NODE_EXTRA_CA_CERTS"] = str(ca_file)
    with systems.start("portkey", cmd, port=port, health="/", cpu=SYSTEM_CPU, env=env,
                       ours=False) as r:
        headers = f"x-portkey-provider: openai|x-portkey-custom-host: {upstream.base}/v1"
        yield System("portkey", r.base + "/v1/chat/completions", key="sk-bench", headers=headers,
                     running=r)


@contextlib.contextmanager
def litellm(upstream: Running, ca_file: Path | None = None) -> Iterator[System]:
    with systems.litellm(upstream, ca_file) as r:
        yield System("litellm", r.base + "/v1/chat/completions", key=systems.LITELLM_KEY,
                     running=r)


@contextlib.contextmanager
def aiserve(upstream: Running, *, workers: int = 1, cpu: str | None = SYSTEM_CPU,
            extra: str = "", name: str = "aiserve", ca_file: Path | None = None,
            ) -> Iterator[System]:
    auth = systems.gateway_auth()
    port = free_port()
    WORK.mkdir(parents=True, exist_ok=True)
    cfg = WORK / f"throughput-{name}.toml"
    cfg.write_text(systems.gateway_toml({"/v1/chat/completions": upstream.base}, auth=auth,
                                        extra=extra, ca_file=ca_file))
    env = {"AISERVE_CONFIG": str(cfg.relative_to(ROOT))}
    args = ["--workers", str(workers)] if workers != 1 else []
    cmd = systems.hypercorn_cmd(port, "aiserve_trio:app", args)
    with systems.start(name, cmd, port=port, cpu=cpu, env=env) as r:
        yield System(name, r.base + "/v1/chat/completions",
                     key=auth.plain if auth is not None else None, running=r)


# --- 1. wrk ------------------------------------------------------------------------


def run_rps(targets: list[System], plan: Plan, res: Results, t0: float) -> None:
    for s in targets:
        wrk(s.url, 4, plan.warmup_s, stream=False, key=s.key, headers=s.headers)
        wrk(s.url, 4, plan.warmup_s, stream=True, key=s.key, headers=s.headers)
    for rnd in range(plan.rounds):
        for stream in (False, True):
            for c in CONCS:
                for s in targets:
                    tag = f"{'stream' if stream else 'json'}-c{c}"
                    try:
                        p = wrk(s.url, c, plan.point_s, stream=stream, key=s.key, headers=s.headers)
                    except (subprocess.CalledProcessError, RuntimeError) as exc:
                        p = {"rps": 0.0, "p50_ms": None, "p90_ms": None, "p99_ms": None,
                             "errors": -1, "requests": 0, "failed": str(exc)[:200]}
                    res.rps.setdefault(s.name, {}).setdefault(tag, []).append(p)
                    progress(f"round {rnd + 1} {s.name} {tag}: {p['rps']:.0f} req/s, "
                             f"p50 {p['p50_ms']} ms, errors {p['errors']}", t0)


# --- 2. time to first token at c = 1 -------------------------------------------------


def ttft_client(url: str, headers: list[tuple[str, str]], n: int, warmup: int,
                ca_file: str | None = None) -> dict[str, Any]:
    """``n`` streamed requests one after another on one keep-alive connection.

    Time to first content: from just before the request is written to the read
    that holds the reply's first content delta. Raw sockets, so the client adds
    the same few microseconds to every system (TLS for an ``https://`` url, trusting
    ``ca_file``).
    """
    context = ssl.create_default_context(cafile=ca_file) if parts_tls(url) else None
    parts = urllib.parse.urlsplit(url)
    body = json.dumps({"model": "sim-model", "stream": True,
                       "messages": [{"role": "user", "content": "hello there, how are you?"}]}
                      ).encode()
    head = (f"POST {parts.path} HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n").encode()
    request = head + body
    sock: socket.socket | None = None
    samples: list[float] = []
    errors: Counter[str] = Counter()
    for i in range(n + warmup):
        try:
            if sock is None:
                sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if context is not None:
                    sock = context.wrap_socket(sock, server_hostname=parts.hostname)
            t = time.perf_counter()
            sock.sendall(request)
            buf = b""
            first: float | None = None
            while True:
                data = sock.recv(65536)
                if not data:
                    raise ConnectionError("closed")
                buf += data
                if first is None and FIRST_CONTENT in buf:
                    first = time.perf_counter() - t
                if not buf.startswith(b"HTTP/1.1 200"):
                    if b"\r\n\r\n" in buf:
                        raise ValueError(buf.split(b"\r\n", 1)[0].decode(errors="replace"))
                    continue
                if b"[DONE]" in buf and buf.endswith(b"0\r\n\r\n"):
                    break
            if first is None:
                raise ValueError("no content")
            if i >= warmup:
                samples.append(first * 1000)
        except (OSError, ValueError) as exc:
            errors[type(exc).__name__ + ": " + str(exc)[:60]] += 1
            if sock is not None:
                sock.close()
                sock = None
            if sum(errors.values()) > 20:
                break
    if sock is not None:
        sock.close()
    samples.sort()

    def pct(q: float) -> float | None:
        return samples[min(len(samples) - 1, int(q / 100 * len(samples)))] if samples else None

    return {"n": len(samples), "p50_ms": pct(50), "p90_ms": pct(90), "p99_ms": pct(99),
            "max_ms": samples[-1] if samples else None, "errors": dict(errors),
            "raw_ms": [round(x, 4) for x in samples]}


def parts_tls(url: str) -> bool:
    return urllib.parse.urlsplit(url).scheme == "https"


def run_ttft(targets: list[System], plan: Plan, res: Results, t0: float) -> None:
    for s in targets:
        if s.name == "floor":
            continue  # no upstream: nothing is added to
        cmd = pinned([sys.executable, "-m", "bench.throughput", "--ttft-child", s.url,
                      json.dumps(s.header_pairs()), str(plan.ttft_samples),
                      str(s.ca) if s.ca is not None else ""], LOAD_CPU)
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
        res.ttft[s.name] = json.loads(out.stdout.strip().splitlines()[-1])
        t = res.ttft[s.name]
        progress(f"ttft {s.name}: p50 {t['p50_ms']} ms p99 {t['p99_ms']} ms errors {t['errors']}",
                 t0)


# --- 3. memory per held stream -------------------------------------------------------


def established(port: int) -> int:
    """TCP connections established to ``port`` on this machine (from /proc/net/tcp*)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    n += 1
    return n


def held_streams(system: System, sim: Running, plan: Plan, t0: float) -> dict[str, Any]:
    """RSS growth of the serving process per stream, with ``plan.held_streams`` held."""
    assert system.running is not None
    n = plan.held_streams
    # A few ordinary requests first, so that what loads lazily is loaded.
    for _ in range(5):
        req = urllib.request.Request(
            system.url, data=json.dumps({"model": "sim-model", "max_tokens": 1, "messages": [
                {"role": "user", "content": "hi"}]}).encode(),
            headers={"Content-Type": "application/json", **dict(system.header_pairs())})
        with contextlib.suppress(OSError):
            urllib.request.urlopen(req, timeout=30).read()
    time.sleep(1)
    idle = system.running.worker_rss_mb()
    cmd = [sys.executable, "-m", "bench.loadgen", "--url", system.url, "--hold", str(n),
           "--ramp", str(plan.hold_ramp), "--duration", str(n / plan.hold_ramp + 90)]
    for k, v in system.header_pairs():
        cmd += ["--header", f"{k}: {v}"]
    load = subprocess.Popen(pinned(cmd, LOAD_CPU), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    opened = 0
    try:
        end = time.monotonic() + n / plan.hold_ramp * 3 + 45
        while time.monotonic() < end:
            time.sleep(1)
            try:
                with urllib.request.urlopen(sim.base + "/sim/stats", timeout=5) as r:
                    opened = int(json.loads(r.read())["open_streams"])
            except OSError as exc:
                progress(f"memory {system.name}: the simulator did not answer ({exc})", t0)
                if sim.proc.poll() is not None:
                    raise RuntimeError(f"the simulator exited ({sim.proc.returncode}); "
                                       f"see {systems.LOGS / (sim.name + '.log')}") from exc
                continue
            if opened >= n:
                break
        time.sleep(3)
        held = system.running.worker_rss_mb()
        clients = established(int(urllib.parse.urlsplit(system.url).port or 80))
    finally:
        load.kill()
        load.wait()
    # Per stream held for a client: a system that queues some before calling the
    # upstream holds them too (the conservative figure for this gateway's target).
    per = (held - idle) * 1024 / max(clients, 1)
    progress(f"memory {system.name}: {clients} client streams, {opened} upstream streams, "
             f"RSS {idle:.0f} -> {held:.0f} MB, {per:.0f} KB/stream", t0)
    return {"streams": clients, "upstream_streams": opened, "idle_mb": idle, "held_mb": held,
            "kb_per_stream": per,
            "kb_per_upstream_stream": (held - idle) * 1024 / max(opened, 1)}


def run_memory(names: list[str], plan: Plan, res: Results, t0: float) -> None:
    tokens = 1 + int((plan.held_streams / plan.hold_ramp + 120) * 1000 / 12_000)
    for name in names:
        with systems.sim(systems.held_sim_args(12_000, tokens), f"sim-held-{name}") as sim:
            cm: contextlib.AbstractContextManager[System]
            if name == "aiserve":
                cm = aiserve(sim, extra=systems.HELD_STREAMS_TOML, name="aiserve-held")
            else:
                cm = litellm(sim)
            with cm as s:
                res.memory[name] = held_streams(s, sim, plan, t0)


# --- 4. workers ---------------------------------------------------------------------


def run_workers(upstream: Running, plan: Plan, res: Results, t0: float,
                ca_file: Path | None = None) -> None:
    for workers in (1, 2):
        with aiserve(upstream, workers=workers, cpu=None, name=f"aiserve-w{workers}",
                     ca_file=ca_file) as s:
            assert s.running is not None
            time.sleep(1)
            pids = s.running.pids()
            wrk(s.url, 4, plan.warmup_s, stream=True, key=s.key)
            for stream in (False, True):
                for c in plan.worker_concs:
                    tag = f"{'stream' if stream else 'json'}-c{c}"
                    cpu0 = cpu_seconds(pids)
                    p = _wrk_unpinned(s, c, plan.point_s, stream)
                    cpu = cpu_seconds(pids) - cpu0
                    p["gateway_cpu_s"] = cpu
                    p["rps_per_cpu"] = p["requests"] / cpu if cpu > 0 else 0.0
                    res.workers.setdefault(f"w{workers}", {})[tag] = p
                    progress(f"workers={workers} {tag}: {p['rps']:.0f} req/s, "
                             f"{p['rps_per_cpu']:.0f} req per gateway CPU-s", t0)


def _wrk_unpinned(s: System, c: int, seconds: float, stream: bool) -> dict[str, Any]:
    # The workers have both CPUs; so have wrk and the upstream.
    return wrk(s.url, c, seconds, stream=stream, key=s.key, cpu=None)


# --- profile -------------------------------------------------------------------------


def run_profile(s: System, plan: Plan, out_dir: Path, tag: str, t0: float) -> str | None:
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists() or s.running is None:
        progress("py-spy is not installed: no profile (pip install -e '.[bench]')", t0)
        return None
    pid = s.running.worker_pid()
    raw = out_dir / f"profile-{tag}.txt"
    seconds = max(4, int(plan.point_s))
    spy_proc = subprocess.Popen(
        pinned([str(spy), "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "200",
                "--format", "raw", "--nonblocking", "-o", str(raw)], LOAD_CPU),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    wrk(s.url, 16, seconds, stream=True, key=s.key, headers=s.headers)
    spy_proc.wait(timeout=60)
    if not raw.exists():
        return None
    summary = profile_summary(raw)
    (out_dir / f"profile-{tag}.md").write_text(summary)
    progress(f"profile written: {raw}", t0)
    return str(raw.relative_to(ROOT)) if raw.is_relative_to(ROOT) else str(raw)


def profile_summary(raw: Path, top: int = 30) -> str:
    """Top functions by inclusive and by own share of the samples of a py-spy raw file."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0] + ")"
                  if " (" in f else f for f in stack.split(";")]
        for f in set(frames):
            inclusive[f] += n
        own[frames[-1]] += n
    lines = [f"# py-spy profile summary: {raw.name} ({total} samples)", "",
             "| inclusive | function |", "|---|---|"]
    lines += [f"| {n / total * 100:.1f} % | `{f}` |" for f, n in inclusive.most_common(top)]
    lines += ["", "| own | function |", "|---|---|"]
    lines += [f"| {n / total * 100:.1f} % | `{f}` |" for f, n in own.most_common(top)]
    return "\n".join(lines) + "\n"


# --- the report ----------------------------------------------------------------------


def num(x: float | None, digits: int = 0) -> str:
    """``x`` for the table: thousands separated, or a dash."""
    return "—" if x is None else f"{x:,.{digits}f}"


def best(points: list[dict[str, Any]]) -> dict[str, Any]:
    return max(points, key=lambda p: p["rps"])


def mark(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**not met**")


def report(res: Results, plan: Plan, names: list[str], argv: list[str], started: float,
           snapshot: str) -> str:
    b = {name: {tag: best(ps) for tag, ps in tags.items()} for name, tags in res.rps.items()}

    def rps(name: str, tag: str) -> float | None:
        p = b.get(name, {}).get(tag)
        return None if p is None or p.get("failed") else p["rps"]

    def cell_rps(name: str, stream: bool) -> str:
        cells = []
        for c in CONCS:
            p = b.get(name, {}).get(f"{'stream' if stream else 'json'}-c{c}")
            if p is None:
                cells.append("—")
            elif p.get("failed") or p["rps"] == 0:
                cells.append("fails")
            else:
                err = p["errors"]
                cells.append(f"{p['rps']:,.0f}" + (f" ({err} err)" if err else ""))
        return " / ".join(cells)

    def p50(name: str) -> str:
        p = b.get(name, {}).get("json-c1")
        return "—" if p is None or p.get("p50_ms") is None else f"{p['p50_ms']:.2f} ms"

    direct = res.ttft.get("direct", {})

    def added(name: str) -> tuple[float | None, float | None]:
        t = res.ttft.get(name)
        if not t or t.get("p50_ms") is None or direct.get("p50_ms") is None:
            return None, None
        return t["p50_ms"] - direct["p50_ms"], t["p99_ms"] - direct["p99_ms"]

    def cell_ttft(name: str) -> str:
        a50, a99 = added(name)
        if a50 is None or a99 is None:
            return "—"
        return f"{a50:.2f} / {a99:.2f} ms"

    labels = {
        "direct": "upstream direct (`bench/node/upstream.js`)",
        "floor": "hypercorn-Trio fixed reply, no upstream (the floor)",
        "portkey": f"Portkey gateway {res.versions.get('portkey', '')} (Node)",
        "litellm": f"LiteLLM {res.versions.get('litellm', '')}",
        "aiserve": f"aiserve-trio ({snapshot})",
    }
    load = ", ".join(f"{when} {v:.2f}" for when, v in res.load)
    lines = [
        f"# aiserve-trio against its peers ({dt.date.today().isoformat()})",
        "",
        f"Command: `python -m bench.throughput {' '.join(argv)}` "
        f"({time.monotonic() - started:.0f} s, {'full' if plan is FULL else 'quick'} mode). "
        f"Systems under test on CPU {SYSTEM_CPU} (`taskset`), the upstream and the load "
        f"generators on CPU {LOAD_CPU}; wrk {plan.point_s:g} s per point, best of "
        f"{plan.rounds} interleaved round(s). Load average (1 min): {load}; "
        f"this machine has {os.cpu_count()} CPUs and may be shared: compare within this file only."
        + (" The upstream is served over HTTPS (a private CA each system was told of)."
           if "--upstream-tls" in argv else ""),
        "",
        "| system | non-streamed req/s c=1 / c=16 / c=64 | p50 c=1 | streamed (16 deltas) req/s "
        "c=1 / c=16 / c=64 | added TTFT p50 / p99 c=1 |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        if name not in b:
            continue
        ttft = "—" if name in ("direct", "floor") else cell_ttft(name)
        lines.append(f"| {labels[name]} | {cell_rps(name, False)} | {p50(name)} | "
                     f"{cell_rps(name, True)} | {ttft} |")
    if "direct" in res.ttft:
        lines += ["", f"Direct TTFT at c=1 (the reference subtracted): p50 "
                      f"{direct.get('p50_ms', 0):.3f} ms, p99 {direct.get('p99_ms', 0):.3f} ms, "
                      f"{direct.get('n')} requests each."]
    if res.memory:
        lines += ["", f"| memory, {plan.held_streams:,} streams asked for (one token every 12 s) | "
                      "client streams held (upstream streams open) | serving process RSS idle -> "
                      "held | KB per client stream (per upstream stream) |", "|---|---|---|---|"]
        for name, m in res.memory.items():
            lines.append(f"| {labels[name]} | {m['streams']:,} ({m['upstream_streams']:,}) | "
                         f"{m['idle_mb']:.0f} -> {m['held_mb']:.0f} MB | {m['kb_per_stream']:.0f} "
                         f"({m['kb_per_upstream_stream']:.0f}) |")
    if res.workers:
        lines += ["", "| hypercorn workers (both CPUs, shared with wrk and the upstream) | "
                      + " | ".join(res.workers["w1"]) + " |",
                  "|---|" + "---|" * len(res.workers["w1"])]
        for w, tags in res.workers.items():
            lines.append(f"| {w[1:]} | " + " | ".join(
                f"{p['rps']:,.0f} req/s, {p['rps_per_cpu']:,.0f} per gateway CPU-s"
                for p in tags.values()) + " |")

    # Targets.
    t: list[tuple[str, bool | None, str]] = []
    a16, pk16 = rps("aiserve", "json-c16"), rps("portkey", "json-c16")
    t.append(("non-streamed c=16: more req/s than Portkey",
              None if a16 is None or pk16 is None else a16 > pk16, f"{num(a16)} vs {num(pk16)}"))
    pa = b.get("aiserve", {}).get("json-c1", {}).get("p50_ms")
    pp = b.get("portkey", {}).get("json-c1", {}).get("p50_ms")
    t.append(("non-streamed c=1: p50 below Portkey's",
              None if pa is None or pp is None else pa < pp, f"{num(pa, 2)} vs {num(pp, 2)} ms"))
    for c in (16, 64):
        a, ll = rps("aiserve", f"stream-c{c}"), rps("litellm", f"stream-c{c}")
        t.append((f"streamed c={c}: ≥10x LiteLLM",
                  None if a is None or not ll else a >= 10 * ll,
                  f"{num(a)} vs {num(ll)} ({(a or 0) / ll:.1f}x)" if ll else f"{num(a)} vs {num(ll)}"))
    for c in CONCS:
        a, f = rps("aiserve", f"stream-c{c}"), rps("floor", f"stream-c{c}")
        t.append((f"streamed c={c}: ≥60 % of the floor",
                  None if a is None or not f else a >= 0.6 * f,
                  f"{num(a)} vs {num(f)} ({(a or 0) / f * 100:.0f} %)" if f else f"{num(a)} vs {num(f)}"))
    a50, a99 = added("aiserve")
    t.append(("added TTFT c=1: p50 ≤ 1 ms", None if a50 is None else a50 <= 1.0, f"{num(a50, 2)} ms"))
    t.append(("added TTFT c=1: p99 ≤ 2 ms", None if a99 is None else a99 <= 2.0, f"{num(a99, 2)} ms"))
    ma, ml = res.memory.get("aiserve"), res.memory.get("litellm")
    t.append(("memory per held stream ≤ half LiteLLM's",
              None if ma is None or ml is None else ma["kb_per_stream"] <= ml["kb_per_stream"] / 2,
              f"{ma and round(ma['kb_per_stream'])} vs {ml and round(ml['kb_per_stream'])} KB"))
    if "w1" in res.workers and "w2" in res.workers:
        effs = [res.workers["w2"][k]["rps_per_cpu"] / res.workers["w1"][k]["rps_per_cpu"]
                for k in res.workers["w1"] if res.workers["w1"][k]["rps_per_cpu"]]
        gains = [res.workers["w2"][k]["rps"] / res.workers["w1"][k]["rps"]
                 for k in res.workers["w1"] if res.workers["w1"][k]["rps"]]
        t.append(("workers = 2 scale near-linearly (req per gateway CPU-s ≥ 85 % of 1 worker's)",
                  min(effs) >= 0.85 if effs else None,
                  f"efficiency {', '.join(f'{e:.2f}' for e in effs)}; req/s x"
                  f"{', '.join(f'{g:.2f}' for g in gains)}"))
    lines += ["", "| target | result | numbers |", "|---|---|---|"]
    lines += [f"| {what} | {mark(ok)} | {nums} |" for what, ok, nums in t]
    if res.profile:
        lines += ["", f"Profile of the gateway's worker (py-spy, streamed c=16): `{res.profile}` "
                      f"(summary beside it, `.md`)."]
    lines += ["", "Processes started:", "", "```", *res.commands, "```"]
    return "\n".join(lines) + "\n"


# --- main ------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    out: dict[str, str] = {}
    ll = systems.litellm_version()
    if ll:
        out["litellm"] = ll
    pkg = PORTKEY_DIR / "node_modules" / "@portkey-ai" / "gateway" / "package.json"
    if pkg.exists():
        out["portkey"] = json.loads(pkg.read_text())["version"]
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m bench.throughput", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short points, one round (< ~5 min)")
    ap.add_argument("--rev", default=None, help="measure this git revision's src/ (default: the work tree)")
    ap.add_argument("--systems", default=",".join(ALL))
    ap.add_argument("--skip", default="", help="parts to leave out: rps,ttft,memory,workers")
    ap.add_argument("--profile", action="store_true", help="py-spy the gateway at streamed c=16")
    ap.add_argument("--out", default=None, help="results directory (default bench/results/<date>)")
    ap.add_argument("--duration", type=float, default=None,
                    help="seconds per wrk point instead of the mode's (a short check that it runs)")
    ap.add_argument("--upstream-tls", action="store_true",
                    help="the upstream over HTTPS (a private CA every system is told of)")
    ap.add_argument("--upstream-ca", choices=("file", "system"), default="file",
                    help="with --upstream-tls, how the gateway trusts the CA: its ca_file, or the "
                    "system store (a revision without ca_file; install bench/work/tls/ca.pem first)")
    ap.add_argument("--ttft-child", nargs=4, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.ttft_child:
        url, headers, n, ca = ns.ttft_child
        print(json.dumps(ttft_client(url, [tuple(h) for h in json.loads(headers)], int(n), 50,
                                     ca or None)))
        return 0
    plan = QUICK if ns.quick else FULL
    if ns.duration is not None:
        plan = dataclasses.replace(plan, point_s=ns.duration, warmup_s=min(plan.warmup_s, ns.duration),
                                   ttft_samples=min(plan.ttft_samples, 100))
    names = [n for n in ns.systems.split(",") if n]
    skip = set(filter(None, ns.skip.split(",")))
    out_dir = Path(ns.out).resolve() if ns.out else ROOT / "bench" / "results" / dt.date.today().isoformat()
    out_dir.mkdir(parents=True, exist_ok=True)
    if ns.rev:
        src, sha = systems.snapshot(ns.rev)
        systems.SNAPSHOT = src
        snapshot = sha
    else:
        systems.SNAPSHOT = ROOT / "src"  # the work tree, not an installed copy
        snapshot = "work tree at " + subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
            check=False).stdout.strip()
    res = Results(versions=versions())
    res.load.append(("start", os.getloadavg()[0]))
    t0 = started = time.monotonic()
    pki = systems.upstream_pki() if ns.upstream_tls else None
    ca = pki.ca if pki is not None else None
    with node_upstream(tls=pki) as up, contextlib.ExitStack() as stack:
        makers: dict[str, Callable[[], contextlib.AbstractContextManager[System]]] = {
            "floor": floor,
            "portkey": lambda: portkey(up, ca),
            "litellm": lambda: litellm(up, ca),
            "aiserve": lambda: aiserve(up, ca_file=ca if ns.upstream_ca == "file" else None),
        }
        targets = [System("direct", up.base + "/v1/chat/completions", running=up, ca=ca)] \
            if "direct" in names else []
        for name in names:
            if name in makers:
                progress(f"starting {name}", t0)
                targets.append(stack.enter_context(makers[name]()))
        if "rps" not in skip:
            run_rps(targets, plan, res, t0)
        if "ttft" not in skip:
            run_ttft(targets, plan, res, t0)
        gw = next((s for s in targets if s.name == "aiserve"), None)
        if ns.profile and gw is not None:
            res.profile = run_profile(gw, plan, out_dir, snapshot.split()[-1], t0)
    if "memory" not in skip:
        run_memory([n for n in ("aiserve", "litellm") if n in names], plan, res, t0)
    if "workers" not in skip and "aiserve" in names:
        with node_upstream(cpu=None, tls=pki) as up:  # everything shares both CPUs here
            run_workers(up, plan, res, t0, ca if ns.upstream_ca == "file" else None)
    res.load.append(("end", os.getloadavg()[0]))
    res.commands = systems.RECORDER.commands
    text = report(res, plan, names, args, started, snapshot)
    stem = "throughput-tls" if ns.upstream_tls else "throughput"
    (out_dir / f"{stem}.md").write_text(text)
    (out_dir / f"{stem}.json").write_text(json.dumps(
        {"rps": res.rps, "ttft": res.ttft, "memory": res.memory, "workers": res.workers,
         "load": res.load, "versions": res.versions}, indent=1))
    print(text)
    print(f"wrote {out_dir / f'{stem}.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
