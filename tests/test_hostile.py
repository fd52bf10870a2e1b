"""Hostile clients against the real server (hypercorn binary + the gateway), loopback only.

Every attack is bounded in frames and seconds (bench/hostile.py); during each, a polite
HTTP/1.1 client keeps being served; afterwards the worker is alive and its RSS bounded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events as ev
import pytest
from bench import hostile
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState

from aiserve_trio.security import edge
from aiserve_trio.security.edge import FloodMeter, ResetMeter, control_frames, early_resets

pytestmark = pytest.mark.slow


def test_flood_meter_allows_bursts_then_refuses_floods() -> None:
    m = FloodMeter(now=0.0, burst=100, rate=10.0)
    assert m.spend(0.0, 100)
    assert not m.spend(0.0, 1)
    assert m.spend(1.0, 5)  # refilled 10, was at -1


def test_control_frames_counts_only_remote_control_frames() -> None:
    reset = ev.StreamReset(stream_id=1, error_code=0, remote_reset=True)
    local = ev.StreamReset(stream_id=3, error_code=0, remote_reset=False)
    ping = ev.PingReceived(ping_data=b"12345678")
    data = ev.DataReceived(stream_id=1, data=b"x", flow_controlled_length=1)
    assert control_frames([reset, local, ping, data]) == 2


def test_reset_meter_closes_connections_whose_streams_are_mostly_reset_early() -> None:
    rapid = ResetMeter(min_streams=100, max_ratio=0.5)
    assert rapid.count(100, 100)  # not more than 100 streams yet
    assert not rapid.count(1, 1)  # 101 streams, all reset before an answer
    browser = ResetMeter(min_streams=100, max_ratio=0.5)
    for _ in range(1000):
        assert browser.count(1, 0)  # answered streams
    assert browser.count(0, 500)  # then half of them cancelled early: not more than half
    assert not browser.count(0, 1)


def test_early_resets_counts_resets_before_an_answer() -> None:
    def reset(sid: int, remote: bool = True) -> ev.StreamReset:
        return ev.StreamReset(stream_id=sid, error_code=8, remote_reset=remote)

    events = [
        ev.RequestReceived(stream_id=9, headers=[]),
        ev.StreamEnded(stream_id=9),
        reset(9),  # opened and reset within one read
        ev.RequestReceived(stream_id=11, headers=[]),
        reset(1),  # open, not answered yet
        reset(3),  # answered
        reset(5, remote=False),  # the server's own reset
    ]
    assert early_resets(events, lambda sid: sid == 1) == (2, 2, {9})
    assert early_resets([], lambda sid: True) == (0, 0, set())


# --- the patched H2Protocol, in-process, without sockets ------------------------------


class FakeTasks:
    """hypercorn's task group, counting the ASGI app tasks it is asked to start."""

    def __init__(self) -> None:
        self.apps = 0

    async def spawn_app(self, *args: Any) -> Callable[[Any], Any]:
        self.apps += 1

        async def put(message: Any) -> None:
            pass  # the app never answers: its streams stay unanswered

        return put

    def spawn(self, func: Callable[..., Any], *args: Any) -> None:
        pass  # hypercorn's send task: nothing to send in these tests


async def h2_server() -> tuple[H2Protocol, FakeTasks, bytearray]:
    """hypercorn's H2Protocol with the guard installed, as a TCPServer would drive it."""
    assert edge.install().startswith(("installed", "already installed"))
    tasks = FakeTasks()
    out = bytearray()
    proto: H2Protocol

    async def send(event: Event) -> None:
        if isinstance(event, RawData):
            out.extend(event.data)
        elif isinstance(event, Closed):  # TCPServer closes the socket, then tells it so
            await proto.handle(Closed())

    proto = H2Protocol(
        None,  # type: ignore[arg-type]  # never called: FakeTasks starts no app
        Config(),
        WorkerContext(None),  # the trio one, as in hypercorn's worker
        tasks,  # type: ignore[arg-type]
        ConnectionState({}),
        False,
        ("127.0.0.9", 1),
        ("127.0.0.1", 2),
        send,
    )
    await proto.initiate()
    return proto, tasks, out


def h2_client() -> h2.connection.H2Connection:
    c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    c.initiate_connection()
    return c


def server_said(out: bytearray) -> list[ev.Event]:
    """What a client makes of the server's bytes."""
    c = h2_client()
    return c.receive_data(bytes(out))


HEAD = [(":method", "GET"), (":path", "/healthz"), (":scheme", "http"), (":authority", "x")]


