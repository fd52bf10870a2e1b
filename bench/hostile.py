"""Hostile clients against a real gateway (hypercorn + aiserve_trio), loopback only.

Each attack runs for a bounded time and frame count while a polite HTTP/1.1
client keeps asking for chat completions; we record what the server did to the
attacker, the polite client's latency, and the worker's RSS before and after.

    .venv/bin/python -m bench.hostile            # writes bench/results/hostile.md

tests/test_hostile.py runs the same attacks with assertions.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
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



def _code(code: int | None) -> str:
    """An h2 error code's name (h2 leaves it None when the frame carried none)."""
    return "NO_CODE" if code is None else h2.errors.ErrorCodes(code).name

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
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
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
        t.start()
        try:
            yield self
        finally:
            self._stop.set()
            t.join(10)

    def summary(self) -> str:
        if not self.latencies:
            return f"0 answers, {self.failures} failures"
        lat = sorted(self.latencies)
        p50 = statistics.median(lat) * 1000
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000
        return f"{len(lat)} answers, {self.failures} failures, p50 {p50:.0f} ms, p99 {p99:.0f} ms"


# --- attacks: each returns what the server did ------------------------------------------


def _h2(
    port: int, settings: dict[int, int] | None = None
) -> tuple[socket.socket, h2.connection.H2Connection]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
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


def _flood(port: int, seconds: float, max_frames: int, frame: Callable[..., None]) -> str:
    sock, conn = _h2(port)
    end = time.monotonic() + seconds
    sent = 0
    outcome = ""
    try:
        while time.monotonic() < end and sent < max_frames:
            for _ in range(100):
                frame(conn, sent)
                sent += 1
            try:
                sock.sendall(conn.data_to_send())
            except OSError:
                outcome = "connection closed"
                break
        outcome = outcome or _watch(sock, conn, 2.0)
    except h2.exceptions.ProtocolError:
        outcome = "connection closed"
    finally:
        sock.close()
    return f"{outcome} after {sent} frames"


def rapid_reset(port: int, seconds: float = 2.0) -> str:
    def frame(conn: h2.connection.H2Connection, i: int) -> None:
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, _headers(), end_stream=True)
        conn.reset_stream(sid)

    return _flood(port, seconds, 50_000, frame)


def settings_flood(port: int, seconds: float = 2.0) -> str:
    def frame(conn: h2.connection.H2Connection, i: int) -> None:
        conn.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 100 + i % 7})

    return _flood(port, seconds, 50_000, frame)


def ping_flood(port: int, seconds: float = 2.0) -> str:
    def frame(conn: h2.connection.H2Connection, i: int) -> None:
        conn.ping(i.to_bytes(8, "big"))

    return _flood(port, seconds, 50_000, frame)


def priority_flood(port: int, seconds: float = 2.0) -> str:
    """PRIORITY frames for 1,500 idle streams: hypercorn's priority tree holds at most
    1,000 and raised TooManyStreamsError out of the worker (docs/architecture.md)."""

    def frame(conn: h2.connection.H2Connection, i: int) -> None:
        conn.prioritize(2 * i + 1, weight=16)

    return _flood(port, seconds, 1_500, frame)


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
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
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


ATTACKS: dict[str, Callable[[int], str]] = {
    "h2 rapid reset (HEADERS + RST_STREAM)": rapid_reset,
    "h2 SETTINGS flood": settings_flood,
    "h2 PING flood": ping_flood,
    "h2 PRIORITY flood, 1,500 idle streams": priority_flood,
    "h2 CONTINUATION flood": continuation_flood,
    "h2 oversized header block": oversized_headers,
    "h2 1-byte flow-control window reader": one_byte_window,
    "h1 slowloris headers": slowloris_headers,
    "h1 slowloris body": slowloris_body,
    "h1 pipelined garbage": pipelined_garbage,
    "h1 smuggling CL + TE": smuggling_cl_te,
    "h1 smuggling TE + TE": smuggling_te_te,
}


@dataclass
class Row:
    attack: str
    outcome: str
    polite: str
    rss_before: float
    rss_after: float
    up: bool


def run_attack(name: str, port: int, pid: int) -> tuple[Row, Polite]:
    before = rss_mb(pid)
    polite = Polite(port)
    with polite.during():
        time.sleep(0.2)
        outcome = ATTACKS[name](port)
        time.sleep(0.3)
    up = alive(pid)
    return Row(name, outcome, polite.summary(), before, rss_mb(pid) if up else 0.0, up), polite


@contextlib.contextmanager
def gateway() -> Iterator[tuple[int, int, Path]]:
    """A real hypercorn + gateway on a free port: (port, worker pid, error log path)."""
    import sys

    sys.path.insert(0, str(ROOT))
    from tests.servers import hypercorn_gateway

    with tempfile.TemporaryDirectory() as d:
        cfg = gateway_config(Path(d))
        errlog = Path(d) / "error.log"
        args = ["--access-logfile", os.devnull, "--error-logfile", str(errlog)]
        with hypercorn_gateway(cfg, extra_args=args) as (base, proc):
            port = int(base.rsplit(":", 1)[1])
            yield port, worker_pid(proc.pid), errlog


def main() -> None:
    rows = []
    with gateway() as (port, pid, _):
        for name in ATTACKS:
            row, _ = run_attack(name, port, pid)
            rows.append(row)
            print(row)
    out = ROOT / "bench" / "results" / "hostile.md"
    lines = [
        "# Hostile clients against hypercorn + aiserve_trio (one worker, loopback)",
        "",
        "`.venv/bin/python -m bench.hostile`; each attack bounded to a few seconds while a",
        "polite HTTP/1.1 client sends non-streaming chat requests on fresh connections.",
        "",
        "| attack | what the server did | polite client during it | worker RSS before -> after | server up |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.attack} | {r.outcome} | {r.polite} | {r.rss_before:.0f} -> {r.rss_after:.0f} MB | {'yes' if r.up else 'NO'} |"
        )
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
