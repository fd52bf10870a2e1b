"""The lean HTTP/2 upstream client (``adapters/h2client.py``) through ``H2Transport``.

Against a small HTTP/2 server of the test's own (Trio + ``h2``'s server side on a loopback
socket) that can answer in many DATA frames, reset a stream, go away, stop reading, never
answer, close mid-stream and allow only two streams; and against a real ``aiserve-sim``
over h2c and over TLS (ALPN ``h2``). Real sockets, so the timeouts are short real ones.
"""

from __future__ import annotations

import contextlib
import gzip
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import hyperframe.frame
import pytest
import trio
import trustme

from aiserve_trio.adapters import h1, h2client
from aiserve_trio.adapters.base import Delta, InferenceRequest, Message
from aiserve_trio.adapters.openai import OpenAIAdapter
from aiserve_trio.adapters.settings import OpenAIAdapterConfig
from aiserve_trio.adapters.tls import TLSSettings
from aiserve_trio.adapters.transport import H2Transport, Httpx2Transport, open_transport
from aiserve_trio.core.errors import (
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamTLSError,
)
from aiserve_trio.sim.model import token_text

from .sim_process import run_sim

Headers = list[tuple[bytes, bytes]]


class Conn:
    """One server-side HTTP/2 connection of :class:`Server`."""

    def __init__(self, server: Server, stream: trio.abc.Stream) -> None:
        self.server = server
        self.stream = stream
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding=None)
        )
        self.h2.local_settings = h2.settings.Settings(
            client=False,
            initial_values={h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: server.max_streams},
        )
        self.lock = trio.Lock()
        self.window = trio.Event()

    async def flush(self) -> None:
        async with self.lock:
            data = self.h2.data_to_send()
            if data:
                await self.stream.send_all(data)

    async def respond(self, sid: int, status: int = 200, headers: Headers | None = None) -> None:
        self.h2.send_headers(sid, [(b":status", b"%d" % status), *(headers or [])])
        await self.flush()

    async def data(self, sid: int, data: bytes, *, end: bool = False) -> None:
        """``data`` on stream ``sid`` as the client's window lets it go."""
        view = memoryview(data)
        while True:
            room = min(self.h2.local_flow_control_window(sid), self.h2.max_outbound_frame_size)
            n = min(room, len(view))
            if n or not view:
                self.h2.send_data(sid, view[:n].tobytes(), end_stream=end and n == len(view))
                await self.flush()
                view = view[n:]
                if not view:
                    return
            else:
                self.window = trio.Event()
                await self.window.wait()

    async def reset(self, sid: int, code: int) -> None:
        self.h2.reset_stream(sid, code)
        await self.flush()

    async def goaway(self, last: int) -> None:
        """GOAWAY, and the streams up to ``last`` go on (h2's own close would end them)."""
        frame = hyperframe.frame.GoAwayFrame(0)
        frame.last_stream_id = last
        async with self.lock:
            await self.stream.send_all(self.h2.data_to_send() + frame.serialize())

    async def run(self) -> None:
        server = self.server
        await trio.sleep(server.settings_delay)
        self.h2.initiate_connection()
        await self.flush()
        heads: dict[int, Headers] = {}
        bodies: dict[int, bytearray] = {}
        async with trio.open_nursery() as nursery:
            while True:
                try:
                    data = await self.stream.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    break
                if not data:
                    break
                for ev in self.h2.receive_data(data):
                    if isinstance(ev, h2.events.RequestReceived):
                        assert ev.stream_id is not None
                        heads[ev.stream_id] = list(ev.headers or [])
                        bodies[ev.stream_id] = bytearray()
                        server.requests.append(heads[ev.stream_id])
                    elif isinstance(ev, h2.events.DataReceived):
                        assert ev.stream_id is not None
                        assert ev.data is not None
                        bodies[ev.stream_id] += ev.data
                        if server.read_bodies:
                            self.h2.acknowledge_received_data(
                                ev.flow_controlled_length or 0, ev.stream_id
                            )
                    elif isinstance(ev, h2.events.StreamEnded):
                        sid = ev.stream_id
                        assert sid is not None
                        nursery.start_soon(server.answer, self, sid, heads[sid], bytes(bodies[sid]))
                    elif isinstance(ev, h2.events.StreamReset):
                        assert ev.stream_id is not None
                        server.resets.append((ev.stream_id, ev.error_code or 0))
                    elif isinstance(ev, h2.events.WindowUpdated):
                        self.window.set()
                await self.flush()
            nursery.cancel_scope.cancel()


