"""hypercorn's HTTP/1.1 writes, coalesced (``server/coalesce.py``): fewer writes, same bytes,
same order, and a head nobody promised a body for still goes out at once."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import h11
import pytest
import trio
from hypercorn.config import Config
from hypercorn.events import RawData
from hypercorn.trio import serve

from aiserve_trio.http.types import DEFER
from aiserve_trio.server.tcp import GatewayTCPServer

from .conftest import seam_on
from .servers import free_port

pytestmark = pytest.mark.slow

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
App = Callable[
    [Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
    Awaitable[None],
]
HEAD = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}


def body(data: bytes, more: bool = False) -> Message:
    return {"type": "http.response.body", "body": data, "more_body": more}


class Writes:
    """Counts the socket writes hypercorn makes (its RawData events)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sizes: list[int] = []
        original = GatewayTCPServer.protocol_send

        async def counting(server: Any, event: Any) -> None:
            if isinstance(event, RawData):
                self.sizes.append(len(event.data))
            await original(server, event)

        monkeypatch.setattr(GatewayTCPServer, "protocol_send", counting)


@asynccontextmanager
async def server(app: App) -> AsyncIterator[int]:
    # hypercorn's Trio worker picks its server class as it starts serving: the seam's.
    seam_on()
    port = free_port()
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    done = trio.Event()

    async def asgi(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        while (await receive()).get("more_body"):
            pass
        await app(scope, receive, send)

    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve, asgi, config, shutdown_trigger=done.wait))  # type: ignore[arg-type]
        yield port
        done.set()


async def exchange(
    stream: trio.SocketStream, conn: h11.Connection, on_head: Callable[[], None] | None = None
) -> tuple[int, bytes]:
    """One GET on ``conn``: (status, body)."""
    await stream.send_all(conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")])))
    await stream.send_all(conn.send(h11.EndOfMessage()))
    status, data = 0, b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Response):
            status = event.status_code
            if on_head is not None:
                on_head()
        elif isinstance(event, h11.Data):
            data += event.data
        elif isinstance(event, h11.EndOfMessage):
            conn.start_next_cycle()
            return status, data


async def test_a_promised_body_goes_out_with_its_head_and_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    writes = Writes(monkeypatch)

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        await send({**HEAD, DEFER: True})
        await send(body(b"hello", more=True))
        await send(body(b" world"))

    async with server(app) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        conn = h11.Connection(h11.CLIENT)
        for _ in range(2):  # and again on the same connection: nothing out of order
            writes.sizes.clear()
            assert await exchange(stream, conn) == (200, b"hello world")
            # Head + first body, then the last body + the chunked terminator.
            assert len(writes.sizes) == 2
        await stream.aclose()


async def test_a_whole_response_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    writes = Writes(monkeypatch)

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        await send({**HEAD, DEFER: True, "headers": [(b"content-length", b"2")]})
        await send(body(b"ok"))

    async with server(app) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        assert await exchange(stream, h11.Connection(h11.CLIENT)) == (200, b"ok")
        assert len(writes.sizes) == 1  # no empty write for the end of a Content-Length body
        await stream.aclose()


async def test_a_head_without_the_promise_goes_out_before_any_body(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A session event stream: the head, then nothing until an event happens.
    writes = Writes(monkeypatch)
    head_seen = trio.Event()

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        await send(HEAD)
        await head_seen.wait()  # the client has the head while no body was sent
        await send(body(b"event"))

    async with server(app) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        with trio.fail_after(10):
            got = await exchange(stream, h11.Connection(h11.CLIENT), head_seen.set)
        assert got == (200, b"event")
        assert len(writes.sizes) == 2  # the head alone; the body with its end
        await stream.aclose()


async def test_an_app_that_breaks_its_promise_still_sends_the_head(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def app(scope: Scope, receive: Any, send: Any) -> None:
        await send({**HEAD, DEFER: True})
        raise RuntimeError("the app failed before its body")

    async with server(app) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        conn = h11.Connection(h11.CLIENT)
        await stream.send_all(conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")])))
        await stream.send_all(conn.send(h11.EndOfMessage()))
        received = b""
        with trio.fail_after(10):
            while data := await stream.receive_some(65536):
                received += data
        assert received.startswith(b"HTTP/1.1 200 ")  # the head, then the connection closes
        await stream.aclose()
