"""What a fairness checkpoint costs, and how long the server works on one slice of
HTTP/2 frames of each type without one: the numbers behind ``edge.FEED_SLICE`` and
``directio.YIELD_BYTES`` / ``YIELD_READS`` (``docs/hypercorn.md``).

    .venv/bin/python -m bench.fairness [--repeat 5]

- a checkpoint (``trio.lowlevel.checkpoint()``), with no other task and with 200
  tasks asleep on the loop;
- one slice (``edge.FEED_SLICE``) and one full read (64 KiB) of bytes made of one frame type, handed to the
  seam's HTTP/2 protocol (``GatewayH2``) with its meters out of the way, so what is
  timed is hypercorn's and h2's work on frames a flood is made of;
- one direct read of a 1-byte segment (``os.read`` on a socket, the syscall alone).

Each figure is the best of ``--repeat`` runs; run it pinned (``taskset -c 0``) on a
quiet CPU.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import h2.config
import h2.connection
import trio
from hypercorn.config import Config
from hypercorn.events import Event, RawData
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState

from aiserve_trio.security.edge import FloodMeter, ResetMeter
from aiserve_trio.server.h2 import GatewayH2
from aiserve_trio.server.worker import Worker

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEAD = [(":method", "POST"), (":path", "/v1/x"), (":scheme", "http"), (":authority", "x")]


class _Tasks:
    async def spawn_app(self, *args: Any) -> Callable[[Any], Any]:
        async def put(message: Any) -> None:
            pass

        return put

    def spawn(self, func: Callable[..., Any], *args: Any) -> None:
        pass


async def _protocol() -> GatewayH2:
    async def send(event: Event) -> None:
        pass

    proto = GatewayH2(
        None, Config(), WorkerContext(None), _Tasks(), ConnectionState({}), False,
        ("127.0.0.2", 1), ("127.0.0.1", 2), send, worker=Worker(),
    )  # fmt: skip
    await proto.initiate()
    now = trio.current_time()
    proto._control = FloodMeter(now, 10**12, 1e12)  # timed: the work, not the verdict
    proto._idle = FloodMeter(now, 10**12, 1e12)
    proto._resets = ResetMeter(10**12, 1.0)
    return proto


def _frames(kind: str, size: int) -> bytes:
    """``size`` bytes (about) of ``kind`` frames, as a client sends them after its preface."""
    c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    c.initiate_connection()
    c.send_headers(1, HEAD)  # one open stream, for the frames that need one
    c.data_to_send()
    out = bytearray()
    i = 0
    while len(out) < size:
        if kind == "PING":
            c.ping(i.to_bytes(8, "big"))
        elif kind == "SETTINGS":
            c.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 100 + i % 7})
        elif kind == "PRIORITY":
            c.prioritize(1, weight=1 + i % 200)
        elif kind == "WINDOW_UPDATE":
            c.increment_flow_control_window(1)
        elif kind == "empty DATA":
            c.send_data(1, b"")
        elif kind == "rapid reset":
            sid = c.get_next_available_stream_id()
            c.send_headers(sid, HEAD, end_stream=True)
            c.reset_stream(sid)
        elif kind == "unknown type":
            out += b"\x00\x00\x00\xfa\x00\x00\x00\x00\x00"
        elif kind == "PING ACK":
            out += b"\x00\x00\x08\x06\x01\x00\x00\x00\x00" + i.to_bytes(8, "big")
        out += c.data_to_send()
        i += 1
    return bytes(out[:size])


KINDS = (
    "PING", "SETTINGS", "PRIORITY", "WINDOW_UPDATE", "empty DATA", "rapid reset",
    "unknown type", "PING ACK",
)  # fmt: skip


async def slice_ms(kind: str, size: int, repeat: int) -> float:
    """The best time, in ms, the protocol spends on ``size`` bytes of ``kind`` frames fed
    in one piece of at most ``size`` bytes (no checkpoint inside: ``FEED_SLICE`` raised)."""
    from aiserve_trio.security import edge

    data = _frames(kind, size)
    best = float("inf")
    saved = edge.FEED_SLICE
    edge.FEED_SLICE = size  # one slice: the work between two checkpoints
    try:
        for _ in range(repeat):
            proto = await _protocol()
            c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            c.initiate_connection()
            c.send_headers(1, HEAD)
            await proto.handle(RawData(data=c.data_to_send()))
            t0 = time.perf_counter()
            await proto.handle(RawData(data=data))
            best = min(best, time.perf_counter() - t0)
    finally:
        edge.FEED_SLICE = saved
    return best * 1e3


async def checkpoint_us(sleepers: int, n: int = 20_000, repeat: int = 5) -> float:
    best = float("inf")
    async with trio.open_nursery() as nursery:
        for _ in range(sleepers):
            nursery.start_soon(trio.sleep_forever)
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(repeat):
            t0 = time.perf_counter()
            for _ in range(n):
                await trio.lowlevel.checkpoint()
            best = min(best, (time.perf_counter() - t0) / n)
        nursery.cancel_scope.cancel()
    return best * 1e6


def one_byte_read_us(n: int = 20_000) -> float:
    a, b = socket.socketpair()
    b.setblocking(False)
    try:
        total = 0.0
        for _ in range(n):
            a.send(b"x")
            t0 = time.perf_counter()
            os.read(b.fileno(), 65536)
            total += time.perf_counter() - t0
        return total / n * 1e6
    finally:
        a.close()
        b.close()


async def main_async(repeat: int) -> None:
    import trio.testing  # noqa: F401 - wait_all_tasks_blocked

    print("| piece | cost |\n|---|---|")
    for sleepers in (0, 200):
        us = await checkpoint_us(sleepers, repeat=repeat)
        print(f"| a checkpoint, {sleepers} other tasks asleep | {us:.2f} µs |")
    print(f"| a direct read of a 1-byte segment (os.read) | {one_byte_read_us():.2f} µs |")
    from aiserve_trio.security.edge import FEED_SLICE

    print(f"\n| frames | {FEED_SLICE} B (one slice) | 64 KiB (one read, no slicing) |\n|---|---|---|")
    for kind in KINDS:
        small = await slice_ms(kind, FEED_SLICE, repeat)
        big = await slice_ms(kind, 65536, max(1, repeat // 2))
        print(f"| {kind} | {small:.2f} ms | {big:.1f} ms |")


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fairness", description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    trio.run(main_async, args.repeat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