Answer = Callable[[Conn, int, Headers, bytes], Awaitable[None]]


class Server:
    def __init__(
        self,
        answer: Answer,
        *,
        max_streams: int = 1000,
        read_bodies: bool = True,
        settings_delay: float = 0.0,
    ):
        self.answer = answer
        self.settings_delay = settings_delay
        self.max_streams = max_streams
        self.read_bodies = read_bodies
        self.connections = 0
        self.requests: list[Headers] = []
        self.resets: list[tuple[int, int]] = []
        self.port = 0

    async def handle(self, stream: trio.abc.Stream) -> None:
        self.connections += 1
        try:
            await Conn(self, stream).run()
        except* (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # a client that went away ends only its connection


@asynccontextmanager
async def serving(answer: Answer, **kw: float | bool) -> AsyncIterator[Server]:
    server = Server(answer, **kw)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1"))
        server.port = listeners[0].socket.getsockname()[1]
        yield server
        nursery.cancel_scope.cancel()


def transport(
    server: Server, max_connections: int = 1000, per_connection: int = 100
) -> H2Transport:
    return H2Transport(
        "up",
        f"http://127.0.0.1:{server.port}/v1",
        [(b"user-agent", b"fixed"), (b"accept", b"*/*"), (b"connection", b"keep-alive")],
        max_connections=max_connections,
        connect_timeout=1.0,
        per_connection=per_connection,
    )


async def fetch(t: H2Transport, body: bytes = b"{}", within: float = 2.0) -> tuple[int, bytes]:
    deadline = trio.current_time() + within
    async with t.stream("POST", "/chat", [(b"accept", b"text/event-stream")], body, deadline) as r:
        out = b"".join([part async for part in r])
        return r.status, out


def frames(n: int) -> list[bytes]:
    return [b"%05d," % i for i in range(n)]


async def in_frames(conn: Conn, sid: int, _: Headers, __: bytes) -> None:
    await conn.respond(sid, headers=[(b"content-type", b"text/event-stream")])
    for part in frames(500):
        await conn.data(sid, part)
    await conn.data(sid, b"", end=True)


async def test_a_reply_in_many_frames_arrives_whole_and_in_order() -> None:
    async with serving(in_frames) as server:
        t = transport(server)
        assert await fetch(t) == (200, b"".join(frames(500)))
        await t.aclose()


async def test_the_request_has_its_pseudo_headers_the_merged_headers_and_no_forbidden_ones() -> (
    None
):
    async def echo(conn: Conn, sid: int, head: Headers, body: bytes) -> None:
        await conn.respond(sid)
        await conn.data(sid, body, end=True)

    async with serving(echo) as server:
        t = transport(server)
        assert await fetch(t, b'{"a":1}') == (200, b'{"a":1}')
        await t.aclose()
    sent = server.requests[0]
    assert sent[:4] == [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":authority", f"127.0.0.1:{server.port}".encode()),
        (b":path", b"/v1/chat"),
    ]
    names = [k for k, _ in sent]
    assert (b"accept", b"text/event-stream") in sent  # the request's replaces the fixed one
    assert names.count(b"accept") == 1
    assert (b"user-agent", b"fixed") in sent
    assert (b"content-length", b"7") in sent
    assert b"connection" not in names
    assert b"host" not in names


async def test_a_large_body_waits_for_the_window_and_arrives_whole() -> None:
    async def length(conn: Conn, sid: int, head: Headers, body: bytes) -> None:
        await conn.respond(sid)
        await conn.data(sid, b"%d %d" % (len(body), body.count(b"x")), end=True)

    async with serving(length) as server:
        t = transport(server)
        body = b"x" * 300_000  # the server's window is 65,535
        assert await fetch(t, body) == (200, b"300000 300000")
        await t.aclose()


