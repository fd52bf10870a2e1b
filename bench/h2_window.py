"""One HTTP/2 client that never opens its flow-control window, against a real gateway.

The client opens one h2c connection with ``SETTINGS_INITIAL_WINDOW_SIZE = 0`` and asks
for ``--streams`` long streamed chat completions, then never sends a WINDOW_UPDATE: the
gateway may send it headers but not one DATA byte. The upstream is :class:`Upstream`, an
OpenAI-compatible server in this process whose every reply is ``--reply-mb`` of deltas
written as fast as its socket takes them, and which counts the bytes it got written: a
gateway whose backpressure reaches the upstream stops reading them, one that buffers the
replies reads them all. Meanwhile the worker's RSS is sampled.

    .venv/bin/python -m bench.h2_window                       # 64 streams of 3 MB, 12 s
    AISERVE_HYPERCORN_PATCHES=off .venv/bin/python -m bench.h2_window   # hypercorn as shipped
    .venv/bin/python -m bench.h2_window --h1                  # 64 HTTP/1.1 clients that never read
    .venv/bin/python -m bench.h2_window --relay 5 --reply-mb 30 --delta-bytes 1024  # MB/s, read

Prints the RSS before, at the peak and at the end, the upstream bytes written against
the replies' total, and what the client saw (headers, DATA bytes, RST_STREAM codes).
``tests/test_h2_flow.py`` makes the same run with assertions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import select
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings

from bench.hostile import rss_mb, worker_pid

ROOT = Path(__file__).resolve().parent.parent
#: The route the gateway serves the upstream on, and the upstream's model.
PATH = "/v1/up/chat/completions"
MODEL = "up-model"
#: The content of one delta the upstream writes, by default (its SSE event is ~150
#: bytes more): a few tokens' worth, so that a 64 KiB read holds a few hundred events.
DELTA_BYTES = 64
#: How long after the client left the worker's RSS is read again (seconds).
LEFT_S = 3.0
#: The upstream's socket send buffer (bytes): not grown by the kernel as it would be.
SNDBUF = 64 * 1024


class Upstream:
    """An OpenAI-compatible upstream on a free loopback port, one thread per connection.

    A request's last message says how long its reply is and how it is made:
    ``bytes=N`` (the reply's event-stream bytes, default 1 MiB), ``delta=N`` (content
    bytes per event, default :data:`DELTA_BYTES`) and ``pause=S`` (seconds between events, default 0). Writes are blocking ``sendall``: when the gateway stops reading, the
    thread blocks, and :attr:`written` stops growing.
    """

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(256)
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        #: Body bytes the upstream got written into its sockets, all replies together.
        self.written = 0
        #: Replies started, finished to the end, and cut off (the gateway closed).
        self.started = 0
        self.finished = 0
        self.cut = 0
        #: Connections open now (the gateway closes one whose reply it gave up on).
        self.open = 0
        self._closing = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self._listener.close()

    def queued(self) -> int:
        """Bytes written but not yet read by the gateway: in the kernel's queues of the
        upstream's connections (``/proc/net/tcp``: the upstream side's send queue, the
        gateway side's receive queue), which on loopback can hold megabytes each."""
        port = f"{self.port:04X}"
        total = 0
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(OSError), open(table) as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    local, remote, queues = fields[1], fields[2], fields[4]
                    tx, rx = (int(q, 16) for q in queues.split(":"))
                    if local.endswith(":" + port):
                        total += tx  # the upstream's side: written, not yet sent
                    elif remote.endswith(":" + port):
                        total += rx  # the gateway's side: arrived, not yet read
        return total

    def read(self) -> int:
        """Bytes of the replies the gateway has read."""
        return max(0, self.written - self.queued())

    def _accept(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            # A fixed send buffer: what the upstream counts as written is then what the
            # gateway took, give or take the kernel's receive queue.
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        with self._lock:
            self.open += 1
        try:
            while True:  # keep-alive: one request after another
                while b"\r\n\r\n" not in buf:
                    more = conn.recv(65536)
                    if not more:
                        return
                    buf += more
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(buf) < length:
                    more = conn.recv(65536)
                    if not more:
                        return
                    buf += more
                body, buf = buf[:length], buf[length:]
                self._reply(conn, body)
        except OSError:
            pass
        finally:
            conn.close()
            with self._lock:
                self.open -= 1

    def _reply(self, conn: socket.socket, body: bytes) -> None:
        text = json.dumps(json.loads(body or b"{}").get("messages", [])[-1:])
        size = int(m.group(1)) if (m := re.search(r"bytes=(\d+)", text)) else 1 << 20
        pause = float(m.group(1)) if (m := re.search(r"pause=([0-9.]+)", text)) else 0.0
        delta = "x" * (int(m.group(1)) if (m := re.search(r"delta=(\d+)", text)) else DELTA_BYTES)
        event = _event({"content": delta}, None)
        conn.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        with self._lock:
            self.started += 1
        sent = 0
        try:
            while sent < size:
                self._write(conn, event)
                sent += len(event)
                if pause:
                    time.sleep(pause)
            self._write(conn, _event({}, "stop") + b"data: [DONE]\n\n")
            conn.sendall(b"0\r\n\r\n")
        except OSError:
            with self._lock:
                self.cut += 1
            raise
        with self._lock:
            self.finished += 1

    def _write(self, conn: socket.socket, event: bytes) -> None:
        chunk = _chunk(event)
        conn.sendall(chunk)
        with self._lock:
            self.written += len(chunk)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(delta: dict[str, str], finish: str | None) -> bytes:
    chunk = {
        "id": "chatcmpl-up",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def reply_bytes(size: int, delta: int = DELTA_BYTES) -> int:
    """The SSE bytes :class:`Upstream` writes for a reply of ``size`` bytes (a whole
    number of events, and the end)."""
    one = len(_event({"content": "x" * delta}, None))
    return -(-size // one) * len(_chunk(b"x" * one)) + len(
        _chunk(_event({}, "stop") + b"data: [DONE]\n\n")
    )


def gateway_toml(upstream_port: int, write_timeout_ms: int = 10_000) -> str:
    """The embedded default config, with route ``/v1/up`` on :class:`Upstream`."""
    text = (ROOT / "src" / "aiserve_trio" / "aiserve.toml").read_text()
    old = "write_timeout_ms = 10000"
    assert old in text, old
    text = text.replace(old, f"write_timeout_ms = {write_timeout_ms}")
    return (
        text
        + f"""
[adapters.up]
kind = "openai"
base_url = "http://127.0.0.1:{upstream_port}/v1"
models = ["{MODEL}"]

[[routes]]
path = "{PATH}"
name = "up"
adapter = "up"
default_model = "{MODEL}"
"""
    )


def chat_body(size: int, pause: float = 0.0, delta: int = DELTA_BYTES) -> bytes:
    """A streamed chat request whose reply from :class:`Upstream` is ``size`` bytes."""
    content = f"bytes={size} delta={delta} pause={pause}"
    return json.dumps(
        {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": content}]}
    ).encode()


def request_headers(body: bytes) -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":path", PATH),
        (":scheme", "http"),
        (":authority", "127.0.0.1"),
        ("content-type", "application/json"),
        ("content-length", str(len(body))),
    ]


@dataclass
class Seen:
    """What an HTTP/2 client saw on its connection."""

    heads: int = 0
    data: int = 0
    ended: int = 0
    #: RST_STREAM error codes by name.
    resets: Counter[str] = field(default_factory=Counter)
    goaway: str | None = None
    closed: bool = False
    #: Per stream: the body bytes received, and whether it ended with ``[DONE]``.
    bodies: dict[int, bytearray] = field(default_factory=dict)

    def feed(self, events: list[h2.events.Event], conn: h2.connection.H2Connection) -> None:
        for ev in events:
            if isinstance(ev, h2.events.ResponseReceived):
                self.heads += 1
            elif isinstance(ev, h2.events.DataReceived):
                self.data += len(ev.data)
                self.bodies.setdefault(ev.stream_id, bytearray()).extend(ev.data)
                if ev.flow_controlled_length and conn.local_settings.initial_window_size:
                    conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, h2.events.StreamEnded):
                self.ended += 1
            elif isinstance(ev, h2.events.StreamReset):
                self.resets[_code(ev.error_code)] += 1
            elif isinstance(ev, h2.events.ConnectionTerminated):
                self.goaway = _code(ev.error_code)

    def done(self) -> int:
        """Streams whose body ended with ``data: [DONE]``."""
        return sum(1 for b in self.bodies.values() if b.rstrip().endswith(b"data: [DONE]"))


