"""Hostile clients against the real server (hypercorn binary + the gateway), loopback only.

Every attack is bounded in frames and seconds (bench/hostile.py); during each, a polite
HTTP/1.1 client keeps being served (during a flood, at least half as often as without
one, p99 under 500 ms); afterwards the worker is alive and its RSS bounded. The guard's
pure parts (meters, penalty box, settings) are tested without sockets, and its patch of
hypercorn in-process, with hypercorn's own protocol objects and no network.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events as ev
import pytest
import trio
from bench import hostile
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypothesis import given
from hypothesis import strategies as st

from aiserve_trio.security import edge
from aiserve_trio.security.edge import (
    EdgeSettings,
    FloodMeter,
    FrameCounter,
    PenaltyBox,
    ResetMeter,
    control_frames,
    early_resets,
    edge_settings,
    peer_key,
)
from aiserve_trio.server.h2 import GatewayH2
from aiserve_trio.server.tcp import GatewayTCPServer
from aiserve_trio.server.worker import Worker

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


def test_penalty_box_refuses_an_address_for_a_growing_time() -> None:
    box = PenaltyBox(first=1.0, longest=8.0, capacity=10)
    assert not box.refuses("10.0.0.1", 0.0)
    assert box.punish("10.0.0.1", 0.0) == 1.0
    assert box.refuses("10.0.0.1", 0.5)
    assert not box.refuses("10.0.0.2", 0.5)  # only the address that misbehaved
    assert not box.refuses("10.0.0.1", 1.0)
    # It reconnects as soon as it may and misbehaves again: 2 s, 4 s, then at most 8 s.
    assert [box.punish("10.0.0.1", t) for t in (1.0, 3.0, 7.0, 15.0)] == [2.0, 4.0, 8.0, 8.0]
    assert box.refuses("10.0.0.1", 22.9)
    assert box.refused == 2
    # Out of trouble for longer than the longest penalty after the last one ended: forgiven.
    assert box.punish("10.0.0.1", 23.0 + 8.1) == 1.0


def test_penalty_box_keeps_at_most_capacity_addresses() -> None:
    box = PenaltyBox(first=10.0, longest=60.0, capacity=3)
    for n in range(5):
        box.punish(f"10.0.0.{n}", float(n))
    assert len(box) == 3
    # The least recently punished went first.
    assert not box.refuses("10.0.0.0", 5.0)
    assert not box.refuses("10.0.0.1", 5.0)
    assert all(box.refuses(f"10.0.0.{n}", 5.0) for n in (2, 3, 4))
    box.punish("10.0.0.2", 6.0)  # punished again: now the most recent
    box.punish("10.0.0.9", 6.0)
    assert box.refuses("10.0.0.2", 7.0)
    assert not box.refuses("10.0.0.3", 7.0)


def test_penalty_box_survives_endless_offences() -> None:
    box = PenaltyBox(first=0.001, longest=60.0, capacity=1)
    penalties = [box.punish("a", float(t)) for t in range(2000)]
    assert penalties[-1] == 60.0


@pytest.mark.parametrize(
    ("host", "key"),
    [
        ("127.0.0.9", "127.0.0.9"),
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:bbbb::7", "2001:db8:1:2::/64"),  # the same host, another address
        ("::ffff:10.1.2.3", "10.1.2.3"),
        ("not an address", "not an address"),
    ],
)
def test_peer_key_is_the_ipv4_address_or_the_ipv6_64(host: str, key: str) -> None:
    assert peer_key(host) == key


class HypercornConfig:
    """Stands for hypercorn's Config: TOML keys it does not know become attributes."""

    def __init__(self, **keys: Any) -> None:
        self.__dict__.update(keys)


def test_edge_settings_read_from_hypercorn_config() -> None:
    assert edge_settings(HypercornConfig()) == (EdgeSettings(), [])
    settings, problems = edge_settings(
        HypercornConfig(
            aiserve_penalty_first_s=0,
            aiserve_penalty_max_s=30,
            aiserve_penalty_peers=100,
            aiserve_h2_reset_min_streams=500,
            aiserve_h2_reset_max_ratio=0.75,
            keep_alive_timeout=5,  # hypercorn's own
        )
    )
    assert problems == []
    assert settings == EdgeSettings(0.0, 30.0, 100, 500, 0.75)