async def test_a_server_that_stops_reading_a_large_body_is_a_write_timeout() -> None:
    async def never(conn: Conn, sid: int, head: Headers, body: bytes) -> None:
        await trio.sleep_forever()

    async with serving(never, read_bodies=False) as server:
        t = transport(server)
        with pytest.raises(UpstreamTimeout, match="WriteTimeout"):
            await fetch(t, b"x" * 300_000, within=0.3)
        await t.aclose()


async def test_a_server_that_never_answers_is_a_read_timeout() -> None:
    async def never(conn: Conn, sid: int, head: Headers, body: bytes) -> None:
        await trio.sleep_forever()

    async with serving(never) as server:
        t = transport(server)
        with pytest.raises(UpstreamTimeout, match="ReadTimeout"):
            await fetch(t, within=0.2)
        await t.aclose()


async def test_a_reset_stream_is_an_error_naming_its_code_and_a_refused_one_a_connect_error() -> (
    None
):
    async def reset(conn: Conn, sid: int, head: Headers, body: bytes) -> None:
        if len(conn.server.requests) == 1:
            await conn.respond(sid)
            await conn.data(sid, b"data: 1\n\n")
            await conn.reset(sid, h2.errors.ErrorCodes.INTERNAL_ERROR)
        else:
            await conn.reset(sid, h2.errors.ErrorCodes.REFUSED_STREAM)

    async with serving(reset) as server:
        t = transport(server)
        with pytest.raises(UpstreamProtocolError, match="INTERNAL_ERROR"):
            await fetch(t)
        with pytest.raises(UpstreamConnectError):
            await fetch(t)
        await t.aclose()
        assert server.connections == 1  # a reset stream is not a broken connection


async def test_goaway_fails_the_streams_it_did_not_process_and_takes_no_new_one() -> None:
    first_in = trio.Event()
    second_done = trio.Event()

    async def answer(conn: Conn, sid: int, head: Headers, body: bytes) -> None:
        if conn.server.connections == 1 and sid == 1:
            await conn.respond(sid)
            await conn.data(sid, b"one,")
            first_in.set()
            await second_done.wait()
            await conn.data(sid, b"two", end=True)
        elif conn.server.connections == 1:
            await conn.goaway(last=1)  # stream 1 is processed, this one is not
        else:
            await conn.respond(sid)
            await conn.data(sid, b"fresh", end=True)

    async with serving(answer) as server:
        t = transport(server)
        results: list[object] = []

        async def first() -> None:
            results.append(await fetch(t))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first)
            await first_in.wait()
            with pytest.raises(UpstreamConnectError):
                await fetch(t)
            second_done.set()
        assert results == [(200, b"one,two")]
        assert await fetch(t) == (200, b"fresh")  # on a new connection
        assert server.connections == 2
        await t.aclose()


async def test_a_connection_closed_mid_stream_fails_it_and_the_next_stream_connects_again() -> None:
    async def answer(conn: Conn, sid: int, head: Headers, body: bytes) -> None:
        await conn.respond(sid)
        if conn.server.connections == 1:
            await conn.data(sid, b"data: 1\n\n")
            await conn.stream.aclose()
        else:
            await conn.data(sid, b"whole", end=True)

    async with serving(answer) as server:
        t = transport(server)
        with pytest.raises(UpstreamProtocolError, match="closed the connection before the end"):
            await fetch(t)
        assert await fetch(t) == (200, b"whole")
        assert server.connections == 2
        await t.aclose()


async def held(conn: Conn, sid: int, head: Headers, body: bytes) -> None:
    """Answers at once, then holds the stream until the client's body says ``go`` was set."""
    await conn.respond(sid)
    await conn.data(sid, b"first,")
    await conn.server.go.wait()  # type: ignore[attr-defined]
    await conn.data(sid, b"last", end=True)