async def test_streams_opened_and_reset_in_one_read_start_no_app_task() -> None:
    proto, tasks, _ = await h2_server()
    acked: list[int] = []
    ack = proto.connection.acknowledge_received_data

    def record(size: int, stream_id: int) -> None:
        acked.append(size)
        ack(size, stream_id)

    proto.connection.acknowledge_received_data = record  # type: ignore[method-assign,assignment]
    c = h2_client()
    for sid in range(1, 41, 2):
        c.send_headers(sid, HEAD)
        c.send_data(sid, b"x" * 100)
        c.reset_stream(sid)
    data = c.data_to_send()
    assert len(data) <= edge.FEED_SLICE  # one slice: each stream opened and reset in it
    await proto.handle(RawData(data=data))
    assert tasks.apps == 0
    # Their bytes were acknowledged all the same: the connection's window stays open.
    assert sum(acked) == 20 * 100
    assert not proto.closed


async def test_a_rapid_reset_connection_is_closed_and_the_rest_of_the_read_dropped() -> None:
    proto, tasks, out = await h2_server()
    c = h2_client()

    def open_60(first: int) -> None:
        for sid in range(first, first + 120, 2):
            c.send_headers(sid, HEAD, end_stream=True)

    def reset_60(first: int) -> None:
        for sid in range(first, first + 120, 2):
            c.reset_stream(sid)

    async def read() -> None:
        await proto.handle(RawData(data=c.data_to_send()))

    open_60(1)  # 60 streams, each in its own app task, unanswered
    await read()
    reset_60(1)  # all 60 reset unanswered: too few streams to judge
    await read()
    open_60(121)  # 120 streams, half reset early: not more than half
    await read()
    assert tasks.apps == 120
    assert not proto.closed

    reset_60(121)  # 120 of 130 streams reset unanswered
    for sid in range(241, 261, 2):
        c.send_headers(sid, HEAD, end_stream=True)
    for i in range(10_000):  # and a long tail in the same read
        c.ping(i.to_bytes(8, "big"))
    await read()
    assert proto.closed
    said = server_said(out)
    goaway = [e for e in said if isinstance(e, ev.ConnectionTerminated)]
    assert [e.error_code for e in goaway] == [h2.errors.ErrorCodes.ENHANCE_YOUR_CALM]
    # The 10 streams opened in the verdict's read started no app task ...
    assert tasks.apps == 120
    # ... and of the 10,000 pings, those after the verdict's slice (a few hundred
    # frames) were never parsed: h2 answers each one it parses.
    pongs = [e for e in said if isinstance(e, ev.PingAckReceived)]
    assert len(pongs) < 500, len(pongs)


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[int, int, Path]]:
    with hostile.gateway() as g:
        yield g


CLOSES = ("connection closed", "GOAWAY", "connection reset")


@pytest.mark.parametrize(
    ("attack", "expect"),
    [
        ("h2 rapid reset (HEADERS + RST_STREAM)", CLOSES),
        ("h2 SETTINGS flood", CLOSES),
        ("h2 PING flood", CLOSES),
        ("h2 PRIORITY flood, 1,500 idle streams", ("GOAWAY ENHANCE_YOUR_CALM",)),
        ("h2 CONTINUATION flood", CLOSES),
        ("h2 oversized header block", ("GOAWAY", "status 431", "RST_STREAM", "connection closed")),
        ("h2 1-byte flow-control window reader", ("bytes taken",)),
        ("h1 slowloris headers", ("closed after",)),
        ("h1 slowloris body", ("answers ['408']",)),
        ("h1 pipelined garbage", ("answers ['200']",)),
        ("h1 smuggling CL + TE", ("answers ['400']",)),
        ("h1 smuggling TE + TE", ("answers ['501']", "answers ['400']")),
    ],
)
def test_attack_is_contained(
    gateway: tuple[int, int, Path], attack: str, expect: tuple[str, ...]
) -> None:
    port, pid, _ = gateway
    row, polite = hostile.run_attack(attack, port, pid)
    print(row)
    assert row.up, f"the worker died during {attack}"
    assert any(e in row.outcome for e in expect), row.outcome
    # The polite client kept being served during the attack.
    assert polite.failures == 0, row.polite
    assert len(polite.latencies) >= 5, row.polite
    assert max(polite.latencies) < 2.0, row.polite
    assert row.rss_after - row.rss_before < 50, row
    # A smuggled second request was never answered.
    if "smuggling" in attack:
        assert row.outcome.count("'") <= 2, row.outcome