def test_the_shipped_hypercorn_config_reaches_the_guard() -> None:
    # hypercorn keeps the keys it does not know (from_mapping sets them all).
    shipped = Config.from_toml(Path(__file__).parent.parent / "configs" / "hypercorn.toml")
    assert edge_settings(shipped) == (EdgeSettings(), [])
    assert getattr(shipped, "aiserve_penalty_first_s") == 1.0  # noqa: B009  # not a Config field


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("aiserve_penalty_first_s", -1),
        ("aiserve_penalty_first_s", "1s"),
        ("aiserve_penalty_first_s", True),
        ("aiserve_penalty_max_s", 0),
        ("aiserve_penalty_peers", 1.5),
        ("aiserve_penalty_peers", 0),
        ("aiserve_h2_reset_min_streams", 0),
        ("aiserve_h2_reset_max_ratio", 1.5),
        ("aiserve_h2_reset_max_ratio", 0),
    ],
)
def test_a_bad_edge_setting_is_named_and_left_at_its_default(key: str, value: Any) -> None:
    settings, problems = edge_settings(HypercornConfig(**{key: value}))
    assert settings == EdgeSettings()
    assert len(problems) == 1
    assert problems[0].startswith(f"{key} = {value!r}: must be")


def test_the_longest_penalty_is_at_least_the_first() -> None:
    settings, problems = edge_settings(
        HypercornConfig(aiserve_penalty_first_s=90, aiserve_penalty_max_s=60)
    )
    assert settings.penalty_max_s == 90.0
    assert len(problems) == 1
    assert "aiserve_penalty_max_s" in problems[0]


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


