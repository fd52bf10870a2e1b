"""The lean HTTP/1.1 client (``adapters/h1.py``): framing, keep-alive, cancel safety, timeouts.

Most tests run a scripted backend on in-memory streams (Trio's virtual clock
times the timeouts); a few use real sockets on 127.0.0.1 for what only a socket
shows (a server closing an idle connection, a refused connect).
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import json
import os
import random
import resource
import socket
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from aiserve_trio.adapters import h1
from aiserve_trio.adapters.base import Delta, EmbeddingRequest, InferenceRequest, Message
from aiserve_trio.adapters.openai import OpenAIAdapter
from aiserve_trio.adapters.transport import H1Transport, H2Transport, Httpx2Transport
from aiserve_trio.config import ConfigError, OpenAIAdapterConfig
from aiserve_trio.core.errors import UpstreamConnectError, UpstreamStatusError

from .fakes import RecordingHook

HEAD = h1.RequestHead("POST", "/v1/chat/completions", "up.test", [(b"accept", b"*/*")])
BODY = b'{"stream":true}'

#: What the scripted backend does with one request: bytes to send, or an action.
Action = bytes | Callable[[trio.abc.Stream], Awaitable[None]]


def ok(body: bytes, *headers: str) -> bytes:
    """A 200 with a Content-Length body."""
    extra = "".join(f"{h}\r\n" for h in headers)
    return f"HTTP/1.1 200 OK\r\n{extra}content-length: {len(body)}\r\n\r\n".encode() + body


def chunked(*parts: bytes, status: str = "200 OK", headers: str = "") -> bytes:
    out = f"HTTP/1.1 {status}\r\n{headers}transfer-encoding: chunked\r\n\r\n".encode()
    for p in parts:
        out += b"%x\r\n%s\r\n" % (len(p), p)
    return out + b"0\r\n\r\n"


async def hang(stream: trio.abc.Stream) -> None:
    await trio.sleep_forever()


async def close(stream: trio.abc.Stream) -> None:
    await stream.aclose()


async def read_request(stream: trio.abc.Stream, buf: bytearray) -> bytes | None:
    """One request (head and Content-Length body) from ``stream``; None at EOF."""
    while b"\r\n\r\n" not in buf:
        data = await stream.receive_some(65536)
        if not data:
            return None
        buf += data
    end = buf.index(b"\r\n\r\n") + 4
    head = bytes(buf[:end])
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    while len(buf) < end + length:
        data = await stream.receive_some(65536)
        if not data:
            return None
        buf += data
    request = bytes(buf[: end + length])
    del buf[: end + length]
    return request


class Backend:
    """A scripted backend on memory streams: each request gets the next action."""

    def __init__(self, nursery: trio.Nursery, *script: Action) -> None:
        self.nursery = nursery
        self.script = list(script)
        self.connections = 0
        self.requests: list[bytes] = []
        #: Connections whose client end was closed (the server read EOF).
        self.closed = 0

    async def connect(self) -> trio.abc.Stream:
        client, server = trio.testing.memory_stream_pair()
        self.connections += 1
        self.nursery.start_soon(self._serve, server)
        return client

    async def _serve(self, stream: trio.abc.Stream) -> None:
        buf = bytearray()
        try:
            while True:
                request = await read_request(stream, buf)
                if request is None:
                    self.closed += 1
                    return
                self.requests.append(request)
                action = self.script.pop(0)
                if isinstance(action, bytes):
                    await stream.send_all(action)
                else:
                    await action(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.closed += 1


def pool(backend: Backend, max_connections: int = 4, keepalive_expiry: float = 30.0) -> h1.H1Pool:
    return h1.H1Pool(
        "up.test",
        80,
        max_connections=max_connections,
        keepalive_expiry=keepalive_expiry,
        connect=backend.connect,
    )


T = h1.Timeouts(io=5.0, connect=1.0)


async def fetch(p: h1.H1Pool, timeouts: h1.Timeouts = T) -> tuple[int, bytes]:
    async with p.request(HEAD.build([], BODY), BODY, timeouts) as r:
        return r.status, b"".join([part async for part in r])


@asynccontextmanager
async def backend(*script: Action) -> AsyncIterator[Backend]:
    async with trio.open_nursery() as nursery:
        yield Backend(nursery, *script)
        nursery.cancel_scope.cancel()


# --- the request head ------------------------------------------------------------


def test_the_head_is_the_prefix_the_headers_and_the_length() -> None:
    head = HEAD.build([(b"x-request-id", b"r1")], BODY)
    assert head == (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: up.test\r\naccept: */*\r\n"
        b"x-request-id: r1\r\ncontent-length: 15\r\n\r\n"
    )
    assert HEAD.build([], None).endswith(b"accept: */*\r\n\r\n")


@pytest.mark.parametrize("bad", [b"a\r\nx-injected: 1", b"a\nb", b"a\0b"])
def test_a_header_cannot_break_the_head(bad: bytes) -> None:
    with pytest.raises(h1.HeaderError):
        HEAD.build([(b"traceparent", bad)], BODY)
    with pytest.raises(h1.HeaderError):
        h1.RequestHead("GET", "/", "h", [(bad, b"v")])


# --- framing -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "body"),
    [
        (ok(b"hello"), b"hello"),
        (chunked(b"data: a\n\n", b"data: b\n\n"), b"data: a\n\ndata: b\n\n"),
        (ok(gzip.compress(b"zipped " * 50), "content-encoding: gzip"), b"zipped " * 50),
        (ok(zlib.compress(b"deflated"), "content-encoding: deflate"), b"deflated"),
        # An informational head first: the real one follows.
        (b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n" + ok(b"after"), b"after"),
        (b"HTTP/1.1 204 No Content\r\n\r\n", b""),
    ],
)
async def test_bodies_by_their_framing(reply: bytes, body: bytes) -> None:
    async with backend(reply, reply) as b:
        p = pool(b)
        assert await fetch(p) == (204 if body == b"" else 200, body)
        assert await fetch(p) == (204 if body == b"" else 200, body)
        assert b.connections == 1  # kept alive, reused
    assert b.requests[0] == HEAD.build([], BODY) + BODY


async def test_status_and_headers() -> None:
    reply = b"HTTP/1.1 429 Too Many\r\nRetry-After: 2\r\ncontent-length: 4\r\n\r\nbusy"
    async with backend(reply) as b:
        p = pool(b)
        async with p.request(HEAD.build([], BODY), BODY, T) as r:
            assert r.status == 429
            assert r.header(b"retry-after") == b"2"
            assert r.header(b"nope") is None
            assert await r.read(100) == b"busy"


async def test_a_body_to_the_connections_end_closes_it() -> None:
    close_delimited = b"HTTP/1.1 200 OK\r\n\r\nuntil the end"

    async def answer(stream: trio.abc.Stream) -> None:
        await stream.send_all(close_delimited)
        await stream.aclose()

    async with backend(answer, ok(b"second")) as b:
        p = pool(b)
        assert await fetch(p) == (200, b"until the end")
        assert p.connections() == (0, 0)
        assert await fetch(p) == (200, b"second")
        assert b.connections == 2


async def test_connection_close_is_not_kept() -> None:
    async with backend(ok(b"a", "connection: close"), ok(b"b")) as b:
        p = pool(b)
        assert await fetch(p) == (200, b"a")
        assert p.connections() == (0, 0)
        assert await fetch(p) == (200, b"b")
        assert b.connections == 2


# --- broken replies ----------------------------------------------------------------


@pytest.mark.parametrize(
    "reply",
    [
        b"SPDY/9 what\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        ok(b"x", "content-encoding: br"),
    ],
)
async def test_a_malformed_reply_is_a_protocol_error(reply: bytes) -> None:
    async with backend(reply) as b:
        p = pool(b)
        with pytest.raises(h1.RemoteProtocolError):
            await fetch(p)
        assert p.connections() == (0, 0)


async def test_a_cut_body_is_a_protocol_error_not_a_short_reply() -> None:
    async def cut(stream: trio.abc.Stream) -> None:
        await stream.send_all(chunked(b"data: a\n\n")[:-12])
        await stream.aclose()

    async with backend(cut) as b:
        p = pool(b)
        with pytest.raises(h1.RemoteProtocolError, match="before the end"):
            await fetch(p)
        assert p.connections() == (0, 0)


async def test_no_reply_on_a_new_connection_is_a_protocol_error() -> None:
    async with backend(close) as b:
        with pytest.raises(h1.RemoteProtocolError, match="without a response"):
            await fetch(pool(b))


async def test_a_request_a_reused_connection_never_took_is_sent_once_more() -> None:
    # The server closed the idle connection before the request went out: no byte of
    # it can have been processed, so it goes again on a new connection.
    async def answer_then_close(stream: trio.abc.Stream) -> None:
        await stream.send_all(ok(b"first"))
        await stream.aclose()

    async with backend(answer_then_close, ok(b"again")) as b:
        p = pool(b)
        assert await fetch(p) == (200, b"first")
        await trio.testing.wait_all_tasks_blocked()
        assert await fetch(p) == (200, b"again")
        assert b.connections == 2
        assert len(b.requests) == 2  # the backend saw each request once
        assert p.resent == 1


async def test_a_reused_connection_closed_after_the_request_went_out_is_not_resent() -> None:
    # The keep-alive race the other way: the server read the request and closed. It may
    # have acted on it, so the client does not send it again: a retryable error for the
    # adapter's retry rules (counted there), and the next request gets a new connection.
    async with backend(ok(b"first"), close, ok(b"again")) as b:
        p = pool(b)
        assert await fetch(p) == (200, b"first")
        with pytest.raises(h1.ClosedAfterSend):
            await fetch(p)
        assert len(b.requests) == 2
        assert p.resent == 0
        assert await fetch(p) == (200, b"again")
        assert b.connections == 2


# --- cancel safety -------------------------------------------------------------------


async def test_a_response_left_half_read_never_goes_back_to_the_pool(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def slow(stream: trio.abc.Stream) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await stream.send_all(b"7\r\ndata: a\r\n")  # and the rest never comes

    async with backend(slow, ok(b"clean")) as b:
        p = pool(b)
        with trio.move_on_after(1):
            async with p.request(HEAD.build([], BODY), BODY, T) as r:
                async for part in r:
                    assert part == b"data: a"
        assert p.connections() == (0, 0)  # closed, not kept
        await trio.testing.wait_all_tasks_blocked()
        assert b.closed == 1  # the backend saw the connection go
        # The next request gets a connection of its own and a whole, clean reply.
        assert await fetch(p) == (200, b"clean")
        assert b.connections == 2


async def test_leaving_before_the_end_closes_the_connection() -> None:
    async def first_part(stream: trio.abc.Stream) -> None:
        await stream.send_all(chunked(b"a" * 10, b"b" * 10)[:-5])

    async with backend(first_part, ok(b"next")) as b:
        p = pool(b)
        async with p.request(HEAD.build([], BODY), BODY, T) as r:
            assert r.status == 200  # the body is not read to its end
        assert p.connections() == (0, 0)
        assert await fetch(p) == (200, b"next")
        assert b.connections == 2


async def test_a_reply_read_to_its_end_is_kept_whatever_the_caller_raises() -> None:
    async with backend(ok(b"whole"), ok(b"next")) as b:
        p = pool(b)

        async def fails_after_the_end() -> None:
            async with p.request(HEAD.build([], BODY), BODY, T) as r:
                assert r.complete  # came with the head
                raise KeyError("the caller's own error")

        with pytest.raises(KeyError):
            await fails_after_the_end()
        assert p.connections() == (1, 0)
        assert await fetch(p) == (200, b"next")
        assert b.connections == 1


# --- timeouts and the pool's limit ---------------------------------------------------


async def test_read_timeout(autojump_clock: trio.testing.MockClock) -> None:
    async with backend(hang) as b:
        p = pool(b)
        t0 = trio.current_time()
        with pytest.raises(h1.ReadTimeout):
            await fetch(p, h1.Timeouts(io=2.5, connect=1.0))
        assert trio.current_time() - t0 == pytest.approx(2.5)
        assert p.connections() == (0, 0)


async def test_connect_timeout(autojump_clock: trio.testing.MockClock) -> None:
    async def never() -> trio.abc.Stream:
        await trio.sleep_forever()
        raise AssertionError

    p = h1.H1Pool("up.test", 80, max_connections=1, connect=never)
    t0 = trio.current_time()
    with pytest.raises(h1.ConnectTimeout):
        await fetch(p, h1.Timeouts(io=5.0, connect=0.75))
    assert trio.current_time() - t0 == pytest.approx(0.75)
    assert p.connections() == (0, 0)


async def test_requests_past_max_connections_wait_then_time_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def late(stream: trio.abc.Stream) -> None:
        await trio.sleep(3)
        await stream.send_all(ok(b"late"))

    async with backend(late, ok(b"waited")) as b:
        p = pool(b, max_connections=1)
        got: list[tuple[int, bytes]] = []
        async with trio.open_nursery() as n:
            n.start_soon(lambda: _append(got, fetch(p)))
            await trio.testing.wait_all_tasks_blocked()
            assert p.connections() == (1, 1)
            t0 = trio.current_time()
            with pytest.raises(h1.PoolTimeout):
                await fetch(p, h1.Timeouts(io=1.0, connect=1.0))
            assert trio.current_time() - t0 == pytest.approx(1.0)
            # Given time, the second waits for the first and reuses its connection.
            got.append(await fetch(p))
        assert sorted(got) == [(200, b"late"), (200, b"waited")]
        assert b.connections == 1


async def _append(out: list[tuple[int, bytes]], call: Awaitable[tuple[int, bytes]]) -> None:
    out.append(await call)


async def test_idle_connections_expire(autojump_clock: trio.testing.MockClock) -> None:
    async with backend(ok(b"a"), ok(b"b"), ok(b"c")) as b:
        p = pool(b, keepalive_expiry=5.0)
        await fetch(p)
        await trio.sleep(4)
        await fetch(p)
        assert b.connections == 1
        await trio.sleep(6)
        await fetch(p)
        assert b.connections == 2


# --- real sockets ------------------------------------------------------------------


@asynccontextmanager
async def tcp_backend(
    handler: Callable[[trio.SocketStream], Awaitable[None]],
) -> AsyncIterator[int]:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
        yield int(listeners[0].socket.getsockname()[1])
        nursery.cancel_scope.cancel()


def test_an_idle_connection_numbered_above_1023_is_kept_until_its_server_closes_it() -> None:
    """A worker with a thousand clients has upstream sockets numbered above 1023, which
    select() cannot take: each idle one was taken for closed, and every request opened a
    new upstream connection. Open and quiet, it is fit for reuse; closed by the server, or
    with bytes it should not have sent, it is not."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard > 1600, "the test needs descriptors above 1023"
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1600), hard))
    pairs = []
    try:
        for n, spoil in enumerate((None, b"x")):
            ours, theirs = socket.socketpair()
            high = os.dup2(ours.fileno(), 1500 + n)
            ours.close()
            sock = socket.socket(fileno=high)
            sock.setblocking(False)
            pairs.append((sock, theirs))
            conn = h1._Conn(sock=sock)
            assert not conn.closed_by_peer()
            if spoil is None:
                theirs.close()
            else:
                theirs.send(spoil)
            assert conn.closed_by_peer()
    finally:
        for sock, theirs in pairs:
            sock.close()
            theirs.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow
