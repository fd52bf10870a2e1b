"""The lean client over TLS reads what came in one go: many records, one parse, one piece.

A backend writes each SSE event as a TLS record of its own. The backend here is a TLS
server driven by hand (an ``SSLObject`` over memory BIOs, certificates from trustme) on
one end of a socket pair, so the test decides which records the client's socket holds
at each read: a burst of them at once, or a record and half of the next.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trustme

from aiserve_trio.adapters import h1
from aiserve_trio.adapters.tls import TLSSettings

HEAD = h1.RequestHead("POST", "/v1/chat/completions", "up.test", []).build([], b"{}")
T = h1.Timeouts(io=5.0, connect=5.0)
EVENTS = [b'data: {"choices":[{"delta":{"content":"tok%d"}}]}\n\n' % i for i in range(20)]


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Backend:
    """A TLS server on a socket: records written one by one, sent when the test says."""

    def __init__(self, sock: trio.socket.SocketType, context: ssl.SSLContext) -> None:
        self.sock = sock
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.obj = context.wrap_bio(self.incoming, self.outgoing, server_side=True)
        self.request = b""
        #: The client's end of the pair, which counts its reads.
        self.client: CountingSocket | None = None

    async def _fill(self) -> None:
        data = await self.sock.recv(65536)
        if data:
            self.incoming.write(data)
        else:
            self.incoming.write_eof()

    async def handshake_and_request(self) -> None:
        while True:
            try:
                self.obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self.sock.send(self.outgoing.read())
                await self._fill()
        await self.send(self.outgoing.read())  # the session tickets (TLS 1.3)
        while not self.request.endswith(b"{}"):
            try:
                self.request += self.obj.read(65536)
            except ssl.SSLWantReadError:
                await self._fill()

    def records(self, *pieces: bytes) -> bytes:
        """The ciphertext of ``pieces``, each its own record."""
        for piece in pieces:
            self.obj.write(piece)
        return self.outgoing.read()

    async def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[await self.sock.send(view) :]

    async def answer(self, *steps: tuple[bytes, ...] | trio.Event) -> None:
        """Take one request, then send each step's pieces, each its own record, in one
        send; an event step: wait for it."""
        self.request = b""
        await self.handshake_and_request()
        for step in steps:
            if isinstance(step, trio.Event):
                await step.wait()
            else:
                await self.send(self.records(*step))


class CountingSocket(socket.socket):
    """A socket that counts its reads, and those that found nothing (would block)."""

    reads = 0
    would_block = 0

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0, /) -> int:
        self.reads += 1
        try:
            return super().recv_into(buffer, nbytes, flags)
        except BlockingIOError:
            self.would_block += 1
            raise


@asynccontextmanager
async def tls_pair() -> AsyncIterator[tuple[h1.H1Pool, Backend]]:
    """A pool speaking TLS to a :class:`Backend` on the other end of a socket pair."""
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("up.test").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    pair, theirs = socket.socketpair()
    ours = CountingSocket(pair.family, pair.type, fileno=pair.detach())
    ours.setblocking(False)
    backend = Backend(trio.socket.from_stdlib_socket(theirs), server_ctx)

    async def connect() -> socket.socket:
        return ours

    pool = h1.H1Pool(
        "up.test", 443, max_connections=1, connect=connect, tls=TLSSettings(client_ctx, "up.test")
    )
    backend.client = ours
    try:
        yield pool, backend
    finally:
        await pool.aclose()
        backend.sock.close()
        ours.close()


@pytest.fixture
def feeds(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """What each parse (one ``feed_data`` of llhttp) was given, in order."""
    seen: list[bytes] = []
    feed = h1.Response._feed

    def counting(self: h1.Response, data: bytes) -> None:
        seen.append(data)
        feed(self, data)

    monkeypatch.setattr(h1.Response, "_feed", counting)
    return seen


async def test_many_small_records_at_once_are_one_parse_and_one_piece(feeds: list[bytes]) -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    async with tls_pair() as (pool, backend), trio.open_nursery() as nursery:
        # The head, 20 events and the end: 22 records, in one send.
        burst = (head, *(chunk(e) for e in EVENTS), b"0\r\n\r\n")
        nursery.start_soon(backend.answer, burst)
        with trio.fail_after(5):
            async with pool.request(HEAD, b"{}", T) as r:
                assert r.status == 200
                pieces = [piece async for piece in r]
    assert b"".join(pieces) == b"".join(EVENTS)
    assert r.complete
    # One read took the whole burst: llhttp parsed it once and the body went on as one
    # piece (an SSLSocket read a record at a time: 22 parses, 20 pieces).
    assert len(feeds) == 1, [len(f) for f in feeds]
    assert len(pieces) == 1, [len(p) for p in pieces]
    # Every read found bytes: the server's handshake flight, then the session tickets and
    # the burst (together, or the tickets first). After a read that took all there was,
    # the next one waits for more before it asks.
    assert backend.client is not None
    assert backend.client.would_block == 0
    assert backend.client.reads in (2, 3)


async def test_a_record_that_has_not_come_is_not_waited_for() -> None:
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    got_first = trio.Event()
    async with tls_pair() as (pool, backend), trio.open_nursery() as nursery:

        async def script() -> None:
            await backend.handshake_and_request()
            first = backend.records(head, chunk(EVENTS[0]))
            rest = backend.records(chunk(EVENTS[1]), b"0\r\n\r\n")
            # The first event whole, the second's record cut in two until the first is read.
            await backend.send(first + rest[:10])
            await got_first.wait()
            await backend.send(rest[10:])

        nursery.start_soon(script)
        with trio.fail_after(5):
            async with pool.request(HEAD, b"{}", T) as r:
                assert r.status == 200
                assert await r.__anext__() == EVENTS[0]  # it does not wait for the rest
                got_first.set()
                assert [piece async for piece in r] == [EVENTS[1]]
    assert r.complete


async def test_a_read_hands_on_at_most_read_size_and_keeps_the_rest() -> None:
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    event = b"data: " + b"x" * 992 + b"\n\n"  # 1,000 bytes, 40 of them: 40 KB in one go
    async with tls_pair() as (pool, backend), trio.open_nursery() as nursery:
        body = (head, *(chunk(event) for _ in range(40)), b"0\r\n\r\n")
        nursery.start_soon(backend.answer, body)
        with trio.fail_after(5):
            async with pool.request(HEAD, b"{}", T) as r:
                pieces = [piece async for piece in r]
    assert b"".join(pieces) == event * 40
    assert max(map(len, pieces)) <= h1.READ_SIZE  # what a held stream holds stays bounded
    assert len(pieces) < 10  # and not a record at a time


async def test_the_backend_closing_mid_body_is_an_error_and_the_connection_is_not_kept() -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n"
    async with tls_pair() as (pool, backend), trio.open_nursery() as nursery:
        nursery.start_soon(backend.answer, (head, b"half"))
        with trio.fail_after(5):
            async with pool.request(HEAD, b"{}", T) as r:
                assert await r.__anext__() == b"half"
                backend.sock.close()  # no close_notify: the connection just ends
                with pytest.raises(h1.RemoteProtocolError, match="before the end"):
                    await r.__anext__()
        assert pool.connections() == (0, 0)


async def test_a_connection_read_to_its_end_is_kept_and_the_next_request_reuses_it() -> None:
    def ok(body: bytes) -> bytes:
        return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)

    async with tls_pair() as (pool, backend), trio.open_nursery() as nursery:
        with trio.fail_after(5):
            for body in (b"ok", b"yes"):
                nursery.start_soon(backend.answer, (ok(body),))
                async with pool.request(HEAD, b"{}", T) as r:
                    assert await r.read(100) == body
                assert pool.connections() == (1, 0)  # kept, and reused by the next
    assert pool.tls is not None
    assert pool.tls.session is not None
    assert pool.tls.session.has_ticket  # a new connection would resume it


class TLSFlood(socket.socket):
    """A connected-looking socket whose TLS peer never lets it run dry: once the request
    is in, every ``recv_into`` is filled at once with records of the body (16 KiB each)."""

    def __init__(self, body: int, context: ssl.SSLContext) -> None:
        super().__init__(socket.AF_INET, socket.SOCK_STREAM)
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.obj = context.wrap_bio(self.incoming, self.outgoing, server_side=True)
        self.left = body
        self.head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % body
        self.asked = False
        self.pending = b""

    def send(self, data: Any, flags: int = 0, /) -> int:
        self.incoming.write(data)
        try:
            self.obj.do_handshake()
            self.asked = self.asked or self.obj.read(65536).endswith(b"{}")
        except ssl.SSLWantReadError:
            pass
        return len(data)

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0, /) -> int:
        if not self.pending and self.asked and self.left:
            n = min(self.left, 16384)
            self.left -= n
            self.obj.write(self.head + b"x" * n)
            self.head = b""
        self.pending += self.outgoing.read()
        if not self.pending:
            raise BlockingIOError
        n = min(len(buffer), len(self.pending))
        buffer[:n] = self.pending[:n]
        self.pending = self.pending[n:]
        return n


async def test_a_tls_backend_that_never_lets_the_socket_run_dry_cannot_hold_the_loop() -> None:
    # Without a checkpoint every CHECKPOINT_BYTES, all 16 MiB would be read, decrypted
    # and parsed in one step of the task: no other task would run meanwhile.
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("up.test").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    body = 16 << 20
    flood = TLSFlood(body, server_ctx)

    async def connect() -> socket.socket:
        return flood

    pool = h1.H1Pool(
        "up.test", 443, max_connections=1, connect=connect, tls=TLSSettings(client_ctx, "up.test")
    )
    moved = 0
    gaps: list[int] = []
    done = False

    async def other_task() -> None:
        last = moved
        while not done:
            await trio.lowlevel.checkpoint()
            gaps.append(moved - last)
            last = moved

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_task)
        async with pool.request(HEAD, b"{}", T) as r:
            async for part in r:
                moved += len(part)
        done = True
    assert moved == body
    assert len(gaps) > body // h1.CHECKPOINT_BYTES // 2
    # Two windows at most between two steps of the other task (see test_h1's flood).
    assert max(gaps) <= 2 * (h1.CHECKPOINT_BYTES + h1.READ_SIZE)
    await pool.aclose()
