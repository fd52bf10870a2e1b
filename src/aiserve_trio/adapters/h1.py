"""A lean HTTP/1.1 client for one job: a request to a model backend, its reply streamed.

The ``openai`` adapter uses it for plain ``http://`` backends over HTTP/1.1 (httpx2
stays for ``https://`` and HTTP/2). It does only what that needs, and measured
(``python -m bench.h1_client``) one request with it costs a fraction of one through
httpx2's layers (send, redirects, auth, transport, pool, connection, h11):

- a keep-alive pool per backend: idle connections are reused newest first, a
  connection idle past ``keepalive_expiry`` or that the server closed (it is
  readable while idle) is dropped first, and at most ``max_connections`` are busy
  at once (more requests wait, until their time runs out: :class:`PoolTimeout`);
- the request head is built by the caller from a prefix made once
  (:class:`RequestHead`) and goes out with the body in one write;
- the response is parsed by llhttp (``httptools``, C), sans-IO: each network read
  is fed to the parser, and the body bytes it held (chunked framing removed,
  gzip or deflate decoded) are handed on as one piece;
- timeouts as httpx2 has them: connect, and each write and read bounded by the
  time the caller gives (:class:`Timeouts`);
- on a TCP connection, a write or read the socket can do at once is done at once
  (a non-blocking ``send`` or ``recv``): Trio's stream layer, its checkpoints and a
  cancel scope are only for the write or read that has to wait.

Cancel safety: a connection goes back to the pool only when its response was read
to the end (and nothing after it) and both sides may keep it open. A response
left early -- cancelled, failed, or simply not read to the end -- closes its
connection, so a half-read connection is never handed to the next request.

A request on a reused connection that the server closed before answering (the
keep-alive race: it closed the idle connection as the request went out) is sent
once more on a new connection. Nothing of the reply has been read then, so the
backend never saw it as a request it answered.
"""

from __future__ import annotations

import select
import socket
import zlib
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Final, final

import httptools
import trio

__all__ = [
    "ConnectError",
    "ConnectTimeout",
    "H1Error",
    "H1Pool",
    "H1Timeout",
    "HeaderError",
    "PoolTimeout",
    "ReadError",
    "ReadTimeout",
    "RemoteProtocolError",
    "RequestHead",
    "Response",
    "Timeouts",
    "WriteError",
    "WriteTimeout",
]

#: Bytes asked of the socket per read.
READ_SIZE: Final = 65536


class H1Error(Exception):
    """Any failure of an exchange."""


class ConnectError(H1Error):
    """The backend could not be connected to."""


class ReadError(H1Error):
    """The connection broke while the response was read."""


class WriteError(H1Error):
    """The connection broke while the request was written."""


class RemoteProtocolError(H1Error):
    """The backend broke HTTP/1.1: a malformed response, or closed before its end."""


class HeaderError(H1Error, ValueError):
    """A header name or value would break the request head (CR, LF or NUL in it)."""


class H1Timeout(H1Error):
    """A step took longer than it was given."""


class ConnectTimeout(H1Timeout):
    pass


class PoolTimeout(H1Timeout):
    pass


class WriteTimeout(H1Timeout):
    pass


class ReadTimeout(H1Timeout):
    pass


@final
class Timeouts:
    """Seconds each step may take: ``connect``; ``io`` for each write, each read, and
    the wait for a free connection. Relative, like httpx2's, so that a caller's own
    deadline (a cancel scope) fires first when both are the same."""

    __slots__ = ("connect", "io")

    def __init__(self, io: float, connect: float) -> None:
        self.io = io
        self.connect = connect


def _check(part: bytes, what: str) -> bytes:
    if b"\r" in part or b"\n" in part or b"\0" in part:
        raise HeaderError(f"a header {what} may not contain CR, LF or NUL: {part[:40]!r}")
    return part