async def test_over_tcp_an_idle_connection_the_server_closed_is_not_reused() -> None:
    accepted = 0
    closed = trio.Event()

    async def handler(stream: trio.SocketStream) -> None:
        nonlocal accepted
        accepted += 1
        if await read_request(stream, bytearray()) is not None:
            await stream.send_all(ok(b"once"))
        await stream.aclose()  # no keep-alive, though the reply did not say so
        closed.set()

    async with tcp_backend(handler) as port:
        p = h1.H1Pool("127.0.0.1", port, max_connections=2)
        assert await fetch(p) == (200, b"once")
        assert p.connections() == (1, 0)
        await closed.wait()
        await trio.sleep(0.05)  # the FIN crosses loopback
        assert p._idle[0].closed_by_peer()
        assert await fetch(p) == (200, b"once")
        assert accepted == 2
        await p.aclose()
        assert p.connections() == (0, 0)


@pytest.mark.slow
async def test_over_tcp_a_body_larger_than_the_socket_buffer_and_a_reply_in_pieces() -> None:
    """The direct write takes what the socket does, the rest waits for room; the
    reads that find nothing wait for the next piece."""
    big = random.Random(7).randbytes(16 << 20)  # 16 MiB: more than one send() takes
    seen: list[bool] = []

    async def handler(stream: trio.SocketStream) -> None:
        buf = bytearray()
        request = await read_request(stream, buf)
        assert request is not None
        seen.append(request[request.index(b"\r\n\r\n") + 4 :] == big)
        reply = chunked(b"first ", b"second ", b"third")
        for i in range(0, len(reply), 7):  # a few bytes at a time, with pauses
            await stream.send_all(reply[i : i + 7])
            await trio.sleep(0.002)
        await read_request(stream, buf)  # keep the connection open until the client is done

    async with tcp_backend(handler) as port:
        p = h1.H1Pool("127.0.0.1", port, max_connections=1)
        head = HEAD.build([], big)
        async with p.request(head, big, T) as r:
            assert r.status == 200
            assert b"".join([part async for part in r]) == b"first second third"
        assert seen == [True]
        (conn,) = p._idle
        assert conn.sock is not None  # the direct path was the one taken
        await p.aclose()