async def test_past_the_servers_max_concurrent_streams_a_second_connection_opens() -> None:
    async with serving(held, max_streams=2) as server:
        server.go = trio.Event()  # type: ignore[attr-defined]
        t = transport(server)
        results: list[tuple[int, bytes]] = []

        async def one() -> None:
            results.append(await fetch(t))

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one)
            while len(server.requests) < 3:  # noqa: ASYNC110 (a real socket: no event to wait on)
                await trio.sleep(0.01)
            assert t.connections() == (2, 2)
            server.go.set()  # type: ignore[attr-defined]
        assert results == [(200, b"first,last")] * 3
        assert server.connections == 2
        assert server.resets == []  # none refused: the client knew the limit
        await t.aclose()


async def in_20_frames(conn: Conn, sid: int, _: Headers, __: bytes) -> None:
    await conn.respond(sid)
    for part in frames(20):
        await conn.data(sid, part)
    await conn.data(sid, b"", end=True)


async def test_200_concurrent_streams_share_one_connection_and_all_complete() -> None:
    async with serving(in_20_frames) as server:
        t = transport(server, per_connection=200)
        results: list[tuple[int, bytes]] = []

        async def one() -> None:
            results.append(await fetch(t, within=10.0))

        async with trio.open_nursery() as nursery:
            for _ in range(200):
                nursery.start_soon(one)
        assert results == [(200, b"".join(frames(20)))] * 200
        assert server.connections == 1
        await t.aclose()


async def test_a_cancelled_exchange_resets_its_stream_and_the_connection_serves_the_others() -> (
    None
):
    async def answer(conn: Conn, sid: int, head: Headers, body: bytes) -> None:
        await conn.respond(sid)
        if sid == 1:
            with contextlib.suppress(h2.exceptions.StreamClosedError):
                while True:  # endless: only the client's reset stops it
                    await conn.data(sid, b"data: more\n\n")
                    await trio.sleep(0.01)
            return
        await conn.data(sid, b"whole", end=True)

    async with serving(answer) as server:
        t = transport(server)
        with trio.move_on_after(0.1):
            async with t.stream("POST", "/chat", [], b"{}", trio.current_time() + 5) as r:
                async for _ in r:
                    pass
        assert await fetch(t) == (200, b"whole")
        with trio.fail_after(1):
            while not server.resets:  # noqa: ASYNC110 (a real socket: no event to wait on)
                await trio.sleep(0.01)
        assert server.resets == [(1, h2.errors.ErrorCodes.CANCEL)]
        assert server.connections == 1
        assert t.connections() == (1, 0)
        await t.aclose()


async def test_a_reader_that_does_not_read_holds_the_backend_back() -> None:
    sent = [0]
    done = trio.Event()

    async def big(conn: Conn, sid: int, head: Headers, body: bytes) -> None:
        await conn.respond(sid)
        for _ in range(64):
            await conn.data(sid, b"x" * 16384)
            sent[0] += 16384
        await conn.data(sid, b"", end=True)
        done.set()

    async with serving(big) as server:
        t = transport(server)
        async with t.stream("POST", "/chat", [], b"{}", trio.current_time() + 5) as r:
            with trio.move_on_after(0.3):
                await done.wait()
            # One stream window ahead of the reader, not the whole megabyte.
            assert sent[0] <= h2client.STREAM_WINDOW
            got = b"".join([part async for part in r])
        assert got == b"x" * (64 * 16384)
        await t.aclose()


async def test_requests_past_max_connections_wait_then_time_out() -> None:
    async with serving(held) as server:
        server.go = trio.Event()  # type: ignore[attr-defined]
        t = transport(server, max_connections=1)
        async with t.stream("POST", "/chat", [], b"{}", trio.current_time() + 5) as r:
            with pytest.raises(UpstreamTimeout, match="PoolTimeout"):
                await fetch(t, within=0.2)
            server.go.set()  # type: ignore[attr-defined]
            assert b"".join([p async for p in r]) == b"first,last"
        await t.aclose()