async def h2_server(worker: Worker | None = None) -> tuple[GatewayH2, FakeTasks, bytearray]:
    """The seam's HTTP/2 protocol (hypercorn's, guarded), as a TCPServer would drive it,
    with ``worker``'s settings and penalty box (default: a worker of its own)."""
    tasks = FakeTasks()
    out = bytearray()
    proto: GatewayH2

    async def send(event: Event) -> None:
        if isinstance(event, RawData):
            out.extend(event.data)
        elif isinstance(event, Closed):  # TCPServer closes the socket, then tells it so
            await proto.handle(Closed())

    proto = GatewayH2(
        None,  # never called: FakeTasks starts no app
        Config(),
        WorkerContext(None),  # the trio one, as in hypercorn's worker
        tasks,
        ConnectionState({}),
        False,
        ("127.0.0.9", 1),
        ("127.0.0.1", 2),
        send,
        worker=worker if worker is not None else Worker(),
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
    for sid in range(1, 25, 2):
        c.send_headers(sid, HEAD)
        c.send_data(sid, b"x" * 100)
        c.reset_stream(sid)
    data = c.data_to_send()
    assert len(data) <= edge.FEED_SLICE  # one slice: each stream opened and reset in it
    await proto.handle(RawData(data=data))
    assert tasks.apps == 0
    # Their bytes were acknowledged all the same: the connection's window stays open.
    assert sum(acked) == 12 * 100
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


def frame_bytes(kinds: list[int]) -> bytes:
    """The client preface and one frame of each ``kinds`` length (type 0xFA, stream 0)."""
    out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    for length in kinds:
        out += length.to_bytes(3, "big") + b"\xfa\x00\x00\x00\x00\x00" + b"p" * length
    return out


@given(
    lengths=st.lists(st.integers(0, 300), max_size=40),
    cuts=st.lists(st.integers(0, 20_000), max_size=12),
)
def test_the_frame_counter_counts_every_frame_however_the_bytes_are_cut(
    lengths: list[int], cuts: list[int]
) -> None:
    data = frame_bytes(lengths)
    counter = FrameCounter()
    at = 0
    total = 0
    for cut in [*sorted({c % (len(data) + 1) for c in cuts}), len(data)]:
        total += counter.feed(data[at:cut])
        at = cut
    assert total == len(lengths)


def server_events(data: bytes) -> tuple[list[ev.Event], int]:
    """What h2 (as a server) makes of a client's ``data`` after its set-up, and how many
    frames that was."""
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    server.initiate_connection()
    c = h2_client()
    c.send_headers(1, HEAD)  # stream 1 open, for DATA
    server.receive_data(c.data_to_send())
    return server.receive_data(data), FrameCounter().feed(b"\0" * 24 + data)


def test_idle_frames_counts_frames_that_get_no_answer() -> None:
    window_update = b"\x00\x00\x04\x08\x00\x00\x00\x00\x00\x00\x00\x00\x01"
    ping_ack = b"\x00\x00\x08\x06\x01\x00\x00\x00\x00" + b"\x00" * 8
    unknown = b"\x00\x00\x00\xfa\x00\x00\x00\x00\x00"
    empty_data = b"\x00\x00\x00\x00\x00\x00\x00\x00\x01"
    ping = b"\x00\x00\x08\x06\x00\x00\x00\x00\x00" + b"\x00" * 8
    for frame in (window_update, ping_ack, unknown, empty_data):
        events, frames = server_events(frame * 3)
        assert frames == 3
        assert edge.idle_frames(events, frames) == 3, events
    events, frames = server_events(ping * 3)  # answered: the control meter's, not this one's
    assert edge.idle_frames(events, frames) == 0
    # Frames that made no event at all are counted as the frames left over.
    assert edge.idle_frames([], 2) == 2


@pytest.mark.parametrize(
    ("name", "frame"),
    [
        ("WINDOW_UPDATE", b"\x00\x00\x04\x08\x00\x00\x00\x00\x00\x00\x00\x00\x01"),
        ("unknown type", b"\x00\x00\x00\xfa\x00\x00\x00\x00\x00"),
        ("PING ACK", b"\x00\x00\x08\x06\x01\x00\x00\x00\x00" + b"\x00" * 8),
    ],
)
async def test_a_flood_of_frames_that_need_no_answer_is_closed(name: str, frame: bytes) -> None:
    proto, _, out = await h2_server()
    c = h2_client()
    await proto.handle(RawData(data=c.data_to_send()))
    sent = 0
    while not proto.closed and sent < 100_000:
        await proto.handle(RawData(data=frame * 1000))
        sent += 1000
    assert proto.closed, name
    assert sent <= edge.IDLE_BURST + 1000  # caught within the burst
    goaway = [e for e in server_said(out) if isinstance(e, ev.ConnectionTerminated)]
    assert [e.error_code for e in goaway] == [h2.errors.ErrorCodes.ENHANCE_YOUR_CALM]


class Turns:
    """Another task on the loop, counting the turns it gets."""

    def __init__(self) -> None:
        self.n = 0

    async def run(self) -> None:
        while True:
            await trio.lowlevel.checkpoint()
            self.n += 1


async def test_the_http2_protocol_lets_others_run_between_slices_of_one_read() -> None:
    proto, _, _ = await h2_server()
    proto._idle = FloodMeter(0.0, 10**9, 1e9)  # the meters out of the way: fairness alone
    c = h2_client()
    await proto.handle(RawData(data=c.data_to_send()))
    other = Turns()
    read = b"\x00\x00\x00\xfa\x00\x00\x00\x00\x00" * 7000  # ~64 KiB of unknown frames
    async with trio.open_nursery() as nursery:
        nursery.start_soon(other.run)
        await trio.lowlevel.checkpoint()  # it has started
        before = other.n
        await proto.handle(RawData(data=read))
        nursery.cancel_scope.cancel()
    assert not proto.closed
    # The other task ran between every two slices (and not once otherwise: no other yield).
    assert other.n - before >= len(read) // edge.FEED_SLICE - 1


async def test_the_read_loop_yields_to_others_while_a_client_keeps_it_busy() -> None:
    from aiserve_trio.server import directio

    a, b = trio.socket.socketpair()
    handled: list[int] = []

    class Busy:
        async def handle(self, event: Any) -> None:  # never yields, as a frame flood
            handled.append(len(getattr(event, "data", b"")))

    class Server:
        config = Config()
        protocol = Busy()

    other = Turns()

    async def client() -> None:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        for _ in range(50):  # all of it there before the loop reads: it never has to wait
            await a.send(b"x")
            await a.send(b"y" * 3000)
        a.close()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other.run)
        await client()
        before = other.n
        await directio.read_loop(Server(), b, Closed, RawData)  # all queued: no wait needed
        nursery.cancel_scope.cancel()
    b.close()
    received = sum(handled)
    assert received == 50 * 3001
    big_reads = sum(1 for n in handled if n >= directio.YIELD_BYTES)
    assert big_reads >= 3
    # Each read of a slice or more was followed by a yield; Trio runs the runnable tasks
    # of a batch in random order, so the other task's turns may trail the yields by one.
    assert other.n - before >= big_reads - 1