@pytest.mark.slow
async def test_over_tcp_a_server_that_stops_answering_is_a_read_timeout() -> None:
    async def handler(stream: trio.SocketStream) -> None:
        buf = bytearray()
        await read_request(stream, buf)
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf")
        await trio.sleep_forever()  # the other half never comes

    async with tcp_backend(handler) as port:
        p = h1.H1Pool("127.0.0.1", port, max_connections=1)
        start = trio.current_time()
        with trio.fail_after(5), pytest.raises(h1.ReadTimeout):
            await fetch(p, h1.Timeouts(io=0.2, connect=1.0))
        assert 0.2 <= trio.current_time() - start < 2
        assert p.connections() == (0, 0)  # a connection left mid-body is closed
        await p.aclose()


@pytest.mark.slow
async def test_over_tcp_a_refused_connect_is_a_connect_error() -> None:
    from .servers import free_port

    p = h1.H1Pool("127.0.0.1", free_port(), max_connections=1)
    with pytest.raises(h1.ConnectError):
        await fetch(p)
    assert p.connections() == (0, 0)


# --- the openai adapter on the lean client -----------------------------------------


def sse(*texts: str) -> bytes:
    out = b""
    for t in texts:
        out += b'data: {"choices":[{"delta":{"content":"%s"}}]}\n\n' % t.encode()
    out += b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\n'
    out += b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\n'
    return out + b"data: [DONE]\n\n"