def _code(code: int | None) -> str:
    if code is None:
        return "none"
    try:
        return h2.errors.ErrorCodes(code).name
    except ValueError:
        return str(code)


def h2_connect(
    port: int, window: int | None = None
) -> tuple[socket.socket, h2.connection.H2Connection]:
    """An h2c (prior knowledge) connection; ``window``: SETTINGS_INITIAL_WINDOW_SIZE."""
    sock = socket.create_connection(("127.0.0.1", port))
    config = h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
    conn = h2.connection.H2Connection(config)
    if window is not None:
        # In the first SETTINGS frame: no byte may come before it is known.
        conn.local_settings = h2.settings.Settings(
            client=True,
            initial_values={
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window,
            },
        )
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    return sock, conn


def pump(sock: socket.socket, conn: h2.connection.H2Connection, seen: Seen, wait: float) -> None:
    """Read what the server sent within ``wait`` seconds, answer what h2 answers."""
    ready, _, _ = select.select([sock], [], [], wait)
    if not ready or seen.closed:
        return
    try:
        data = sock.recv(1 << 20)
    except OSError:
        data = b""
    if not data:
        seen.closed = True
        return
    seen.feed(conn.receive_data(data), conn)
    out = conn.data_to_send()
    if out:
        with contextlib.suppress(OSError):
            sock.sendall(out)


