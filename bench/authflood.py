"""A flood of wrong secrets on a published key id, against a real gateway (loopback only).

The gateway runs configs/examples/bank.toml (auth on; its ``demo`` and ``ops`` key ids
are in the README) under the hypercorn binary, with an instant mock and no rate limit
on ``demo``. An attacker process opens ``--connections`` keep-alive connections, each
from its own loopback address (127.1.0.1, 127.1.0.2, ...), and sends
``GET /v1/models`` with ``Authorization: Bearer aik_demo_<random secret>`` on each as
fast as it is answered, reconnecting when the server closes or refuses it. Meanwhile a
valid client on 127.0.0.1 sends chat completions with the real ``demo`` key, one at a
time; we report the share of its requests answered 200 and their latency, and what the
attacker got (401s, 503s, connections refused at accept).

Then the timing probe: ``--probes`` requests with an unknown key id and as many with
the known ``demo`` id and a wrong secret, interleaved, each on a fresh connection from
a fresh address (so the penalty box stays out of it); the median and p90 of each.

    .venv/bin/python -m bench.authflood                       # 1,100 connections, 10 s
    .venv/bin/python -m bench.authflood --duration 1 --connections 50 --probes 20

The issue's done-means: the valid client >= 90 % served with p99 < 500 ms during the
flood, none of its requests refused for want of a slot (503), and the two probe
timings equal within noise. tests/test_authflood.py runs a short version.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import trio
import trio.lowlevel

ROOT = Path(__file__).resolve().parent.parent
DEMO_KEY = "aik_demo_hEn8rpOr9Rcn00wlo27yMqWGG6cqnbVQ"
CHAT = json.dumps(
    {"model": "aiserve-mock", "messages": [{"role": "user", "content": "hello"}]}
).encode()
#: bank.toml, made instant and without the demo key's rate limit (the valid client
#: would otherwise meet its own limit, not the attacker's).
EDITS = {
    r"(?m)^ttft_ms = \d+": "ttft_ms = 0",
    r"(?m)^inter_token_ms = \d+": "inter_token_ms = 0",
    r"(?m)^rpm = \d+": "rpm = 0",
    r"(?m)^tpm = \d+": "tpm = 0",
}


def gateway_config(dir_: Path) -> Path:
    text = (ROOT / "configs" / "examples" / "bank.toml").read_text()
    for pattern, new in EDITS.items():
        text, n = re.subn(pattern, new, text)
        assert n, pattern
    path = dir_ / "authflood.toml"
    path.write_text(text)
    return path


@contextlib.contextmanager
def gateway() -> Iterator[int]:
    """The gateway under hypercorn (one worker) on a free port."""
    sys.path.insert(0, str(ROOT))
    from tests.servers import hypercorn_gateway

    with tempfile.TemporaryDirectory() as tmp:
        args = ["--access-logfile", os.devnull]
        with hypercorn_gateway(gateway_config(Path(tmp)), extra_args=args) as (base, _):
            yield int(base.rsplit(":", 1)[1])


#: How long an attacker waits before it connects again after a reset.
BACKOFF_S = float(os.environ.get("AUTHFLOOD_BACKOFF_S", "0.05"))


def source(i: int, base: int = 1) -> str:
    """The ``i``-th attacker address: 127.<base>.x.y, never 127.0.0.1."""
    return f"127.{base}.{(i // 250) % 250}.{i % 250 + 1}"


# --- the attacker (its own process) -----------------------------------------------------


async def _read_response(stream: trio.SocketStream, buf: bytearray) -> tuple[int, bool]:
    """(status, whether the server will close) of one response read from ``stream``."""
    while b"\r\n\r\n" not in buf:
        data = await stream.receive_some(65536)
        if not data:
            raise ConnectionResetError("closed")
        buf += data
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    length = int(headers.get("content-length", "0"))
    body = bytearray(rest)
    while len(body) < length:
        data = await stream.receive_some(65536)
        if not data:
            raise ConnectionResetError("closed")
        body += data
    buf[:] = body[length:]
    return status, headers.get("connection", "").lower() == "close"


async def _attacker(port: int, address: str, end: float, counts: Counter[str]) -> None:
    while trio.current_time() < end:
        counts["connections opened"] += 1
        sock = trio.socket.socket()
        try:
            await sock.bind((address, 0))
            with trio.move_on_at(end):
                await sock.connect(("127.0.0.1", port))
            stream = trio.SocketStream(sock)
        except OSError:
            sock.close()
            counts["connect failed"] += 1
            await trio.sleep(0.1)
            continue
        buf = bytearray()
        try:
            with trio.move_on_at(end):
                while True:
                    secret = secrets.token_urlsafe(24)
                    req = (
                        "GET /v1/models HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                        f"authorization: Bearer aik_demo_{secret}\r\n\r\n"
                    )
                    await stream.send_all(req.encode())
                    status, close = await _read_response(stream, buf)
                    counts[str(status)] += 1
                    if close:
                        counts["closed by server"] += 1
                        break
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, ValueError):
            counts["reset (refused at accept or closed)"] += 1
            await trio.sleep(BACKOFF_S)
        finally:
            await stream.aclose()


async def _attack(port: int, connections: int, seconds: float) -> Counter[str]:
    counts: Counter[str] = Counter()
    end = trio.current_time() + seconds
    async with trio.open_nursery() as nursery:
        for i in range(connections):
            nursery.start_soon(_attacker, port, source(i), end, counts)
            if i % 50 == 49:
                await trio.lowlevel.checkpoint()  # the first ones connect while the rest start
    return counts


def attack_process(port: int, connections: int, seconds: float) -> None:
    counts = trio.run(_attack, port, connections, seconds)
    print(json.dumps(dict(counts)))


# --- the valid client and the probes ------------------------------------------------------


@dataclass
class Valid:
    port: int
    latencies: list[float] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        # One keep-alive connection, as an SDK's pool holds: a fresh connection per
        # request would measure the listen backlog the flood fills, not the gateway.
        conn: http.client.HTTPConnection | None = None
        headers = {"content-type": "application/json", "authorization": f"Bearer {DEMO_KEY}"}
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
                conn.request("POST", "/v1/chat/completions", body=CHAT, headers=headers)
                resp = conn.getresponse()
                resp.read()
                self.statuses[str(resp.status)] += 1
            except (OSError, http.client.HTTPException) as exc:
                self.statuses[type(exc).__name__] += 1
                if conn is not None:
                    conn.close()
                conn = None
            self.latencies.append(time.perf_counter() - t0)
            time.sleep(0.01)
        if conn is not None:
            conn.close()

    @contextlib.contextmanager
    def during(self) -> Iterator[Valid]:
        t = threading.Thread(target=self.run, daemon=True)
        t.start()
        try:
            yield self
        finally:
            self._stop.set()
            t.join(15)

    @property
    def served(self) -> float:
        total = sum(self.statuses.values())
        return self.statuses["200"] / total if total else 0.0

    def pct(self, q: float) -> float:
        lat = sorted(self.latencies)
        return lat[min(len(lat) - 1, int(len(lat) * q))] if lat else float("inf")


def probe(port: int, n: int) -> dict[str, list[float]]:
    """Answer times (s) of wrong keys: ``unknown`` ids and the ``known`` demo id."""
    times: dict[str, list[float]] = {"unknown": [], "known": []}
    for i in range(2 * n):
        kind = "known" if i % 2 else "unknown"
        key_id = "demo" if kind == "known" else f"nobody{i}"
        req = (
            f"GET /v1/models HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n"
            f"authorization: Bearer aik_{key_id}_{secrets.token_urlsafe(24)}\r\n\r\n"
        ).encode()
        with socket.create_connection(
            ("127.0.0.1", port), timeout=30, source_address=(source(i, base=200), 0)
        ) as s:
            t0 = time.perf_counter()
            s.sendall(req)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            times[kind].append(time.perf_counter() - t0)
        assert data.startswith(b"HTTP/1.1 401"), data[:80]
    return times


def settle(port: int, limit_s: float = 120.0) -> float:
    """Seconds until the valid key is answered at once again (the flood's backlog gone)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/models", headers={"authorization": f"Bearer {DEMO_KEY}"}
        )
        t1 = time.perf_counter()
        with contextlib.suppress(OSError):
            urllib.request.urlopen(req, timeout=30).read()
            if time.perf_counter() - t1 < 0.05:
                break
        time.sleep(0.2)
    return time.perf_counter() - t0