def adapter_for(port: int, **kw: object) -> OpenAIAdapter:
    cfg = OpenAIAdapterConfig(
        base_url=f"http://127.0.0.1:{port}/v1",
        models=["m"],
        backoff_base_ms=1,
        **kw,  # type: ignore[arg-type]
    )
    return OpenAIAdapter("up", cfg, hook=RecordingHook())


def chat_request(deadline: float) -> InferenceRequest:
    return InferenceRequest(
        request_id="req-7",
        model="m",
        messages=[Message(role="user", content="hi")],
        deadline=deadline,
        forward_headers={"traceparent": "00-abc-def-01"},
    )


async def stream_all(adapter: OpenAIAdapter, deadline: float) -> list[Delta]:
    send, recv = trio.open_memory_channel[Delta](100)
    async with send:
        await adapter.stream(chat_request(deadline), send)
    return [d async for d in recv]


class Upstream:
    """A real TCP backend: answers each request with the next reply; keeps what it got."""

    def __init__(self, *replies: Action) -> None:
        self.replies = list(replies)
        self.requests: list[bytes] = []
        self.accepted = 0
        self.eof = trio.Event()

    async def handler(self, stream: trio.SocketStream) -> None:
        self.accepted += 1
        buf = bytearray()
        try:
            while (request := await read_request(stream, buf)) is not None:
                self.requests.append(request)
                action = self.replies.pop(0)
                if isinstance(action, bytes):
                    await stream.send_all(action)
                else:
                    await action(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went, or an action closed the connection
        self.eof.set()


@pytest.mark.slow
async def test_the_adapter_speaks_through_the_lean_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("H1_TEST_KEY", "sk-h1")
    up = Upstream(chunked(sse("Hel", "lo")), chunked(sse("again")))
    async with tcp_backend(up.handler) as port, trio.open_nursery() as nursery:
        adapter = adapter_for(port, api_key_env="H1_TEST_KEY", headers={"X-Team": "a"})
        await adapter.aopen(nursery)
        deltas = await stream_all(adapter, trio.current_time() + 5)
        assert "".join(d.text for d in deltas) == "Hello"
        assert deltas[-1].finish_reason == "stop"
        assert deltas[-1].usage is not None
        assert adapter.connections() == (1, 0)
        deltas = await stream_all(adapter, trio.current_time() + 5)
        assert "".join(d.text for d in deltas) == "again"
        await adapter.aclose()
    assert up.accepted == 1  # one keep-alive connection for both
    head, _, body = up.requests[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/chat/completions HTTP/1.1"
    fields = dict(line.split(b": ", 1) for line in lines[1:])
    assert fields[b"host"] == f"127.0.0.1:{port}".encode()
    assert fields[b"authorization"] == b"Bearer sk-h1"
    assert fields[b"x-team"] == b"a"
    assert fields[b"x-request-id"] == b"req-7"
    assert fields[b"traceparent"] == b"00-abc-def-01"
    assert 4000 < int(fields[b"x-request-timeout-ms"]) <= 5000
    assert b"accept-encoding" not in fields  # nothing to decompress
    assert json.loads(body)["stream"] is True


@pytest.mark.slow
async def test_the_adapter_retries_a_429_on_the_lean_client() -> None:
    busy = b'HTTP/1.1 429 Too Many\r\nretry-after: 0\r\ncontent-length: 14\r\n\r\n{"error": {}}\n'
    up = Upstream(busy, chunked(sse("ok")))
    async with tcp_backend(up.handler) as port, trio.open_nursery() as nursery:
        adapter = adapter_for(port)
        await adapter.aopen(nursery)
        deltas = await stream_all(adapter, trio.current_time() + 5)
        await adapter.aclose()
    assert "".join(d.text for d in deltas) == "ok"
    assert isinstance(adapter.hook, RecordingHook)
    (retried,) = adapter.hook.retried
    assert isinstance(retried, UpstreamStatusError)
    assert retried.upstream_status == 429
    assert up.accepted == 1  # the error body was read to its end: the connection kept


@pytest.mark.slow
async def test_a_request_the_backend_may_have_seen_is_retried_by_the_adapter_and_counted() -> None:
    # The keep-alive race on a reused connection: the backend read the request and
    # closed. h1 does not send it again itself; the adapter's retry rules do, once.
    async def read_then_close(stream: trio.abc.Stream) -> None:
        await stream.aclose()

    up = Upstream(chunked(sse("one")), read_then_close, chunked(sse("two")))
    async with tcp_backend(up.handler) as port, trio.open_nursery() as nursery:
        adapter = adapter_for(port)
        await adapter.aopen(nursery)
        await stream_all(adapter, trio.current_time() + 5)
        deltas = await stream_all(adapter, trio.current_time() + 5)
        await adapter.aclose()
    assert "".join(d.text for d in deltas) == "two"
    assert isinstance(adapter.hook, RecordingHook)
    (retried,) = adapter.hook.retried
    assert isinstance(retried, UpstreamConnectError)
    assert retried.code == "upstream_closed_after_send"
    assert len(up.requests) == 3  # the backend saw it twice: once per try, never more
    assert up.accepted == 2


@pytest.mark.slow
async def test_a_cancelled_stream_closes_its_upstream_connection() -> None:
    async def endless(stream: trio.abc.Stream) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        piece = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
        while True:
            await stream.send_all(b"%x\r\n%s\r\n" % (len(piece), piece))
            await trio.sleep(0.01)

    up = Upstream(endless, chunked(sse("fresh")))
    async with tcp_backend(up.handler) as port, trio.open_nursery() as nursery:
        adapter = adapter_for(port)
        await adapter.aopen(nursery)
        send, recv = trio.open_memory_channel[Delta](100)
        with trio.move_on_after(0.1):
            await adapter.stream(chat_request(trio.current_time() + 5), send)
        assert len(recv.receive_nowait().text) >= 1  # it was streaming when cancelled
        assert adapter.connections() == (0, 0)
        with trio.fail_after(5):
            await up.eof.wait()  # the backend saw the connection close
        deltas = await stream_all(adapter, trio.current_time() + 5)
        assert "".join(d.text for d in deltas) == "fresh"
        await adapter.aclose()
    assert up.accepted == 2


@pytest.mark.slow
async def test_probe_and_embeddings_on_the_lean_client() -> None:
    models = ok(b'{"object":"list","data":[]}')
    vectors = ok(b'{"object":"list","data":[{"embedding":[0.5]}]}')
    up = Upstream(models, vectors, b"HTTP/1.1 503 Busy\r\ncontent-length: 0\r\n\r\n")
    async with tcp_backend(up.handler) as port, trio.open_nursery() as nursery:
        adapter = adapter_for(port)
        await adapter.aopen(nursery)
        assert await adapter.probe()
        answer = await adapter.embed_once(
            EmbeddingRequest(
                request_id="e1",
                model="m",
                deadline=trio.current_time() + 5,
                body={"model": msgspec.Raw(b'"m"'), "input": msgspec.Raw(b'"hi"')},
            )
        )
        assert json.loads(answer)["data"][0]["embedding"] == [0.5]
        assert not await adapter.probe()  # a 503
        await adapter.aclose()
    assert up.requests[0].startswith(b"GET /v1/models HTTP/1.1\r\n")
    assert up.requests[1].startswith(b"POST /v1/embeddings HTTP/1.1\r\n")
    assert up.requests[1].endswith(b'{"model":"m","input":"hi"}')


async def test_the_httpx2_setting_keeps_httpx2_http2_and_https_are_lean() -> None:
    async with trio.open_nursery() as nursery:
        for kw in (
            {"base_url": "https://up.test/v1", "http2": True, "client": "httpx2"},
            {"base_url": "http://up.test/v1", "http2": True, "client": "httpx2"},
            {"base_url": "http://up.test/v1", "client": "httpx2"},
        ):
            adapter = OpenAIAdapter("up", OpenAIAdapterConfig(models=["m"], **kw))
            await adapter.aopen(nursery)
            assert isinstance(adapter.transport, Httpx2Transport), kw
            await adapter.aclose()
        for base in ("http://up.test/v1", "https://up.test/v1"):
            cfg = OpenAIAdapterConfig(base_url=base, models=["m"], http2=True)
            adapter = OpenAIAdapter("up", cfg)
            await adapter.aopen(nursery)
            assert isinstance(adapter.transport, H2Transport), base
            assert (adapter.transport.pool.tls is not None) == base.startswith("https")
            await adapter.aclose()
        for base in ("http://up.test/v1", "https://up.test/v1"):
            adapter = OpenAIAdapter("up", OpenAIAdapterConfig(base_url=base, models=["m"]))
            await adapter.aopen(nursery)
            assert isinstance(adapter.transport, H1Transport), base
            assert (adapter.transport.pool.tls is not None) == base.startswith("https")
            await adapter.aclose()


async def test_the_host_header_names_the_backend_as_its_url_does() -> None:
    async with trio.open_nursery() as nursery:
        for base, host in (
            ("http://up.test/v1", b"host: up.test\r\n"),
            ("http://127.0.0.1:8100/v1", b"host: 127.0.0.1:8100\r\n"),
            ("http://[::1]:8100/v1", b"host: [::1]:8100\r\n"),
        ):
            adapter = OpenAIAdapter("up", OpenAIAdapterConfig(base_url=base, models=["m"]))
            await adapter.aopen(nursery)
            assert isinstance(adapter.transport, H1Transport)
            head = adapter.transport._head("POST", "/chat/completions", frozenset()).build(
                [], b"{}"
            )
            assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n" + host), head
            await adapter.aclose()


async def test_a_configured_header_that_would_break_the_head_is_refused() -> None:
    cfg = OpenAIAdapterConfig(
        base_url="http://up.test/v1", models=["m"], headers={"X-Team": "a\r\nx-evil: 1"}
    )
    async with trio.open_nursery() as nursery:
        with pytest.raises(ConfigError, match="adapter up: headers"):
            await OpenAIAdapter("up", cfg).aopen(nursery)


async def test_a_finished_exchange_leaves_no_cycle_for_the_garbage_collector() -> None:
    # The parser holds the response's callbacks: left as a cycle, every request's
    # response waited for a collection (gen1 collections were 5 % of a worker's CPU).
    async with backend(ok(b"a"), chunked(b"b")) as b:
        p = pool(b)
        gc.collect()
        gc.disable()
        try:
            await fetch(p)
            await fetch(p)
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            assert not [o for o in gc.garbage if isinstance(o, h1.Response)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()


# --- fairness ------------------------------------------------------------------------


class Flood(socket.socket):
    """A connected-looking socket whose peer never lets it run dry: every ``recv`` returns
    a full read at once (after the response head), every ``send`` takes 64 KiB at once."""

    def __init__(self, body: int) -> None:
        super().__init__(socket.AF_INET, socket.SOCK_STREAM)
        self.head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % body
        self.left = body
        self.sent = 0

    def send(self, data: Any, flags: int = 0, /) -> int:
        n = min(len(data), 65536)
        self.sent += n
        return n

    def recv(self, size: int, flags: int = 0, /) -> bytes:
        if self.head:
            head, self.head = self.head, b""
            return head
        n = min(size, self.left)
        self.left -= n
        return b"x" * n


async def test_a_backend_that_never_lets_the_socket_run_dry_cannot_hold_the_loop() -> None:
    # Without a checkpoint every CHECKPOINT_BYTES, the whole 32 MiB would be read and
    # the whole 8 MiB request written in one step of the task: no other task would run.
    body = 32 << 20
    flood = Flood(body)

    async def connect() -> socket.socket:
        return flood

    p = h1.H1Pool("up.test", 80, max_connections=1, connect=connect)
    moved = 0
    gaps: list[int] = []
    done = False

    async def other_task() -> None:
        last = moved + flood.sent
        while not done:
            await trio.lowlevel.checkpoint()
            now = moved + flood.sent
            gaps.append(now - last)
            last = now

    request = b"y" * (8 << 20)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_task)
        async with p.request(HEAD.build([], request), request, T) as r:
            async for part in r:
                moved += len(part)
        done = True
    assert moved == body
    assert flood.sent == len(HEAD.build([], request)) + len(request)
    assert len(gaps) > (body + len(request)) // h1.CHECKPOINT_BYTES // 2
    # Trio may run the client twice between two steps of the other task (the end of
    # one batch of runnable tasks, the start of the next): two windows at most.
    assert max(gaps) <= 2 * (h1.CHECKPOINT_BYTES + h1.READ_SIZE)
    flood.close()


async def test_a_response_under_way_holds_no_request_bytes() -> None:
    # A held stream reads its response for minutes: its request (the prompt, serialized)
    # went out at the start, and is not kept for as long as the stream lasts.
    body = b'{"messages": "%s"}' % (b"x" * 100_000)
    head = HEAD.build([], body)

    async def open_ended(stream: trio.abc.Stream) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n")
        await trio.sleep_forever()

    async with backend(open_ended) as b:
        async with pool(b).request(head, body, T) as r:
            assert r.status == 200
            assert await r.__anext__() == b"hi"
            holders = gc.get_referrers(body) + gc.get_referrers(head)
            assert not any(holder is r for holder in holders)
        assert b.requests == [head + body]


@pytest.mark.slow
async def test_a_held_stream_through_the_adapter_keeps_no_copy_of_its_prompt() -> None:
    # The prompt stays (the request's messages, for billing); its serialized copy, the
    # upstream request's body, goes once the response's head came (bench/memprobe.py).
    import tracemalloc

    first = trio.Event()
    release = trio.Event()

    async def held(stream: trio.abc.Stream) -> None:
        part = sse("Hel")[: -len(b"data: [DONE]\n\n")].split(b"\n\n")[0] + b"\n\n"
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(part), part)
        )
        await release.wait()
        rest = sse()
        await stream.send_all(b"%x\r\n%s\r\n0\r\n\r\n" % (len(rest), rest))

    class Sink:
        async def send(self, delta: Delta) -> None:
            first.set()

    up = Upstream(held)
    prompt = "x" * 1_000_000
    request = msgspec.structs.replace(
        chat_request(trio.current_time() + 30), messages=[Message(role="user", content=prompt)]
    )
    async with tcp_backend(up.handler) as port, trio.open_nursery() as nursery:
        adapter = adapter_for(port)
        await adapter.aopen(nursery)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            async with trio.open_nursery() as inner:
                inner.start_soon(adapter.stream, request, Sink())
                await first.wait()
                gc.collect()
                held_bytes = tracemalloc.get_traced_memory()[0] - before
                release.set()
        finally:
            tracemalloc.stop()
        await adapter.aclose()
    assert len(up.requests[0]) > len(prompt)  # the prompt went out
    # What the test's backend kept of the request is in the count too.
    assert held_bytes - len(up.requests[0]) < len(prompt) // 2