class Sample(NamedTuple):
    """The worker's RSS and the upstream's bytes at one moment."""

    at: float
    rss_mb: float
    #: Reply bytes the upstream wrote into its sockets, and those the gateway read.
    written: int
    read: int

    @classmethod
    def take(cls, pid: int, upstream: Upstream) -> Sample:
        return cls(time.monotonic(), rss_mb(pid), upstream.written, upstream.read())


@dataclass
class Run:
    """One run: samples over time, what the client saw, the replies' total bytes."""

    samples: list[Sample]
    seen: Seen
    total: int
    #: Taken :data:`LEFT_S` after the client closed its connections.
    left: Sample | None = None

    def report(self) -> str:
        first, last = self.samples[0], self.samples[-1]
        peak = max(s.rss_mb for s in self.samples)
        s = self.seen
        return "\n".join(
            [
                f"worker RSS: {first.rss_mb:.1f} MB before, {peak:.1f} MB at the peak"
                f" (+{peak - first.rss_mb:.1f}), {last.rss_mb:.1f} MB after"
                f" {last.at - first.at:.1f} s (+{last.rss_mb - first.rss_mb:.1f})",
                f"upstream: {last.read / 1e6:.1f} MB read by the gateway,"
                f" {last.written / 1e6:.1f} MB written (the rest in the kernel's queues),"
                f" of {self.total / 1e6:.1f} MB ({100 * last.read / self.total:.1f} % read)",
                f"client: {s.heads} response heads, {s.data} DATA bytes, {s.ended} streams"
                f" ended, RST_STREAM {dict(s.resets) or 'none'}, GOAWAY {s.goaway or 'none'}",
            ]
            + (
                [
                    f"{LEFT_S:g} s after the client left: worker RSS {self.left.rss_mb:.1f} MB"
                    f" (+{self.left.rss_mb - first.rss_mb:.1f})"
                ]
                if self.left
                else []
            )
        )


def window_zero(
    port: int,
    pid: int,
    upstream: Upstream,
    streams: int,
    size: int,
    seconds: float,
    delta: int = DELTA_BYTES,
) -> Run:
    """``streams`` requests of ``size`` bytes on one h2c connection whose window stays 0."""
    sock, conn = h2_connect(port, window=0)
    seen = Seen()
    samples = [Sample.take(pid, upstream)]
    try:
        body = chat_body(size, delta=delta)
        for _ in range(streams):
            sid = conn.get_next_available_stream_id()
            conn.send_headers(sid, request_headers(body))
            conn.send_data(sid, body, end_stream=True)
        sock.sendall(conn.data_to_send())
        end = time.monotonic() + seconds
        next_sample = time.monotonic() + 0.25
        while time.monotonic() < end and not seen.closed:
            pump(sock, conn, seen, 0.05)
            if time.monotonic() >= next_sample:
                samples.append(Sample.take(pid, upstream))
                next_sample += 0.25
        samples.append(Sample.take(pid, upstream))
    finally:
        sock.close()
    time.sleep(LEFT_S)  # the client is gone: what the worker gives back
    return Run(samples, seen, streams * reply_bytes(size, delta), Sample.take(pid, upstream))


