"""Session bus cost per chat request: Redis round trips, and latency of redis vs memory.

Runs the gateway in-process (the tests' ASGI client, zero-delay mock model, real
time) against a private ``redis-server`` on a free loopback port, sending
sequential non-streaming chat requests that all carry ``X-Session-Id`` (half of
them with ``metadata``, so ``set_vars`` runs too). Round trips are counted by
wrapping the bus's methods (each is one round trip by design) and checked against
Redis's own ``INFO commandstats``.

    .venv/bin/python -m bench.sessions --requests 500
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.asgi_client import Client, chat_body  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402
from tests.test_sessions_http import build, running  # noqa: E402


def commandstats(server: RedisServer) -> dict[str, int]:
    import socket

    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"INFO commandstats\r\n")
        data = b""
        while not data.endswith(b"\r\n\r\n") and b"cmdstat" not in data[-200:]:
            chunk = s.recv(65536)
            data += chunk
            if len(chunk) < 65536:
                break
    out = {}
    for line in data.decode().splitlines():
        if line.startswith("cmdstat_"):
            name, _, rest = line.partition(":")
            out[name[8:]] = int(rest.split(",")[0].split("=")[1])
    return out


async def run(backend: str, url: str, n: int) -> dict[str, Any]:
    app = build(backend, url)
    calls = {"load": 0, "append": 0, "set_vars": 0}
    bus_ms: dict[str, float] = {}
    bus: Any = app.bus
    for op in calls:
        inner = getattr(bus, op)

        def wrap(inner: Any = inner, op: str = op) -> Any:
            async def counted(*a: Any, **k: Any) -> Any:
                calls[op] += 1
                t0 = trio.current_time()
                try:
                    return await inner(*a, **k)
                finally:
                    bus_ms[op] = bus_ms.get(op, 0.0) + (trio.current_time() - t0) * 1000

            return counted

        setattr(bus, op, wrap())
    times = []
    async with running(app):
        client = Client(app)
        for i in range(n + 50):
            body = chat_body("mortgage please")
            if i % 2:
                body["metadata"] = {"monthly_income": str(i)}
            sid = f"bench:{i % 50}"
            start = trio.current_time()
            r = await client.chat(body, {"x-session-id": sid, "x-channel": "app"})
            if r.status != 200:
                raise RuntimeError(r.body)
            if i >= 50:  # first 50: warm-up (one per session)
                times.append((trio.current_time() - start) * 1000)
            if i == 49:
                calls.update(dict.fromkeys(calls, 0))
                bus_ms.clear()
    times.sort()
    return {
        "backend": backend,
        "requests": n,
        "mean_ms": statistics.fmean(times),
        "p50_ms": times[len(times) // 2],
        "p99_ms": times[int(len(times) * 0.99) - 1],
        "round_trips_per_request": sum(calls.values()) / n,
        "calls": calls,
        "bus_ms_per_request": {k: round(v / n, 3) for k, v in bus_ms.items()},
    }


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=500)
    args = ap.parse_args()
    server = RedisServer()
    server.start()
    try:
        mem = await run("memory", "", args.requests)
        before = commandstats(server)
        red = await run("redis", server.url, args.requests)
        after = commandstats(server)
    finally:
        server.stop()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    delta = {k: v for k, v in delta.items() if v and k != "info"}
    for r in (mem, red):
        print(
            f"{r['backend']:7s} n={r['requests']} mean {r['mean_ms']:.3f} ms  "
            f"p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms  "
            f"bus round trips/request {r['round_trips_per_request']:.2f} {r['calls']} "
            f"bus time/request (ms) {r['bus_ms_per_request']}"
        )
    print(f"added by redis: mean {red['mean_ms'] - mem['mean_ms']:+.3f} ms, "
          f"p50 {red['p50_ms'] - mem['p50_ms']:+.3f} ms")
    print("redis commands during the redis run (incl. warm-up):", delta)


if __name__ == "__main__":
    trio.run(main)