# --- a connect storm: connects in progress at once are bounded ------------------------


class SlowConnects:
    """A backend whose connects each take ``connect_s`` (virtual), counting how many are
    in progress at once; each connection answers its requests after ``reply_s``."""

    def __init__(self, nursery: trio.Nursery, connect_s: float, reply_s: float = 0.0) -> None:
        self.nursery = nursery
        self.connect_s = connect_s
        self.reply_s = reply_s
        self.connections = 0
        self.in_progress = 0
        self.most_at_once = 0
        #: Connects that never finish (their callers' time runs out), the first ones.
        self.hanging = 0

    async def connect(self) -> trio.abc.Stream:
        self.in_progress += 1
        self.most_at_once = max(self.most_at_once, self.in_progress)
        try:
            if self.hanging:
                self.hanging -= 1
                await trio.sleep_forever()
            await trio.sleep(self.connect_s)
        finally:
            self.in_progress -= 1
        client, server = trio.testing.memory_stream_pair()
        self.connections += 1
        self.nursery.start_soon(self._serve, server)
        return client

    async def _serve(self, stream: trio.abc.Stream) -> None:
        buf = bytearray()
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while await read_request(stream, buf) is not None:
                await trio.sleep(self.reply_s)
                await stream.send_all(ok(b"answer"))