async def test_gzip_is_decoded_and_an_unknown_coding_refused() -> None:
    async def coded(conn: Conn, sid: int, head: Headers, body: bytes) -> None:
        coding = b"gzip" if len(conn.server.requests) == 1 else b"br"
        await conn.respond(sid, headers=[(b"content-encoding", coding)])
        packed = gzip.compress(b"hello " * 100)
        await conn.data(sid, packed[:10])
        await conn.data(sid, packed[10:], end=True)

    async with serving(coded) as server:
        t = transport(server)
        assert await fetch(t) == (200, b"hello " * 100)
        with pytest.raises(UpstreamProtocolError, match="content-encoding"):
            await fetch(t)
        await t.aclose()


async def test_open_transport_is_the_lean_h2_client_for_http2_and_httpx2_on_request() -> None:
    lean = open_transport(
        "up", "http://up.test/v1", [], max_connections=4, connect_timeout=1.0, http2=True
    )
    assert isinstance(lean, H2Transport)
    hatch = open_transport(
        "up",
        "http://up.test/v1",
        [],
        max_connections=4,
        connect_timeout=1.0,
        http2=True,
        client="httpx2",
    )
    assert isinstance(hatch, Httpx2Transport)
    await hatch.aclose()


# --- a real backend: aiserve-sim over h2c and over TLS (ALPN h2) --------------------------


@pytest.fixture(scope="module")
def sim_addr() -> Iterator[str]:
    with run_sim() as addr:
        yield addr


def expected(n: int) -> str:
    return "".join(token_text(i) for i in range(n))


async def test_the_adapter_streams_from_aiserve_sim_over_h2c(sim_addr: str) -> None:
    config = OpenAIAdapterConfig(base_url=f"http://{sim_addr}/v1", models=["m"], http2=True)
    adapter = OpenAIAdapter("up", config)
    texts: list[str] = []
    async with trio.open_nursery() as nursery:
        await adapter.aopen(nursery)
        assert isinstance(adapter.transport, H2Transport)

        async def one() -> None:
            request = InferenceRequest(
                request_id="r",
                model="m",
                messages=[Message(role="user", content="hi")],
                max_tokens=40,
                deadline=trio.current_time() + 10,
            )
            send, recv = trio.open_memory_channel[Delta](1000)
            async with send:
                await adapter.stream(request, send)
            texts.append("".join([d.text async for d in recv]))

        async with trio.open_nursery() as inner:
            for _ in range(20):
                inner.start_soon(one)
        assert adapter.connections() == (1, 0)
        await adapter.aclose()
    assert texts == [expected(40)] * 20


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> trustme.CA:
    return trustme.CA()


@asynccontextmanager
async def tls_server(ca: trustme.CA, alpn: list[str]) -> AsyncIterator[int]:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(ctx)
    ctx.set_alpn_protocols(alpn)

    async def handle(stream: trio.SSLStream[trio.SocketStream]) -> None:
        try:
            await stream.do_handshake()
            await Conn(Server(in_frames), stream).run()
        except trio.BrokenResourceError:
            pass

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            trio.serve_listeners,
            handle,
            [
                trio.SSLListener(tcp, ctx)
                for tcp in await trio.open_tcp_listeners(0, host="127.0.0.1")
            ],
        )
        yield listeners[0].transport_listener.socket.getsockname()[1]
        nursery.cancel_scope.cancel()


def tls_transport(ca: trustme.CA, port: int) -> H2Transport:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    return H2Transport(
        "up",
        f"https://127.0.0.1:{port}/v1",
        [],
        max_connections=10,
        connect_timeout=1.0,
        tls=TLSSettings(ctx, "127.0.0.1"),
    )


async def test_over_tls_alpn_h2_streams_and_a_backend_without_h2_is_told_clearly(
    ca: trustme.CA,
) -> None:
    async with tls_server(ca, ["h2"]) as port:
        t = tls_transport(ca, port)
        assert await fetch(t) == (200, b"".join(frames(500)))
        await t.aclose()
    async with tls_server(ca, ["http/1.1"]) as port:
        t = tls_transport(ca, port)
        with pytest.raises(UpstreamTLSError, match=r"did not agree to HTTP/2.*http2 = false"):
            await fetch(t)
        await t.aclose()


