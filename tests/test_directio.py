"""hypercorn's reads and writes made at once (``server/directio.py``): the same bytes, in
order, whether the socket takes them whole, in part, or not at all (a client gone); requests
in pieces or pipelined; the read timeout."""

from __future__ import annotations

import random
from typing import Any

import h11
import pytest
import trio

from .test_coalesce import HEAD, Scope, body, exchange, server

pytestmark = pytest.mark.slow


class Fallbacks:
    """Counts the writes that went hypercorn's own way (the lock and send_all)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sizes: list[int] = []
        original = trio.SocketStream.send_all

        async def counting(stream: trio.SocketStream, data: Any) -> None:
            self.sizes.append(len(data))
            await original(stream, data)

        monkeypatch.setattr(trio.SocketStream, "send_all", counting)


async def test_replies_go_out_directly_and_a_large_one_finishes_the_usual_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fallbacks = Fallbacks(monkeypatch)
    big = random.Random(7).randbytes(16 << 20)  # more than the socket takes at once

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        data = b"small" if scope["path"] == "/" else big
        await send({**HEAD, "headers": [(b"content-length", str(len(data)).encode())]})
        await send(body(data))

    async with server(app) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        conn = h11.Connection(h11.CLIENT)
        for _ in range(3):
            assert await exchange(stream, conn) == (200, b"small")
        server_writes = [n for n in fallbacks.sizes if n > 100]
        assert server_writes == []  # the socket took every reply directly
        await stream.send_all(
            conn.send(h11.Request(method="GET", target="/big", headers=[("host", "x")]))
        )
        await stream.send_all(conn.send(h11.EndOfMessage()))
        got = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(1 << 20))
            elif isinstance(event, h11.Data):
                got += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
        assert got == big  # the direct part and the rest, in order
        assert any(0 < n < len(big) for n in fallbacks.sizes)  # the rest went the usual way
        await stream.aclose()


async def test_a_client_gone_mid_reply_ends_the_reply_quietly_and_the_server_serves_on() -> None:
    sent = trio.Event()
    finished: list[str] = []
    ended = trio.Event()

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        if scope["path"] == "/slow":
            await send({**HEAD, "headers": []})
            await send(body(b"first", more=True))
            sent.set()
            await trio.sleep(0.3)  # the client resets the connection meanwhile
            try:
                for _ in range(20):
                    await send(body(b"x" * 65536, more=True))
                await send(body(b""))
            except BaseException as exc:
                finished.append(type(exc).__name__)
                raise
            finally:
                ended.set()
            finished.append("sent")
            return
        await send({**HEAD, "headers": [(b"content-length", b"2")]})
        await send(body(b"ok"))

    async with server(app) as port:
        gone = await trio.open_tcp_stream("127.0.0.1", port)
        await gone.send_all(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        await sent.wait()
        linger = b"\x01\0\0\0\0\0\0\0"  # on, 0 s: close sends an RST
        gone.socket.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_LINGER, linger)
        await gone.aclose()
        with trio.fail_after(5):
            await ended.wait()
        assert finished == ["sent"]  # the app's sends did not raise: the reply just ended
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        assert await exchange(stream, h11.Connection(h11.CLIENT)) == (200, b"ok")
        await stream.aclose()


async def test_a_request_in_pieces_and_two_pipelined_are_read_and_answered_in_order() -> None:

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        data = scope["path"].encode()
        await send({**HEAD, "headers": [(b"content-length", str(len(data)).encode())]})
        await send(body(data))

    async with server(app) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        for piece in (b"GET /one HT", b"TP/1.1\r\nhost:", b" x\r\n\r\n"):
            await stream.send_all(piece)
            await trio.sleep(0.05)  # each piece a read of its own, after a wait
        await stream.send_all(
            b"GET /two HTTP/1.1\r\nhost: x\r\n\r\nGET /three HTTP/1.1\r\nhost: x\r\n\r\n"
        )
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
        conn.send(h11.EndOfMessage())
        got: list[bytes] = []
        data = b""
        while len(got) < 3:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Data):
                data += event.data
            elif isinstance(event, h11.EndOfMessage):
                got.append(data)
                data = b""
                conn.start_next_cycle()
                if len(got) < 3:
                    conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
                    conn.send(h11.EndOfMessage())
        assert got == [b"/one", b"/two", b"/three"]
        await stream.aclose()


async def test_a_connection_silent_past_the_read_timeout_is_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hypercorn.config import Config

    # With the keep-alive timer the app installs, the timeout closes it at once
    # (hypercorn's own timer kept it open up to keep_alive_timeout more).
    monkeypatch.setattr(Config, "read_timeout", 0.2)

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        await send({**HEAD, "headers": [(b"content-length", b"2")]})
        await send(body(b"ok"))

    async with server(app) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        start = trio.current_time()
        with trio.fail_after(5):
            assert await stream.receive_some(10) == b""  # closed: it sent nothing
        assert trio.current_time() - start >= 0.2
        await stream.aclose()