@pytest.fixture
def worker() -> Worker:
    """A worker's seam state: the guard's default settings, a penalty box of 16 addresses."""
    return Worker(HypercornConfig(aiserve_penalty_peers=16))


@pytest.fixture
def box(worker: Worker) -> PenaltyBox:
    """``worker``'s penalty box."""
    assert worker.box is not None
    return worker.box


def test_the_worker_reads_its_settings_from_hypercorns_config_and_may_go_without_a_box(
    caplog: pytest.LogCaptureFixture,
) -> None:
    off = Worker(HypercornConfig(aiserve_penalty_first_s=0))
    assert off.settings == EdgeSettings(0.0)
    assert off.box is None  # off: behind a proxy, every client has its address
    assert off.strike("127.0.0.9") == 0.0
    on = Worker(HypercornConfig(aiserve_penalty_max_s=30, aiserve_penalty_peers=7))
    assert on.box is not None
    assert (on.box.first, on.box.longest, on.box.capacity) == (1.0, 30.0, 7)
    assert Worker().settings == EdgeSettings()  # outside hypercorn: the defaults
    # What is wrong in the config is said once, as the worker is made.
    with caplog.at_level(logging.ERROR):
        assert Worker(HypercornConfig(aiserve_penalty_peers=0)).settings == EdgeSettings()
    assert [r.getMessage() for r in caplog.records] == [
        "hypercorn config: aiserve_penalty_peers = 0: must be an integer >= 1; using the default"
    ]


async def test_the_verdict_puts_the_address_in_the_penalty_box(
    worker: Worker, box: PenaltyBox
) -> None:
    proto, _, _ = await h2_server(worker)
    c = h2_client()
    for sid in range(1, 203, 2):
        c.send_headers(sid, HEAD, end_stream=True)
        c.reset_stream(sid)
    await proto.handle(RawData(data=c.data_to_send()))
    assert proto.closed
    assert box.refuses("127.0.0.9", trio.current_time())  # h2_server's client
    assert not box.refuses("127.0.0.1", trio.current_time())


async def test_a_client_that_breaks_the_protocol_goes_into_the_penalty_box(
    worker: Worker, box: PenaltyBox
) -> None:
    proto, _, out = await h2_server(worker)
    c = h2_client()
    await proto.handle(RawData(data=c.data_to_send()))
    await proto.handle(RawData(data=b"\x00\x00\x01\x00\x00\x00\x00\x00\x00x"))  # DATA, stream 0
    assert proto.closed
    goaway = [e for e in server_said(out) if isinstance(e, ev.ConnectionTerminated)]
    assert [e.error_code for e in goaway] == [h2.errors.ErrorCodes.PROTOCOL_ERROR]
    assert box.refuses("127.0.0.9", trio.current_time())


async def test_the_rapid_reset_rule_is_configurable() -> None:
    proto, _, _ = await h2_server(Worker(HypercornConfig(aiserve_h2_reset_min_streams=1000)))
    c = h2_client()
    for sid in range(1, 203, 2):  # 101 streams reset early: over the default rule only
        c.send_headers(sid, HEAD, end_stream=True)
        c.reset_stream(sid)
    await proto.handle(RawData(data=c.data_to_send()))
    assert not proto.closed