@final
class RequestHead:
    """The head of one kind of request, its fixed part encoded once.

    :meth:`build` adds the per-request headers and ``content-length``.
    """

    __slots__ = ("_prefix",)

    def __init__(
        self, method: str, target: str, host: str, headers: list[tuple[bytes, bytes]]
    ) -> None:
        """Args:
        method: ``GET`` or ``POST``.
        target: the path (and query) as it goes on the request line.
        host: the ``Host`` header (``name`` or ``name:port``).
        headers: fixed headers, names in lower case (checked for CR, LF and NUL).

        Raises:
            HeaderError: a name or value would break the head.
        """
        lines = [f"{method} {target} HTTP/1.1\r\nhost: {host}\r\n".encode("ascii")]
        lines += [_check(k, "name") + b": " + _check(v, "value") + b"\r\n" for k, v in headers]
        self._prefix = b"".join(lines)

    def build(self, headers: list[tuple[bytes, bytes]], body: bytes | None) -> bytes:
        """The whole head: the fixed part, ``headers``, and the body's length when it has one.

        Raises:
            HeaderError: a name or value would break the head (e.g. a forwarded value).
        """
        out = [self._prefix]
        for k, v in headers:
            out.append(_check(k, "name") + b": " + _check(v, "value") + b"\r\n")
        if body is not None:
            out.append(b"content-length: %d\r\n" % len(body))
        out.append(b"\r\n")
        return b"".join(out)


class _Conn:
    """One connection to the backend.

    ``sock``: the connection's socket when it is TCP (its stream's own socket object,
    non-blocking), for the writes and reads that need not wait; None for other streams.
    """

    __slots__ = ("idle_since", "sock", "stream")

    def __init__(self, stream: trio.abc.Stream, sock: socket.socket | None = None) -> None:
        self.stream = stream
        self.sock = sock
        self.idle_since = 0.0

    def closed_by_peer(self) -> bool:
        """Whether an idle connection has something to read: the server closed it (or
        sent what it should not have). Only a socket can tell; others are trusted."""
        if not isinstance(self.stream, trio.SocketStream):
            return False
        try:
            readable, _, _ = select.select([self.stream.socket.fileno()], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)


Connector = Callable[[], Awaitable[trio.abc.Stream]]


def _with_socket(stream: trio.abc.Stream) -> _Conn:
    """A connection of ``stream``; a TCP one keeps its socket for direct writes and reads.

    The socket is taken out of Trio's wrapper (``detach``) and wrapped again around a
    stdlib socket object this module keeps: one descriptor, one owner that closes it.
    """
    if not isinstance(stream, trio.SocketStream):
        return _Conn(stream)
    wrapped = stream.socket
    sock = socket.socket(wrapped.family, wrapped.type, wrapped.proto, fileno=wrapped.detach())
    sock.setblocking(False)
    # trio.SocketStream sets TCP_NODELAY on the socket it wraps: the request goes at once.
    return _Conn(trio.SocketStream(trio.socket.from_stdlib_socket(sock)), sock)


class H1Pool:
    """Keep-alive connections to one backend, and the way to make a request on them."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_connections: int,
        keepalive_expiry: float = 30.0,
        connect: Connector | None = None,
    ) -> None:
        """Args:
        host, port: where the backend listens (plain TCP).
        max_connections: connections busy at once; more requests wait their turn.
        keepalive_expiry: seconds an idle connection is kept.
        connect: makes a new connection (tests hand in memory streams); default TCP.
        """
        self.host = host
        self.port = port
        self.keepalive_expiry = keepalive_expiry
        self._connect = connect if connect is not None else self._tcp
        self._slots = trio.Semaphore(max_connections)
        self._idle: list[_Conn] = []
        self.busy = 0
        self._closed = False

    async def _tcp(self) -> trio.abc.Stream:
        return await trio.open_tcp_stream(self.host, self.port)

    def connections(self) -> tuple[int, int]:
        """(open connections, of which busy)."""
        return len(self._idle) + self.busy, self.busy

    def request(self, head: bytes, body: bytes, timeouts: Timeouts) -> Response:
        """The exchange, as an async context manager: entering it sends the request and
        reads the response head; iterating the response yields its body; leaving it
        gives the connection back or closes it (see the module docstring)."""
        return Response(self, head, body, timeouts)

    async def aclose(self) -> None:
        """Close the idle connections; busy ones close when their response is left."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            await trio.aclose_forcefully(conn.stream)

    # --- used by Response ------------------------------------------------------------

    async def _take(self, timeouts: Timeouts) -> None:
        """A slot for one exchange (waits while ``max_connections`` are busy)."""
        try:
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            with trio.move_on_after(timeouts.io) as waited:
                await self._slots.acquire()
            if waited.cancelled_caught:
                raise PoolTimeout("no connection to the backend came free in time") from None
        self.busy += 1

    def _give(self) -> None:
        self.busy -= 1
        self._slots.release()

    def _reuse(self) -> _Conn | None:
        """The newest idle connection still fit to use; the others it passed are closed."""
        idle = self._idle
        while idle:
            conn = idle.pop()
            if (
                trio.current_time() - conn.idle_since < self.keepalive_expiry
                and not conn.closed_by_peer()
            ):
                return conn
            _close_now(conn.stream)
        return None

    async def _new(self, timeouts: Timeouts) -> _Conn:
        with trio.move_on_after(timeouts.connect) as waited:
            try:
                stream = await self._connect()
            except OSError as exc:
                raise ConnectError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        if waited.cancelled_caught:
            raise ConnectTimeout(f"connecting to {self.host}:{self.port} timed out")
        return _with_socket(stream)

    def _keep(self, conn: _Conn) -> None:
        if self._closed:
            _close_now(conn.stream)
            return
        conn.idle_since = trio.current_time()
        self._idle.append(conn)


