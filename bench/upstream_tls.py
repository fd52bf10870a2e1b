"""The lean client's TLS, measured in parts: the I/O shape, resumption, the fairness bound.

    .venv/bin/python -m bench.upstream_tls [--requests 3000] [--connects 300] [--conc 1,16]

Against ``bench/node/upstream.js`` over HTTPS (a private CA from ``systems.upstream_pki``;
the upstream on CPU 1, this process on CPU 0):

1. **ssl socket or memory BIOs.** The same keep-alive exchange (a POST, the 16-delta
   streamed reply parsed by llhttp) on N connections, done two ways: a non-blocking
   ``ssl.SSLSocket`` (``send``/``recv`` straight on it, Trio only to wait), and an
   ``ssl.SSLObject`` with memory BIOs over a plain non-blocking socket (what
   ``trio.SSLStream`` does). CPU microseconds per request, best of the rounds.
2. **resumption.** A new connection's TCP connect and TLS handshake through
   ``h1.H1Pool``, with the backend's last session offered (resumed) and without
   (full): p50 / p90 milliseconds, and what the handshake counter saw.
3. **the checkpoint bound.** What moving ``h1.CHECKPOINT_BYTES`` costs (TLS decryption
   through memory BIOs and llhttp parsing of a chunked body, in process) against what
   one ``trio.lowlevel.checkpoint()`` costs.

Prints a Markdown report and writes ``bench/results/<date>/upstream_tls.md``.

``--load`` measures what matters instead (issue 56): the whole gateway under load, the
upstream over TLS against plain HTTP, in one run::

    .venv/bin/python -m bench.upstream_tls --load [--rounds 3] [--duration 6]

4. **under load.** Two builds side by side: *before*, this revision with the
   ``SSLSocket`` client (``adapters/h1.py`` and ``tls.py`` as of ``--before``), and
   *after*, this revision. Each round serves each build (hypercorn, one Trio worker on
   CPU 0, a fresh process) in front of ``bench/node/upstream.js`` (16 deltas, streamed
   upstream replies) over plain HTTP and over HTTPS (the private CA as ``ca_file``),
   and Portkey (``bench/work/portkey``, trusting the CA by ``NODE_EXTRA_CA_CERTS``) in
   front of the HTTPS one. Per point: req/s and the worker's CPU a request (``/proc``
   ticks) for non-streamed requests at c=16 and c=64 (wrk on CPU 1 with the upstream);
   the worker's read-family syscalls a request (``strace -c -f -e
   trace=read,recvfrom,recvmsg`` attached to the worker while wrk runs at c=16: client
   reads and upstream reads, would-block ones included); streamed time to first token
   at c=1 (``bench.throughput``'s raw-socket client). Ratios are taken within a round
   (TLS/plain of one build, the gateway/Portkey at c=64) and reported as the median of
   the rounds with their range.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import systems
from .ab import node_upstream, wrk
from .systems import LOAD_CPU, ROOT, SYSTEM_CPU, Running, UpstreamPKI, pinned, upstream_pki

BODY = json.dumps({"model": "sim-model", "stream": True,
                   "messages": [{"role": "user", "content": "hello there"}]}).encode()


def _request(host: str) -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(BODY)}\r\n\r\n").encode() + BODY


class _Done:
    """llhttp callbacks: only whether the message is complete."""

    def __init__(self) -> None:
        self.complete = False

    def on_message_complete(self) -> None:
        self.complete = True


async def _exchange_socket(sock: ssl.SSLSocket, request: bytes) -> None:
    import httptools
    import trio

    done = _Done()
    parser = httptools.HttpResponseParser(done)
    view = memoryview(request)
    sent = 0
    while sent < len(request):
        try:
            sent += sock.send(view[sent:])
        except ssl.SSLWantWriteError:
            await trio.lowlevel.wait_writable(sock)
        except ssl.SSLWantReadError:
            await trio.lowlevel.wait_readable(sock)
    while not done.complete:
        try:
            data = sock.recv(65536)
        except ssl.SSLWantReadError:
            await trio.lowlevel.wait_readable(sock)
            continue
        if not data:
            raise ConnectionError("closed")
        parser.feed_data(data)


class _BIOConn:
    def __init__(self, raw: socket.socket, obj: ssl.SSLObject, incoming: ssl.MemoryBIO,
                 outgoing: ssl.MemoryBIO) -> None:
        self.raw, self.obj, self.incoming, self.outgoing = raw, obj, incoming, outgoing

    async def flush(self) -> None:
        import trio

        data = self.outgoing.read()
        view = memoryview(data)
        sent = 0
        while sent < len(data):
            try:
                sent += self.raw.send(view[sent:])
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.raw)

    async def fill(self) -> None:
        import trio

        while True:
            try:
                data = self.raw.recv(65536)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.raw)
                continue
            if not data:
                self.incoming.write_eof()
            else:
                self.incoming.write(data)
            return


async def _exchange_bio(conn: _BIOConn, request: bytes) -> None:
    import httptools

    done = _Done()
    parser = httptools.HttpResponseParser(done)
    conn.obj.write(request)
    await conn.flush()
    while not done.complete:
        try:
            data = conn.obj.read(65536)
        except ssl.SSLWantReadError:
            await conn.fill()
            continue
        if not data:
            raise ConnectionError("closed")
        parser.feed_data(data)
    if conn.outgoing.pending:  # tickets acknowledged, key updates
        await conn.flush()


def _child_io(port: int, ca: str, way: str, conc: int, requests: int) -> dict[str, Any]:
    import trio

    context = ssl.create_default_context(cafile=ca)
    context.set_alpn_protocols(["http/1.1"])
    request = _request(f"127.0.0.1:{port}")
    done = 0

    async def one(per_task: int) -> None:
        nonlocal done
        raw = socket.create_connection(("127.0.0.1", port))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if way == "socket":
            sock = context.wrap_socket(raw, server_hostname="127.0.0.1")
            sock.setblocking(False)
            for _ in range(per_task):
                await _exchange_socket(sock, request)
                done += 1
            sock.close()
            return
        raw.setblocking(False)
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        obj = context.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
        conn = _BIOConn(raw, obj, incoming, outgoing)
        while True:
            try:
                obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                await conn.flush()
                await conn.fill()
        await conn.flush()
        for _ in range(per_task):
            await _exchange_bio(conn, request)
            done += 1
        raw.close()

    async def main() -> dict[str, Any]:
        async with trio.open_nursery() as warm:  # connections and caches warm
            for _ in range(conc):
                warm.start_soon(one, 20)
        cpu0, t0 = time.process_time(), time.monotonic()
        before = done
        async with trio.open_nursery() as load:
            for _ in range(conc):
                load.start_soon(one, requests // conc)
        n = done - before
        return {"cpu_us": (time.process_time() - cpu0) / n * 1e6,
                "rps": n / (time.monotonic() - t0), "requests": n}

    return trio.run(main)


def _child_connect(port: int, ca: str, connects: int) -> dict[str, Any]:
    import trio

    from aiserve_trio.adapters import h1
    from aiserve_trio.adapters.tls import TLSSettings

    context = ssl.create_default_context(cafile=ca)
    context.set_alpn_protocols(["http/1.1"])
    kinds: list[str] = []
    tls = TLSSettings(context, "127.0.0.1", kinds.append)
    head = h1.RequestHead("POST", "/v1/chat/completions", f"127.0.0.1:{port}",
                          [(b"content-type", b"application/json")]).build([], BODY)
    out: dict[str, Any] = {}

    async def first_request() -> float:
        """Connect and handshake alone (the pool's own step for a new connection)."""
        pool = h1.H1Pool("127.0.0.1", port, max_connections=1, tls=tls)
        t = time.perf_counter()
        conn = await pool._new(h1.Timeouts(10, 10))
        took = time.perf_counter() - t
        # One exchange, so that the backend's session tickets arrive and are kept.
        async with pool.request(head, BODY, h1.Timeouts(10, 10)) as r:
            await r.read(1 << 20)
        conn.close()
        await pool.aclose()
        return took * 1000

    async def main() -> None:
        for mode in ("full", "resumed", "full", "resumed"):  # interleaved, twice
            samples: list[float] = []
            kinds.clear()
            for _ in range(connects // 2):
                if mode == "full":
                    tls.session = None
                samples.append(await first_request())
            got = out.setdefault(mode, {"samples": [], "kinds": {}})
            got["samples"] += samples
            for k in kinds:
                got["kinds"][k] = got["kinds"].get(k, 0) + 1

    trio.run(main)
    for got in out.values():
        s = sorted(got.pop("samples"))
        got["p50_ms"] = statistics.median(s)
        got["p90_ms"] = s[int(len(s) * 0.9)]
    return out


def _checkpoint_bound() -> dict[str, Any]:
    """In process: µs to decrypt and parse N bytes of a chunked body; µs per checkpoint."""
    import httptools
    import trio
    import trustme

    from aiserve_trio.adapters import h1

    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("up.test").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname="up.test")
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):  # the handshake, by hand
        for side in (client, server):
            with contextlib.suppress(ssl.SSLWantReadError):
                side.do_handshake()
        s_in.write(c_out.read())
        c_in.write(s_out.read())
    chunk = b"data: " + b"x" * 1000 + b"\n\n"
    moves: dict[int, float] = {}
    for n in (64 << 10, 256 << 10, 1 << 20, 4 << 20):
        framed = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(n // len(chunk)))
        best = float("inf")
        for _ in range(10):
            parser = httptools.HttpResponseParser(_Done())
            parser.feed_data(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            server.write(framed)
            c_in.write(s_out.read())
            t = time.perf_counter()
            while True:
                try:
                    parser.feed_data(client.read(65536))
                except ssl.SSLWantReadError:
                    break
            best = min(best, time.perf_counter() - t)
        moves[n] = best * 1e6

    async def checkpoints() -> float:
        t = time.perf_counter()
        for _ in range(100_000):
            await trio.lowlevel.checkpoint()
        return (time.perf_counter() - t) / 100_000

    return {"chosen": h1.CHECKPOINT_BYTES, "move_us": moves,
            "checkpoint_us": trio.run(checkpoints) * 1e6}


# --- 4. under load: reads, CPU and req/s a request, TLS against plain -----------------

LOAD_CONCS = (16, 64)
#: The syscalls that read: what an SSLSocket's OpenSSL makes (read), what socket.recv and
#: recv_into make (recvfrom), and recvmsg for completeness.
READ_CALLS = ("read", "recvfrom", "recvmsg")


@contextlib.contextmanager
def _upstream(pki: UpstreamPKI | None, event_writes: bool) -> Iterator[Running]:
    """``bench/node/upstream.js`` (16 deltas) on the load CPU, over HTTPS with ``pki``; with
    ``event_writes`` each event of a stream written on its own (a TLS record each)."""
    node = shutil.which("node")
    if node is None:
        raise RuntimeError("node is not installed (apt-get install nodejs)")
    port = systems.free_port()
    cmd = [node, str(ROOT / "bench" / "node" / "upstream.js"), str(port), "16"]
    env = {"UPSTREAM_EVENT_WRITES": "1" if event_writes else "0"}
    if pki is not None:
        env |= {"UPSTREAM_CERT": str(pki.cert), "UPSTREAM_KEY": str(pki.key)}
    name = "upstream-" + ("tls" if pki is not None else "plain")
    with systems.start(name, cmd, port=port, health="/v1/models", cpu=LOAD_CPU, env=env,
                       ours=False, tls=pki) as r:
        yield r


def _before_src(before: str, after_src: Path, after_sha: str) -> tuple[Path, str]:
    """``after_src`` with ``adapters/h1.py`` and ``tls.py`` as of ``before``: the same build
    but for the upstream client, so the pair measures the client alone."""
    sha = subprocess.run(["git", "rev-parse", "--short", before], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    dest = ROOT / "bench" / "work" / f"snapshot-{after_sha}-client-{sha}"
    if not (dest / "src").exists():
        shutil.copytree(after_src, dest / "src")
        for name in ("h1.py", "tls.py"):
            text = subprocess.run(["git", "show", f"{sha}:src/aiserve_trio/adapters/{name}"],
                                  cwd=ROOT, capture_output=True, check=True).stdout
            (dest / "src" / "aiserve_trio" / "adapters" / name).write_bytes(text)
    return dest / "src", sha


@contextlib.contextmanager
def _gateway_of(src: Path, upstream: Running, name: str,
                ca: Path | None) -> Iterator[tuple[Running, str | None]]:
    """The gateway of snapshot ``src`` (one Trio worker on the system CPU), auth on."""
    saved = systems.SNAPSHOT
    systems.SNAPSHOT = src
    try:
        auth = systems.gateway_auth()
        port = systems.free_port()
        cfg = ROOT / "bench" / "work" / f"upstream-tls-{name}.toml"
        cfg.write_text(systems.gateway_toml({"/v1/chat/completions": upstream.base}, auth=auth,
                                            ca_file=ca))
        env = {"AISERVE_CONFIG": str(cfg.relative_to(ROOT))}
        cmd = systems.hypercorn_cmd(port, "aiserve_trio:app")
        with systems.start(f"upstream-tls-{name}", cmd, port=port, cpu=SYSTEM_CPU, env=env) as r:
            yield r, auth.plain if auth is not None else None
    finally:
        systems.SNAPSHOT = saved


def strace_reads(text: str) -> dict[str, int]:
    """Calls (and failed calls) of the read syscalls in ``strace -c``'s summary table."""
    out = {"calls": 0, "errors": 0}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[-1] in READ_CALLS and fields[3].isdigit():
            out["calls"] += int(fields[3])
            if len(fields) == 6 and fields[4].isdigit():
                out["errors"] += int(fields[4])
    return out


def _reads_a_request(gw: Running, url: str, key: str | None, seconds: float,
                     name: str) -> dict[str, float]:
    """The worker's read syscalls a request while wrk runs non-streamed at c=16."""
    exe = shutil.which("strace")
    if exe is None:
        raise RuntimeError("strace is not installed (apt-get install strace)")
    out = ROOT / "bench" / "work" / "logs" / f"strace-{name}.txt"
    tracer = subprocess.Popen([exe, "-c", "-f", "-e", "trace=" + ",".join(READ_CALLS),
                               "-o", str(out), "-p", str(gw.worker_pid())],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached to every thread
    point = wrk(url, 16, seconds, stream=False, key=key)
    time.sleep(0.5)  # the last replies are written
    tracer.send_signal(signal.SIGINT)
    tracer.wait(30)
    counted = strace_reads(out.read_text())
    n = max(point["requests"], 1)
    return {"reads": counted["calls"] / n, "would_block": counted["errors"] / n,
            "requests": point["requests"]}


def _child_ttft(targets: list[tuple[str, str]], n: int, warmup: int = 50) -> list[list[float]]:
    """Streamed TTFTs (ms) of each ``(url, key)``, taken in turn request by request on one
    keep-alive connection each, so the machine's moments are shared alike."""
    import urllib.parse

    from .throughput import FIRST_CONTENT

    body = json.dumps({"model": "sim-model", "stream": True,
                       "messages": [{"role": "user", "content": "hello there, how are you?"}]}
                      ).encode()
    addrs: list[tuple[str, int]] = []
    requests: list[bytes] = []
    for url, key in targets:
        parts = urllib.parse.urlsplit(url)
        assert parts.hostname is not None
        assert parts.port is not None
        addrs.append((parts.hostname, parts.port))
        requests.append((f"POST {parts.path} HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                         f"Authorization: Bearer {key}\r\n\r\n").encode() + body)

    def connect(addr: tuple[str, int]) -> socket.socket:
        sock = socket.create_connection(addr, timeout=10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    socks = [connect(addr) for addr in addrs]
    samples: list[list[float]] = [[] for _ in targets]
    errors = 0
    for i in range(n + warmup):
        # Each target first every other time: what comes second meets a machine the
        # first has just used.
        for j in (range(len(socks)) if i % 2 else reversed(range(len(socks)))):
            sock = socks[j]
            try:
                t = time.perf_counter()
                sock.sendall(requests[j])
                buf = b""
                first = 0.0
                while not (b"[DONE]" in buf and buf.endswith(b"0\r\n\r\n")):
                    data = sock.recv(65536)
                    if not data:
                        raise ConnectionError(f"closed: {buf[:200]!r}")
                    buf += data
                    if not first and FIRST_CONTENT in buf:
                        first = time.perf_counter() - t
                if not buf.startswith(b"HTTP/1.1 200") or not first:
                    raise ValueError(buf[:300].decode(errors="replace"))
            except (OSError, ValueError) as exc:  # a stall of the shared machine: again
                errors += 1
                print(f"TTFT request failed: {exc}", file=sys.stderr)
                if errors > 20:
                    raise
                sock.close()
                socks[j] = connect(addrs[j])
                continue
            if i >= warmup:
                samples[j].append(first * 1000)
    for sock in socks:
        sock.close()
    return samples


def _ttft_together(targets: list[tuple[str, str | None]], n: int) -> list[dict[str, float]]:
    """p50 and p99 streamed TTFT (ms) of each target, measured in turn (a child on CPU 1)."""
    cmd = pinned([sys.executable, "-m", "bench.upstream_tls", "--child", "ttft", str(n),
                  *(part for url, key in targets for part in (url, key or ""))], LOAD_CPU)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"the TTFT client failed:\n{done.stderr[-2000:]}")
    out = done.stdout
    result = []
    for samples in json.loads(out.strip().splitlines()[-1]):
        s = sorted(samples)
        result.append({"p50_ms": statistics.median(s), "p99_ms": s[int(len(s) * 0.99)]})
    return result


def _load_points(url: str, key: str | None, headers: str, duration: float,
                 running: Running) -> dict[str, dict[str, float]]:
    wrk(url, 4, 1.0, stream=False, key=key, headers=headers)  # warm
    points: dict[str, dict[str, float]] = {}
    for c in LOAD_CONCS:
        cpu0 = running.cpu_seconds()
        p = wrk(url, c, duration, stream=False, key=key, headers=headers)
        p["cpu_us"] = (running.cpu_seconds() - cpu0) / max(p["requests"], 1) * 1e6
        points[f"c{c}"] = p
    return points


def _median_range(values: list[float]) -> str:
    if not values:
        return "—"
    return (f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"
            if len(values) > 1 else f"{values[0]:.2f}")


def load(ns: argparse.Namespace) -> str:
    """Part 4 (``--load``): the report's Markdown."""
    from .throughput import portkey

    pki = upstream_pki()
    after_src, after_sha = systems.snapshot(ns.after)
    before_src, before_sha = _before_src(ns.before, after_src, after_sha)
    builds = {"before": before_src, "after": after_src}
    # (build, scheme) -> point -> one value a round
    got: dict[tuple[str, str], dict[str, list[float]]] = {}
    portkey_rps: dict[str, list[float]] = {}
    t0 = time.monotonic()
    events = ns.upstream_writes == "event"
    with _upstream(None, events) as plain_up, _upstream(pki, events) as tls_up:
        ups = {"plain": (plain_up, None), "tls": (tls_up, pki.ca)}
        for rnd in range(ns.rounds):
            order = [(b, sch) for b in builds for sch in ups]
            if rnd % 2:
                order.reverse()
            for build, scheme in order:
                up, ca = ups[scheme]
                name = f"{build}-{scheme}"
                with _gateway_of(builds[build], up, name, ca) as (gw, key):
                    url = gw.base + "/v1/chat/completions"
                    points = _load_points(url, key, "", ns.duration, gw)
                    reads = _reads_a_request(gw, url, key, ns.strace_s, name)
                row = got.setdefault((build, scheme), {})
                for tag, p in points.items():
                    row.setdefault(f"rps_{tag}", []).append(p["rps"])
                    row.setdefault(f"cpu_{tag}", []).append(p["cpu_us"])
                    row.setdefault(f"errors_{tag}", []).append(p["errors"])
                row.setdefault("reads", []).append(reads["reads"])
                row.setdefault("would_block", []).append(reads["would_block"])
                print(f"[{time.monotonic() - t0:5.0f} s] round {rnd + 1} {name}: "
                      f"c16 {points['c16']['rps']:.0f} req/s {points['c16']['cpu_us']:.0f} us, "
                      f"c64 {points['c64']['rps']:.0f} req/s {points['c64']['cpu_us']:.0f} us, "
                      f"{reads['reads']:.1f} reads/req", flush=True)
            # TTFT: the two builds over TLS served at once, asked in turn.
            with contextlib.ExitStack() as stack:
                served = [stack.enter_context(_gateway_of(builds[b], tls_up, f"ttft-{b}", pki.ca))
                          for b in builds]
                ttfts = _ttft_together([(gw.base + "/v1/chat/completions", key)
                                        for gw, key in served], ns.ttft_samples)
            for build, ttft in zip(builds, ttfts, strict=True):
                row = got[(build, "tls")]
                row.setdefault("ttft_p50", []).append(ttft["p50_ms"])
                row.setdefault("ttft_p99", []).append(ttft["p99_ms"])
            print(f"[{time.monotonic() - t0:5.0f} s] round {rnd + 1} TTFT over TLS p50: "
                  + ", ".join(f"{b} {t['p50_ms']:.3f} ms" for b, t in zip(builds, ttfts,
                                                                          strict=True)),
                  flush=True)
            if ns.portkey:
                try:
                    with portkey(tls_up, pki.ca) as pk:
                        assert pk.running is not None
                        points = _load_points(pk.url, pk.key, pk.headers, ns.duration, pk.running)
                except RuntimeError as exc:
                    print(f"Portkey left out: {exc}", flush=True)
                    ns.portkey = False
                else:
                    for tag, p in points.items():
                        portkey_rps.setdefault(tag, []).append(p["rps"])
                    print(f"[{time.monotonic() - t0:5.0f} s] round {rnd + 1} portkey-tls: "
                          f"c16 {points['c16']['rps']:.0f} req/s, "
                          f"c64 {points['c64']['rps']:.0f} req/s", flush=True)

    def col(build: str, scheme: str, what: str) -> list[float]:
        return got[(build, scheme)][what]

    def ratio(a: list[float], b: list[float]) -> list[float]:
        return [x / y for x, y in zip(a, b, strict=True) if y]

    lines = [
        f"# The upstream over TLS under load ({dt.date.today().isoformat()})",
        "",
        f"Command: `python -m bench.upstream_tls {' '.join(sys.argv[1:])}`. {systems.host()}; "
        "the machine is shared with other work, so only figures of one round are compared "
        f"with each other. {ns.rounds} rounds; each figure is the median of the rounds with "
        "their range.",
        "",
        f"*before*: {after_sha} with `adapters/h1.py` and `tls.py` of {before_sha} "
        f"(the `ssl.SSLSocket` client); *after*: {after_sha}. Non-streamed requests, "
        f"{ns.duration:g} s a point, the upstream's reply streamed (16 deltas, "
        + ("each event written on its own: a TLS record each, as a provider writes them)."
           if events else "the whole stream in one write)."),
        "",
        "| build | upstream | reads a request (would block) | CPU a request c=16 | "
        "req/s c=16 | CPU a request c=64 | req/s c=64 | TTFT c=1 p50 / p99 (streamed; "
        "the builds served at once, asked in turn) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for build in builds:
        for scheme in ups:
            r = got[(build, scheme)]
            first = (f"{_median_range(r['ttft_p50'])} / {_median_range(r['ttft_p99'])} ms"
                     if "ttft_p50" in r else "")
            lines.append(
                f"| {build} | {scheme} | {_median_range(r['reads'])} "
                f"({_median_range(r['would_block'])}) | {_median_range(r['cpu_c16'])} µs | "
                f"{_median_range(r['rps_c16'])} | {_median_range(r['cpu_c64'])} µs | "
                f"{_median_range(r['rps_c64'])} | {first} |")
    if portkey_rps:
        lines.append(f"| Portkey | tls | | | {_median_range(portkey_rps['c16'])} | | "
                     f"{_median_range(portkey_rps['c64'])} | |")
    lines += [
        "",
        "Ratios, round by round (median, range):",
        "",
        "| | before | after |",
        "|---|---|---|",
        "| TLS / plain req/s at c=16 | "
        + " | ".join(_median_range(ratio(col(b, "tls", "rps_c16"), col(b, "plain", "rps_c16")))
                     for b in builds) + " |",
        "| TLS / plain CPU a request at c=16 | "
        + " | ".join(_median_range(ratio(col(b, "tls", "cpu_c16"), col(b, "plain", "cpu_c16")))
                     for b in builds) + " |",
    ]
    if portkey_rps:
        lines.append("| over TLS, the gateway / Portkey req/s at c=64 | "
                     + " | ".join(_median_range(ratio(col(b, "tls", "rps_c64"), portkey_rps["c64"]))
                                  for b in builds) + " |")
    lines.append("| after / before, TLS TTFT p50 at c=1 | | "
                 + _median_range(ratio(col("after", "tls", "ttft_p50"),
                                       col("before", "tls", "ttft_p50"))) + " |")
    errors = sum(sum(v) for r in got.values() for k, v in r.items() if k.startswith("errors"))
    lines += ["", f"wrk errors (all gateway points): {errors:g}."]
    return "\n".join(lines) + "\n"


def _run(args: list[str]) -> dict[str, Any]:
    cmd = pinned([sys.executable, "-m", "bench.upstream_tls", "--child", *args], SYSTEM_CPU)
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.upstream_tls",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--connects", type=int, default=300)
    ap.add_argument("--conc", default="1,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--load", action="store_true",
                    help="part 4: reads, CPU and req/s a request under load, TLS and plain")
    ap.add_argument("--duration", type=float, default=6.0, help="--load: seconds a point")
    ap.add_argument("--strace-s", type=float, default=3.0,
                    help="--load: seconds of c=16 load the worker's reads are counted over")
    ap.add_argument("--ttft-samples", type=int, default=300, help="--load: streamed TTFTs")
    ap.add_argument("--before", default="e2ec605~1",
                    help="--load: the revision whose h1.py and tls.py make the before build")
    ap.add_argument("--after", default="HEAD", help="--load: the revision measured")
    ap.add_argument("--upstream-writes", choices=("event", "one"), default="event",
                    help="--load: the upstream writes each event on its own, or a stream at once")
    ap.add_argument("--no-portkey", dest="portkey", action="store_false",
                    help="--load: leave Portkey out")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.load:
        text = load(ns)
        out = Path(ns.out) if ns.out else (ROOT / "bench" / "results" / dt.date.today().isoformat()
                                           / "upstream_tls_load.md")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(text)
        print(f"wrote {out}")
        return 0
    if ns.child:
        what, *rest = ns.child
        if what == "io":
            port, ca, way, conc, n = rest
            print(json.dumps(_child_io(int(port), ca, way, int(conc), int(n))))
        elif what == "ttft":
            n, *pairs = rest
            targets = list(zip(pairs[::2], pairs[1::2], strict=True))
            print(json.dumps(_child_ttft(targets, int(n))))
        elif what == "connect":
            port, ca, n = rest
            print(json.dumps(_child_connect(int(port), ca, int(n))))
        else:
            print(json.dumps(_checkpoint_bound()))
        return 0
    pki: UpstreamPKI = upstream_pki()
    concs = [int(c) for c in ns.conc.split(",")]
    io: dict[tuple[str, int], dict[str, Any]] = {}
    with node_upstream(tls=pki) as up:
        port = up.base.rsplit(":", 1)[1]
        for _ in range(ns.rounds):
            for conc in concs:
                for way in ("socket", "bio"):
                    p = _run(["io", port, str(pki.ca), way, str(conc), str(ns.requests)])
                    key = (way, conc)
                    if key not in io or p["cpu_us"] < io[key]["cpu_us"]:
                        io[key] = p
        connect = _run(["connect", port, str(pki.ca), str(ns.connects)])
    bound = _run(["bound"])
    lines = [
        f"# The lean client's TLS, in parts ({dt.date.today().isoformat()})",
        "",
        f"Command: `python -m bench.upstream_tls {' '.join(sys.argv[1:] if argv is None else argv)}`; "
        f"`bench/node/upstream.js` over HTTPS (16 deltas, streamed). Best of {ns.rounds} rounds.",
        "",
        "| connections | non-blocking ssl socket: CPU/request, req/s | SSLObject + memory BIOs: "
        "CPU/request, req/s |",
        "|---|---|---|",
    ]
    for conc in concs:
        a, b = io[("socket", conc)], io[("bio", conc)]
        lines.append(f"| {conc} | {a['cpu_us']:.0f} µs, {a['rps']:.0f} | "
                     f"{b['cpu_us']:.0f} µs, {b['rps']:.0f} |")
    lines += [
        "",
        "| a new connection: connect + handshake | p50 | p90 | handshakes counted |",
        "|---|---|---|---|",
    ]
    for mode in ("full", "resumed"):
        c = connect[mode]
        lines.append(f"| {mode} handshake | {c['p50_ms']:.3f} ms | {c['p90_ms']:.3f} ms | "
                     f"{c['kinds']} |")
    saving = connect["full"]["p50_ms"] - connect["resumed"]["p50_ms"]
    lines += [
        "",
        f"Resumption saves {saving:.3f} ms (p50) of a new connection's connect + handshake.",
        "",
        f"The fairness bound: moving N bytes without a checkpoint (TLS decryption and llhttp "
        f"parsing of a chunked event stream, in process, no syscalls) against one "
        f"`trio.lowlevel.checkpoint()` ({bound['checkpoint_us']:.2f} µs). "
        f"`h1.CHECKPOINT_BYTES` is {bound['chosen'] // 1024} KiB.",
        "",
        "| N | moving N | a checkpoint, as a share of that work |",
        "|---|---|---|",
        *(f"| {int(n) // 1024} KiB | {us:.0f} µs | {bound['checkpoint_us'] / us * 100:.1f} % |"
          for n, us in bound["move_us"].items()),
    ]
    text = "\n".join(lines) + "\n"
    out = Path(ns.out) if ns.out else ROOT / "bench" / "results" / dt.date.today().isoformat() / "upstream_tls.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