class FakeSocket:
    def __init__(self, host: str) -> None:
        self.host = host
        self.family = socket.AF_UNIX if host.startswith("/") else socket.AF_INET
        self.options: list[tuple[int, int, bytes]] = []

    def getpeername(self) -> tuple[str, int] | str:
        if self.host == "gone":
            raise OSError(107, "Transport endpoint is not connected")
        return "" if self.family == socket.AF_UNIX else (self.host, 50_000)

    def setsockopt(self, level: int, option: int, value: bytes) -> None:
        self.options.append((level, option, value))


class FakeTLS:
    """A TLS stream over a TCP stream, whose handshake hypercorn's TCPServer starts with."""

    def __init__(self, host: str) -> None:
        self.transport_stream = self
        self.socket = FakeSocket(host)
        self.handshakes = 0
        self.closed = False

    async def do_handshake(self) -> None:
        self.handshakes += 1
        raise trio.BrokenResourceError  # hypercorn gives up on the connection

    async def aclose(self) -> None:
        self.closed = True


async def test_an_address_in_the_penalty_box_is_refused_before_tls(
    worker: Worker, box: PenaltyBox
) -> None:
    box.punish("127.0.0.9", trio.current_time())

    async def connect(host: str) -> FakeTLS:
        stream = FakeTLS(host)
        server = GatewayTCPServer(None, Config(), WorkerContext(None), {}, stream, worker=worker)
        await server.run()
        return stream

    refused = await connect("127.0.0.9")
    assert refused.handshakes == 0
    assert refused.closed
    # Closed with a reset (SO_LINGER 0): nothing kept in TIME_WAIT for it.
    assert refused.socket.options == [
        (socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    ]
    served = await connect("127.0.0.1")
    assert served.handshakes == 1
    assert served.socket.options == []
    # A Unix socket has no address to hold against it; a peer already gone is
    # hypercorn's to deal with, as without the guard.
    for peer in ("/run/aiserve.sock", "gone"):
        assert (await connect(peer)).handshakes == 1


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[int, int, Path]]:
    with hostile.gateway() as g:
        yield g


@pytest.fixture(scope="module")
def baseline(gateway: tuple[int, int, Path]) -> hostile.Polite:
    """The polite client alone, measured as during an attack (same server, same run)."""
    port, pid, _ = gateway
    return hostile.run_attack(hostile.BASELINE, port, pid)[1]