def _close_now(stream: trio.abc.Stream) -> None:
    """Close without a checkpoint (a socket's descriptor is closed at once)."""
    if isinstance(stream, trio.SocketStream):
        stream.socket.close()
        return
    # Another stream (a test's memory streams): the halves' own close, if they have one.
    halves = (
        (stream.send_stream, stream.receive_stream)
        if isinstance(stream, trio.StapledStream)
        else (stream,)
    )
    for half in halves:
        close = getattr(half, "close", None)
        if close is not None:
            close()


class Response:
    """One exchange: the response's status and headers, then its body by iteration.

    The parser calls the ``on_*`` methods (llhttp's callbacks) as it reads.
    """

    __slots__ = (
        "_body",
        "_complete",
        "_conn",
        "_decoder",
        "_extra",
        "_framed",
        "_head",
        "_headers_done",
        "_keep_alive",
        "_parser",
        "_pool",
        "_request_body",
        "_slot",
        "_timeouts",
        "headers",
        "status",
    )

    def __init__(self, pool: H1Pool, head: bytes, body: bytes, timeouts: Timeouts) -> None:
        self._pool = pool
        self._head = head
        self._request_body = body
        self._timeouts = timeouts
        self._conn: _Conn | None = None
        self._slot = False
        self.status = 0
        #: The response's headers, names in lower case, in order.
        self.headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._headers_done = False
        self._keep_alive = False
        self._complete = False
        #: Content-Length or chunked: the body's end is known without the connection's.
        self._framed = False
        self._decoder: zlib._Decompress | None = None
        self._extra = False
        # The parser holds this object's callbacks: a cycle, broken in _release so that
        # both go with their last reference, not with the next garbage collection.
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)

    # --- llhttp's callbacks ----------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert parser is not None  # it is the caller
        status = parser.get_status_code()
        if 100 <= status < 200:  # an informational head (103): the real one follows
            self.headers = []
            return
        self.status = status
        self._headers_done = True
        # Asked here: once the message is complete llhttp has reset what it answers from.
        self._keep_alive = parser.should_keep_alive()
        for name, value in self.headers:
            if name == b"content-length" or name == b"transfer-encoding":
                self._framed = True
            elif name == b"content-encoding":
                coding = value.strip().lower()
                if coding == b"gzip":
                    self._decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
                elif coding == b"deflate":
                    self._decoder = zlib.decompressobj()
                elif coding != b"identity":
                    raise RemoteProtocolError(f"unsupported content-encoding {coding!r}")

    def on_body(self, data: bytes) -> None:
        self._body.append(data)

    def on_message_complete(self) -> None:
        if self._headers_done:
            if self._complete:
                self._extra = True  # a second response nobody asked for
            self._complete = True

    # --- the exchange ----------------------------------------------------------------

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower case), if present."""
        for k, v in self.headers:
            if k == name:
                return v
        return None

    async def __aenter__(self) -> Response:
        pool = self._pool
        timeouts = self._timeouts
        await pool._take(timeouts)
        self._slot = True
        try:
            conn = pool._reuse()
            if conn is not None:
                self._conn = conn
                if await self._exchange(conn, reused=True):
                    return self
                # The server had closed it: once more, on a new connection.
                _close_now(conn.stream)
                self._conn = None
                self._parser = httptools.HttpResponseParser(self)
            conn = self._conn = await pool._new(timeouts)
            await self._exchange(conn, reused=False)
        except BaseException:
            self._release(keep=False)
            raise
        return self

    async def _exchange(self, conn: _Conn, *, reused: bool) -> bool:
        """Send the request and read up to the end of the response head.

        Returns False when a reused connection turned out closed before a byte
        of the response came (the caller tries a new one).
        """
        io = self._timeouts.io
        data = self._head + self._request_body
        sent = 0
        if conn.sock is not None:
            try:
                sent = conn.sock.send(data)
            except BlockingIOError:
                pass
            except OSError as exc:  # reset, broken pipe: the server closed it
                if reused:
                    return False
                raise WriteError(f"the connection broke while sending: {exc}") from exc
        if sent < len(data):  # the socket's buffer is full, or not a socket: wait
            with trio.move_on_after(io) as waited:
                try:
                    await conn.stream.send_all(data[sent:] if sent else data)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    if reused and not sent:
                        return False
                    raise WriteError(f"the connection broke while sending: {exc}") from exc
            if waited.cancelled_caught:
                raise WriteTimeout("sending the request timed out")
        first = True
        while not self._headers_done:
            data = await self._read(conn, io)
            if not data:
                if reused and first:
                    return False
                raise RemoteProtocolError("the server closed the connection without a response")
            first = False
            self._feed(data)
        return True

    async def _read(self, conn: _Conn, io: float) -> bytes:
        sock = conn.sock
        if sock is not None:
            return await self._read_socket(sock, io)
        with trio.move_on_after(io) as waited:
            try:
                return bytes(await conn.stream.receive_some(READ_SIZE))
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise ReadError(f"the connection broke while reading: {exc}") from exc
        if waited.cancelled_caught:
            raise ReadTimeout("reading the response timed out")
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    async def _read_socket(sock: socket.socket, io: float) -> bytes:
        """A read on a TCP connection: at once when there are bytes, else one wait for them."""
        while True:
            try:
                return sock.recv(READ_SIZE)
            except BlockingIOError:
                pass  # nothing yet: wait for it
            except OSError as exc:
                raise ReadError(f"the connection broke while reading: {exc}") from exc
            with trio.move_on_after(io) as waited:
                try:
                    await trio.lowlevel.wait_readable(sock)
                except trio.ClosedResourceError as exc:  # closed while waiting
                    raise ReadError(f"the connection broke while reading: {exc}") from exc
            if waited.cancelled_caught:
                raise ReadTimeout("reading the response timed out")

    def _feed(self, data: bytes) -> None:
        parser = self._parser
        if parser is None:
            raise RemoteProtocolError("the response was already left")
        try:
            parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, RemoteProtocolError):
                raise exc.__context__ from None
            raise RemoteProtocolError(f"the response could not be parsed: {exc}") from exc
        except httptools.HttpParserError as exc:
            if self._complete:  # bytes after the response: it is whole, the connection not
                self._extra = True
                return
            raise RemoteProtocolError(f"the response could not be parsed: {exc}") from exc
        except httptools.HttpParserUpgrade as exc:
            raise RemoteProtocolError("the server switched protocols") from exc

    def _take_body(self) -> bytes:
        parts = self._body
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        parts.clear()
        if self._decoder is not None:
            try:
                data = self._decoder.decompress(data)
                if self._complete:
                    data += self._decoder.flush()
            except zlib.error as exc:
                raise RemoteProtocolError(f"the response body does not decode: {exc}") from exc
        return data

    def __aiter__(self) -> Response:
        return self

    async def __anext__(self) -> bytes:
        """The body bytes of the next read(s) (never empty); the end stops iteration."""
        while True:
            if self._body:
                data = self._take_body()
                if data:
                    return data
                continue
            if self._complete:
                raise StopAsyncIteration
            conn = self._conn
            assert conn is not None
            data = await self._read(conn, self._timeouts.io)
            if not data:
                if not self._framed:  # the body ran to the connection's end
                    self._complete = True
                    self._extra = True  # and the connection is gone
                    if self._decoder is not None:
                        tail = self._decoder.flush()
                        if tail:
                            return tail
                    continue
                raise RemoteProtocolError("the server closed the connection before the end")
            self._feed(data)

    async def read(self, limit: int) -> bytes:
        """Up to about ``limit`` bytes of the body (an error body, a whole JSON answer)."""
        out = b""
        async for part in self:
            out += part
            if len(out) >= limit:
                break
        return out

    @property
    def complete(self) -> bool:
        """The whole response has been read."""
        return self._complete

    def _release(self, *, keep: bool) -> None:
        self._parser = None
        conn, self._conn = self._conn, None
        if conn is not None:
            if keep:
                self._pool._keep(conn)
            else:
                _close_now(conn.stream)
        if self._slot:
            self._slot = False
            self._pool._give()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Read to its end, the connection is clean whatever happened since (an error
        # status raised by the caller, a cancel after the last byte).
        self._release(keep=self._complete and not self._extra and self._keep_alive)
