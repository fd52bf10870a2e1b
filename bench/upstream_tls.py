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
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import socket
import ssl
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .ab import node_upstream
from .systems import ROOT, SYSTEM_CPU, UpstreamPKI, pinned, upstream_pki

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
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        what, *rest = ns.child
        if what == "io":
            port, ca, way, conc, n = rest
            print(json.dumps(_child_io(int(port), ca, way, int(conc), int(n))))
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