async def test_streams_whose_readers_do_not_read_never_stop_the_others_on_the_connection() -> None:
    async def big(conn: Conn, sid: int, head: Headers, body: bytes) -> None:
        await conn.respond(sid)
        with contextlib.suppress(h2.exceptions.StreamClosedError):
            for _ in range(32):
                await conn.data(sid, b"y" * 16384)
            await conn.data(sid, b"", end=True)

    async with serving(big) as server:
        t = transport(server, per_connection=3)
        deadline = trio.current_time() + 5
        async with (
            t.stream("POST", "/chat", [], b"{}", deadline),
            t.stream("POST", "/chat", [], b"{}", deadline),
        ):
            # Two streams hold their whole windows unread; the third still gets all of it.
            with trio.fail_after(2):
                assert await fetch(t) == (200, b"y" * (32 * 16384))
        assert server.connections == 1
        await t.aclose()


async def test_a_backend_that_allows_no_stream_is_a_connect_error_not_a_connect_loop() -> None:
    async with serving(in_frames, max_streams=0) as server:
        t = transport(server)
        with pytest.raises(UpstreamConnectError):
            await fetch(t)
        assert server.connections == 1
        await t.aclose()


def sse(*texts: str) -> bytes:
    out = b""
    for text in texts:
        out += b'data: {"choices":[{"delta":{"content":"%s"}}]}\n\n' % text.encode()
    out += b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\n'
    return out + b"data: [DONE]\n\n"


async def test_the_adapter_over_h2_sends_its_headers_and_a_reset_is_its_protocol_error() -> None:
    async def answer(conn: Conn, sid: int, head: Headers, body: bytes) -> None:
        await conn.respond(sid, headers=[(b"content-type", b"text/event-stream")])
        if len(conn.server.requests) == 1:
            for part in (b"data: {", sse("Hel", "lo")[7:]):  # an event cut across frames
                await conn.data(sid, part)
            await conn.data(sid, b"", end=True)
        else:
            await conn.data(sid, sse("x")[:20])
            await conn.reset(sid, h2.errors.ErrorCodes.INTERNAL_ERROR)

    async with serving(answer) as server, trio.open_nursery() as nursery:
        config = OpenAIAdapterConfig(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            models=["m"],
            http2=True,
            max_retries=0,
            headers={"X-Team": "a"},
        )
        adapter = OpenAIAdapter("up", config)
        await adapter.aopen(nursery)

        async def stream() -> str:
            request = InferenceRequest(
                request_id="req-7",
                model="m",
                messages=[Message(role="user", content="hi")],
                deadline=trio.current_time() + 5,
            )
            send, recv = trio.open_memory_channel[Delta](100)
            async with send:
                await adapter.stream(request, send)
            return "".join([d.text async for d in recv])

        assert await stream() == "Hello"
        with pytest.raises(UpstreamProtocolError, match="INTERNAL_ERROR"):
            await stream()
        await adapter.aclose()
    sent = dict(server.requests[0])
    assert sent[b":path"] == b"/v1/chat/completions"
    assert sent[b"x-team"] == b"a"
    assert sent[b"x-request-id"] == b"req-7"
    assert b"accept-encoding" not in sent  # nothing asked to decompress, as over HTTP/1.1


class Flood(socket.socket):
    """A connected-looking socket whose peer never lets it run dry: its SETTINGS, then
    ``left`` bytes of frames of a kind HTTP/2 says to ignore, a full read at every ``recv``."""

    def __init__(self, left: int) -> None:
        super().__init__(socket.AF_INET, socket.SOCK_STREAM)
        server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        server.initiate_connection()
        self.pending = server.data_to_send()
        # A frame of an unknown type (0xEE): 24-bit length, type, flags, stream 0, payload.
        self.frame = (16000).to_bytes(3, "big") + b"\xee\x00" + bytes(4) + b"z" * 16000
        self.left = left
        self.given = 0

    def send(self, data: Any, flags: int = 0, /) -> int:
        return len(data)

    def recv(self, size: int, flags: int = 0, /) -> bytes:
        while len(self.pending) < size and self.left > 0:
            self.pending += self.frame
            self.left -= len(self.frame)
        data, self.pending = self.pending[:size], self.pending[size:]
        self.given += len(data)
        return bytes(data)