def h1_never_read(
    port: int,
    pid: int,
    upstream: Upstream,
    streams: int,
    size: int,
    seconds: float,
    delta: int = DELTA_BYTES,
) -> Run:
    """The same replies to ``streams`` HTTP/1.1 clients that never read."""
    body = chat_body(size, delta=delta)
    socks = []
    samples = [Sample.take(pid, upstream)]
    try:
        for _ in range(streams):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before the handshake
            s.connect(("127.0.0.1", port))
            s.sendall(
                b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (PATH.encode(), len(body), body)
            )
            socks.append(s)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.25)
            samples.append(Sample.take(pid, upstream))
        samples.append(Sample.take(pid, upstream))
    finally:
        for s in socks:
            s.close()
    time.sleep(LEFT_S)
    return Run(samples, Seen(), streams * reply_bytes(size, delta), Sample.take(pid, upstream))


def relay(port: int, size: int, delta: int, runs: int) -> list[float]:
    """One HTTP/1.1 client that reads as fast as it can, one reply of ``size`` bytes at a
    time: the MB/s the gateway relays, per run (the first is a cold worker's). The unit
    of its work is the upstream read, what a held stream's memory is bounded by."""
    body = chat_body(size, delta=delta)
    rates = []
    for _ in range(runs):
        with socket.create_connection(("127.0.0.1", port)) as s:
            start = time.perf_counter()
            s.sendall(
                b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (PATH.encode(), len(body), body)
            )
            got, tail = 0, b""
            while b"data: [DONE]" not in tail:  # the reply's last event, or the end
                data = s.recv(1 << 20)
                if not data:
                    break
                got += len(data)
                tail = (tail + data)[-64:]
            rates.append(got / (time.perf_counter() - start) / 1e6)
    return rates


@contextlib.contextmanager
def stack(
    write_timeout_ms: int = 10_000, env: dict[str, str] | None = None
) -> Iterator[tuple[int, int, Upstream]]:
    """The upstream and a real hypercorn + gateway in front of it: (port, worker pid, upstream)."""
    sys.path.insert(0, str(ROOT))
    from tests.servers import hypercorn_gateway

    upstream = Upstream()
    try:
        with tempfile.TemporaryDirectory() as d:
            cfg = Path(d) / "gateway.toml"
            cfg.write_text(gateway_toml(upstream.port, write_timeout_ms))
            args = ["--access-logfile", os.devnull, "--error-logfile", str(Path(d) / "error.log")]
            with hypercorn_gateway(cfg, extra_args=args, env=env) as (base, proc):
                yield int(base.rsplit(":", 1)[1]), worker_pid(proc.pid), upstream
    finally:
        upstream.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--reply-mb", type=float, default=3.0)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--delta-bytes", type=int, default=DELTA_BYTES, help="content per event")
    ap.add_argument(
        "--write-timeout-ms",
        type=int,
        default=60_000,
        help="the gateway's write deadline (default longer than the run: RSS is measured"
        " while the streams are held, not after the gateway gave up on them)",
    )
    ap.add_argument("--h1", action="store_true", help="HTTP/1.1 clients that never read")
    ap.add_argument(
        "--relay",
        type=int,
        metavar="RUNS",
        help="instead: one reading HTTP/1.1 client, RUNS replies of --reply-mb one after"
        " another, the MB/s relayed",
    )
    args = ap.parse_args()
    size = int(args.reply_mb * 1e6)
    mode = os.environ.get("AISERVE_HYPERCORN_PATCHES", "") or "on"
    if args.relay:
        with stack(args.write_timeout_ms) as (port, _, _):
            rates = relay(port, size, args.delta_bytes, args.relay)
        print(
            f"relayed to one reading HTTP/1.1 client, {args.reply_mb:g} MB of"
            f" {args.delta_bytes} B deltas, seam {mode}, load {os.getloadavg()[0]:.2f}: "
            + ", ".join(f"{r:.1f}" for r in rates)
            + " MB/s"
        )
        return
    print(
        f"{args.streams} streams of {args.reply_mb:g} MB ({args.delta_bytes} B a delta),"
        f" {args.seconds:g} s,"
        f" {'HTTP/1.1 clients that never read' if args.h1 else 'one h2c connection, window 0'},"
        f" seam {mode}, load {os.getloadavg()[0]:.2f}"
    )
    with stack(args.write_timeout_ms) as (port, pid, upstream):
        run = (h1_never_read if args.h1 else window_zero)(
            port, pid, upstream, args.streams, size, args.seconds, args.delta_bytes
        )
        print(run.report())
        print(
            f"upstream replies: {upstream.started} started, {upstream.finished} finished,"
            f" {upstream.cut} cut off"
        )


if __name__ == "__main__":
    main()