CLOSES = ("connection closed", "GOAWAY", "connection reset")
#: Whether this run has the hypercorn seam (``.ci/run`` runs this file again without it).
SEAM = os.environ.get("AISERVE_HYPERCORN_PATCHES", "").strip().lower() != "off"
#: Floods that reconnect whenever they are closed: the penalty box must refuse them.
RECONNECTING = (
    "h2 rapid reset (HEADERS + RST_STREAM)",
    "h2 SETTINGS flood",
    "h2 PING flood",
    "h2 WINDOW_UPDATE flood",
    "h2 unknown frame type flood",
    "h2 PING ACK flood",
)
#: Floods during which the polite client must keep at least half its no-attack
#: throughput, with a p99 under 500 ms (issue 14, item 2; issue 25).
TARGETED = (
    *RECONNECTING,
    "h2 PRIORITY flood, 1,500 idle streams",
    "h2 CONTINUATION flood",
    "h2 empty DATA flood",
    "h1 pipelined requests, answers never read",
    "h1 one-byte segments",
)
#: What hypercorn as shipped cannot survive or contain: every HTTP/2 flood but the
#: CONTINUATION one starves the polite client (0.4-0.8 answers/s against ~38), and a
#: PRIORITY or empty-DATA flood ends its worker with an exception
#: (bench/results/2026-12-01/seam/hostile-after-off.md). The defence is the seam's edge
#: guard, so with the seam off these are not run.
NEEDS_THE_GUARD = (
    "h2 rapid reset (HEADERS + RST_STREAM)",
    "h2 SETTINGS flood",
    "h2 PING flood",
    "h2 PRIORITY flood, 1,500 idle streams",
    "h2 WINDOW_UPDATE flood",
    "h2 unknown frame type flood",
    "h2 PING ACK flood",
    "h2 empty DATA flood",
)
ATTACKS = [
    ("h2 rapid reset (HEADERS + RST_STREAM)", CLOSES),
    ("h2 SETTINGS flood", CLOSES),
    ("h2 PING flood", CLOSES),
    ("h2 PRIORITY flood, 1,500 idle streams", ("GOAWAY ENHANCE_YOUR_CALM",)),
    ("h2 CONTINUATION flood", CLOSES),
    ("h2 WINDOW_UPDATE flood", CLOSES),
    ("h2 unknown frame type flood", CLOSES),
    ("h2 PING ACK flood", CLOSES),
    ("h2 empty DATA flood", CLOSES),
    ("h1 pipelined requests, answers never read", ("requests pipelined",)),
    ("h1 one-byte segments", ("one-byte segments",)),
    ("h2 oversized header block", ("GOAWAY", "status 431", "RST_STREAM", "connection closed")),
    ("h2 1-byte flow-control window reader", ("bytes taken",)),
    ("h1 slowloris headers", ("closed after",)),
    ("h1 slowloris body", ("answers ['408']",)),
    ("h1 pipelined garbage", ("answers ['200']",)),
    ("h1 smuggling CL + TE", ("answers ['400']",)),
    ("h1 smuggling TE + TE", ("answers ['501']", "answers ['400']")),
]


def meets_target(polite: hostile.Polite, baseline: hostile.Polite) -> bool:
    return polite.rate >= 0.5 * baseline.rate and polite.p99 < 0.5


@pytest.mark.parametrize(
    ("attack", "expect"),
    [a for a in ATTACKS if SEAM or a[0] not in NEEDS_THE_GUARD],
)
def test_attack_is_contained(
    gateway: tuple[int, int, Path],
    baseline: hostile.Polite,
    attack: str,
    expect: tuple[str, ...],
) -> None:
    port, pid, _ = gateway
    row, polite = hostile.run_attack(attack, port, pid)
    print(row)
    if attack in TARGETED and not meets_target(polite, baseline):
        # Other test runs share this machine's two cores: one slow run is measured
        # once more, its baseline again right before it. A starving server misses
        # the target both times.
        first = f"{row.polite} against {baseline.summary()} (load {row.load:.2f})"
        baseline = hostile.run_attack(hostile.BASELINE, port, pid)[1]
        row, polite = hostile.run_attack(attack, port, pid)
        print("again:", row)
    else:
        first = "-"
    assert row.up, f"the worker died during {attack}"
    if SEAM or not attack.startswith("h2 "):
        # Without the guard hypercorn closes HTTP/2 floods its own way, or not at all:
        # there only the polite client counts.
        assert any(e in row.outcome for e in expect), row.outcome
    # The polite client kept being served during the attack.
    assert polite.failures == 0, row.polite
    assert len(polite.latencies) >= 5, row.polite
    assert max(polite.latencies) < 2.0, row.polite
    assert row.rss_after - row.rss_before < 50, row
    if attack in TARGETED:
        figures = (
            f"{row.polite} against {baseline.summary()} (load {row.load:.2f}); first try: {first}"
        )
        assert polite.rate >= 0.5 * baseline.rate, figures
        assert polite.p99 < 0.5, figures
    if attack in RECONNECTING and SEAM:
        # The first connection was condemned, and the attacker's reconnects were
        # refused at accept while its address sat in the penalty box.
        assert "GOAWAY ENHANCE_YOUR_CALM" in row.outcome, row.outcome
        assert "refused at accept" in row.outcome, row.outcome
    # A smuggled second request was never answered.
    if "smuggling" in attack:
        assert row.outcome.count("'") <= 2, row.outcome