async def test_a_backend_that_never_lets_the_socket_run_dry_cannot_hold_the_loop() -> None:
    # Without a checkpoint every CHECKPOINT_BYTES the reader would take all 8 MiB in one
    # step of its task: no other task would run meanwhile.
    flood = Flood(8 << 20)
    pool = h2client.H2Pool("up.test", 80, max_connections=1)
    conn = h2client._Conn(pool)
    conn.sock = flood
    conn.h2.initiate_connection()
    gaps: list[int] = []
    done = False

    async def other_task() -> None:
        last = flood.given
        while not done:
            await trio.lowlevel.checkpoint()
            gaps.append(flood.given - last)
            last = flood.given

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_task)
        await conn.read_loop()  # to the flood's end: "closed before the end"
        done = True
    assert isinstance(conn.error, h1.RemoteProtocolError), conn.error
    assert flood.given >= 8 << 20, conn.error
    assert len(gaps) > (8 << 20) // h1.CHECKPOINT_BYTES // 2
    assert max(gaps) <= 2 * (h1.CHECKPOINT_BYTES + h1.READ_SIZE)


async def test_a_backend_that_never_sends_its_settings_is_a_connect_timeout() -> None:
    async def silent(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, silent, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        t = H2Transport(
            "up", f"http://127.0.0.1:{port}", [], max_connections=4, connect_timeout=0.2
        )
        with pytest.raises(UpstreamTimeout, match="ConnectTimeout"):
            await fetch(t)
        assert t.connections() == (0, 0)  # the failed connection is not kept
        await t.aclose()
        nursery.cancel_scope.cancel()


async def test_a_refused_connect_is_a_connect_error() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = H2Transport("up", f"http://127.0.0.1:{port}", [], max_connections=4, connect_timeout=1.0)
    with pytest.raises(UpstreamConnectError):
        await fetch(t)
    await t.aclose()


async def test_over_tls_a_new_connection_resumes_the_session_an_earlier_one_got(
    ca: trustme.CA,
) -> None:
    async with tls_server(ca, ["h2"]) as port:
        kinds: list[str] = []
        ctx = ssl.create_default_context()
        ca.configure_trust(ctx)
        t = H2Transport(
            "up",
            f"https://127.0.0.1:{port}/v1",
            [],
            max_connections=10,
            connect_timeout=1.0,
            tls=TLSSettings(ctx, "127.0.0.1", kinds.append),
            per_connection=1,
        )
        assert await fetch(t) == (200, b"".join(frames(500)))  # its tickets came meanwhile
        deadline = trio.current_time() + 5
        async with t.stream("POST", "/chat", [], b"{}", deadline):  # the first connection
            assert await fetch(t) == (200, b"".join(frames(500)))  # so a second one
        assert kinds == ["full", "resumed"]
        await t.aclose()


async def test_a_connection_without_a_stream_past_keepalive_expiry_is_closed_not_reused() -> None:
    async with serving(in_20_frames) as server:
        t = transport(server)
        t.pool.keepalive_expiry = 0.1
        assert await fetch(t) == (200, b"".join(frames(20)))
        assert await fetch(t) == (200, b"".join(frames(20)))  # at once: the same connection
        assert server.connections == 1
        await trio.sleep(0.15)
        assert await fetch(t) == (200, b"".join(frames(20)))
        assert server.connections == 2
        assert t.connections() == (1, 0)
        await t.aclose()


async def test_a_stream_that_joined_a_connection_being_opened_outlives_its_opener() -> None:
    async with serving(in_20_frames, settings_delay=0.2) as server:
        t = transport(server)
        results: list[tuple[int, bytes]] = []

        async def opener() -> None:
            with trio.move_on_after(0.05):  # its client went away while it connected
                await fetch(t)

        async def joiner() -> None:
            results.append(await fetch(t))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(opener)
            await trio.sleep(0.01)
            nursery.start_soon(joiner)
        assert results == [(200, b"".join(frames(20)))]
        await t.aclose()