@asynccontextmanager
async def slow_connects(connect_s: float, reply_s: float = 0.0) -> AsyncIterator[SlowConnects]:
    async with trio.open_nursery() as nursery:
        yield SlowConnects(nursery, connect_s, reply_s)
        nursery.cancel_scope.cancel()


async def test_a_connect_storm_opens_at_most_max_connecting_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # 300 requests at once, each needing a connection of its own (every answer comes
    # after the last connect): never more than 16 connects in flight, all answered.
    async with slow_connects(connect_s=0.05, reply_s=5.0) as b:
        p = h1.H1Pool("up.test", 80, max_connections=300, connect=b.connect, max_connecting=16)
        got: list[tuple[int, bytes]] = []
        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            for _ in range(300):
                n.start_soon(_append, got, fetch(p, h1.Timeouts(io=10.0, connect=2.0)))
        assert got == [(200, b"answer")] * 300
        assert b.connections == 300
        assert b.most_at_once == 16
        # In rounds of 16: 19 connect times, then the answers' 5 s.
        assert trio.current_time() - t0 == pytest.approx(19 * 0.05 + 5.0)


async def test_a_request_waiting_to_connect_takes_a_connection_given_back_meanwhile(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with slow_connects(connect_s=1.0, reply_s=0.5) as b:
        p = h1.H1Pool("up.test", 80, max_connections=3, connect=b.connect, max_connecting=1)
        slow = h1.Timeouts(io=5.0, connect=2.0)
        got: list[tuple[int, bytes]] = []
        async with trio.open_nursery() as n:
            # The first connects by 1 s and gives its connection back at 1.5 s; the
            # second connects from 1.1 s to 2.1 s; the third, come at 1.2 s, waits for
            # that connect slot and, when it comes, takes the first's connection.
            n.start_soon(_append, got, fetch(p, slow))
            await trio.sleep(1.1)
            n.start_soon(_append, got, fetch(p, slow))
            await trio.sleep(0.1)
            n.start_soon(_append, got, fetch(p, slow))
        assert got == [(200, b"answer")] * 3
        assert b.connections == 2


async def test_the_connect_timeout_bounds_the_wait_for_a_connect_slot_and_frees_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with slow_connects(connect_s=0.1) as b:
        b.hanging = 1  # the first connect never finishes
        p = h1.H1Pool("up.test", 80, max_connections=4, connect=b.connect, max_connecting=1)
        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            n.start_soon(_expect_connect_timeout, p, 3.0)
            await trio.testing.wait_all_tasks_blocked()
            # One waits for the connect slot and is cancelled; one times out waiting.
            with trio.move_on_after(0.5):
                await fetch(p)
            with pytest.raises(h1.ConnectTimeout):
                await fetch(p, h1.Timeouts(io=5.0, connect=1.0))
            assert trio.current_time() - t0 == pytest.approx(1.5)
            assert b.connections == 0
        # The hanging connect was cut at 3 s: its slot, and the waiters', are free.
        assert trio.current_time() - t0 == pytest.approx(3.0)
        assert await fetch(p) == (200, b"answer")
        assert b.connections == 1
        assert p.connections() == (1, 0)


async def _expect_connect_timeout(p: h1.H1Pool, connect_s: float) -> None:
    with pytest.raises(h1.ConnectTimeout):
        await fetch(p, h1.Timeouts(io=5.0, connect=connect_s))


def test_max_connecting_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_connecting"):
        h1.H1Pool("up.test", 80, max_connections=4, max_connecting=0)


async def test_by_default_a_storms_connects_are_not_held_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Off by default (docs/performance.md): every connect goes out at once.
    async with slow_connects(connect_s=0.05, reply_s=5.0) as b:
        p = h1.H1Pool("up.test", 80, max_connections=300, connect=b.connect)
        got: list[tuple[int, bytes]] = []
        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            for _ in range(300):
                n.start_soon(_append, got, fetch(p, h1.Timeouts(io=10.0, connect=2.0)))
        assert got == [(200, b"answer")] * 300
        assert b.most_at_once == 300
        assert trio.current_time() - t0 == pytest.approx(0.05 + 5.0)