def run(connections: int, seconds: float, probes: int) -> dict[str, object]:
    with gateway() as port:
        attacker = subprocess.Popen(
            [sys.executable, "-m", "bench.authflood", "--attack", str(port),
             "--connections", str(connections), "--duration", str(seconds)],
            cwd=ROOT, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        time.sleep(min(1.0, seconds / 4))  # the flood is under way
        with Valid(port).during() as valid:
            while attacker.poll() is None:
                time.sleep(0.05)
        out, _ = attacker.communicate(timeout=30)
        flood = {
            "connections": connections,
            "seconds": seconds,
            "attacker": json.loads(out.strip().splitlines()[-1]),
            "valid_statuses": dict(valid.statuses),
            "valid_served": round(valid.served, 3),
            "valid_p50_ms": round(valid.pct(0.5) * 1000, 1),
            "valid_p99_ms": round(valid.pct(0.99) * 1000, 1),
        }
        print(json.dumps(flood), flush=True)
        flood["settle_s"] = round(settle(port), 1)
        times = probe(port, probes)
    return {
        **flood,
        "probe_unknown_ms": _summary(times["unknown"]),
        "probe_known_ms": _summary(times["known"]),
    }


def _summary(values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values)
    return {
        "median": round(statistics.median(ms), 3),
        "p90": round(ms[min(len(ms) - 1, int(len(ms) * 0.9))], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--connections", type=int, default=1100)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--probes", type=int, default=200)
    ap.add_argument("--attack", type=int, help="(internal) be the attacker against this port")
    args = ap.parse_args()
    if args.attack:
        attack_process(args.attack, args.connections, args.duration)
        return
    result = run(args.connections, args.duration, args.probes)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
