"""A lean HTTP/1.1 client for one job: a request to a model backend, its reply streamed.

Every HTTP adapter uses it, through ``transport.py``, for ``http://`` and ``https://``
backends over HTTP/1.1; the HTTP/2 client (``h2client.py``) reuses its connection's socket
I/O (``_Conn``, ``_send_raw``, ``_fill``, ``_wait``, ``_fair``), its TLS (``_handshake``,
``_Secure``), :class:`Timeouts`, :func:`check_header` and its exceptions. It does only
what that needs, and measured (docs/benchmarks.md, h1 client) one request with it costs a
fraction of one through httpx2's layers (send, redirects, auth, transport, pool, connection, h11):

- a keep-alive pool per backend: idle connections are reused newest first, a
  connection idle past ``keepalive_expiry`` or that the server closed (it is
  readable while idle) is dropped first, and at most ``max_connections`` are busy
  at once (more requests wait, until their time runs out: :class:`PoolTimeout`);
- with ``max_connecting``, at most that many connections are being opened at once
  (connect and TLS handshake): a request that needs a new one waits for a connect slot,
  within its connect timeout, and when one comes takes an idle connection given back
  meanwhile if there is one. Off by default: on a backend whose listen backlog a storm
  of new streams overflows, the kernel completes a connect before the backend accepts
  it, so the bound does not keep the accept queue from filling; it cut the dropped SYNs
  tenfold but made the storm's requests wait out their connect timeout in its queue
  (docs/performance.md, "Ten thousand held streams");
- the request head is built by the caller from a prefix made once
  (:class:`RequestHead`) and goes out with the body in one write;
- the response is parsed by llhttp (``httptools``, C), sans-IO: each network read
  is fed to the parser, and the body bytes it held (chunked framing removed,
  gzip or deflate decoded) are handed on as one piece;
- timeouts as httpx2 has them: connect, and each write and read bounded by the
  time the caller gives (:class:`Timeouts`);
- on a TCP connection, plain or TLS, a write or read the socket can do at once is
  done at once (a non-blocking ``send`` or ``recv``); Trio's waits and a cancel scope
  are only for the one that has to wait, and each connection reaches a checkpoint
  every ``CHECKPOINT_BYTES`` it moves, so that a backend that never lets the socket
  run dry cannot hold the loop;
- TLS is an ``ssl.SSLObject`` over memory BIOs on the plain socket (the context,
  verification and the session to resume come from ``tls.py``): one ``recv_into``
  takes all the kernel has, every complete record in it is decrypted, and the parser
  gets their bytes as one piece. A backend writes each SSE event as a record of its
  own; an ``ssl.SSLSocket`` read each record with its own syscalls and handed each on
  alone (35 reads a request where plain HTTP made 3.8). A read never waits for a
  record that has not come when one before it has.

Cancel safety: a connection goes back to the pool only when its response was read
to the end (and nothing after it) and both sides may keep it open. A response
left early -- cancelled, failed, or simply not read to the end -- closes its
connection, so a half-read connection is never handed to the next request.

A request is sent once more, on a new connection, only when no byte of it can
have been processed: the reused connection broke before a byte of it went out
(``H1Pool.resent`` counts these). A reused connection the server closed after the
request went out (the keep-alive race) raises :class:`ClosedAfterSend`: the
backend may have acted on it, so whether to try again is the adapter's retry
rules' call (they retry it as a connect error, and count it).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import zlib
from collections.abc import AsyncIterable, Awaitable, Callable
from types import TracebackType
from typing import Final, final

import httptools
import trio

from .tls import TLSSettings, reason

__all__ = [
    "ClosedAfterSend",
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
    "TLSError",
    "Timeouts",
    "WriteError",
    "WriteTimeout",
    "check_header",
]

#: Bytes asked of the socket per read: what one stream holds while its client does not
#: read is a few of these (the read, its deltas in the inference -> sse channel, the
#: events written), so it bounds a held stream's memory. A reply's text is read in
#: pieces of at most this much, over TLS too (the records one read decrypts are handed
#: on up to this much; the rest stay for the next read).
#: 64 KiB reads of a fast backend's 1 KiB deltas held ~0.7 MB a blocked stream
#: (docs/benchmarks.md, h2 window with --delta-bytes 1024; docs/hypercorn.md).
READ_SIZE: Final = 16384

#: Bytes asked of a TLS connection's socket per read: a whole record of the largest
#: size (16 KiB of data, its 5-byte header, up to 256 bytes of padding and tag) fits.
TLS_READ_SIZE: Final = READ_SIZE + 5 + 256


class H1Error(Exception):
    """Any failure of an exchange."""


class ConnectError(H1Error):
    """The backend could not be connected to."""


class ReadError(H1Error):
    """The connection broke while the response was read."""


class ClosedAfterSend(ReadError):
    """A reused connection closed after the request went out and before a byte of the
    response came: the backend may have seen the request, so it is not sent again
    here; the adapter's retry rules decide."""


class TLSError(ConnectError):
    """TLS with the backend failed (the handshake, or an alert it sent); ``reason`` in words."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


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


def check_header(part: bytes, what: str) -> bytes:
    """``part`` (a header's ``name`` or ``value``, as ``what`` says) if it cannot break a
    request: no CR, LF or NUL (HTTP/2's encoding would carry them; servers refuse them).

    Raises:
        HeaderError: it has one.
    """
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
        lines += [
            check_header(k, "name") + b": " + check_header(v, "value") + b"\r\n" for k, v in headers
        ]
        self._prefix = b"".join(lines)

    def build(self, headers: list[tuple[bytes, bytes]], body: bytes | None) -> bytes:
        """The whole head: the fixed part, ``headers``, and the body's length when it has one.

        Raises:
            HeaderError: a name or value would break the head (e.g. a forwarded value).
        """
        out = [self._prefix]
        for k, v in headers:
            out.append(check_header(k, "name") + b": " + check_header(v, "value") + b"\r\n")
        if body is not None:
            out.append(b"content-length: %d\r\n" % len(body))
        out.append(b"\r\n")
        return b"".join(out)


@final
class _Secure:
    """TLS on a connection: the ``SSLObject``, its memory BIOs and the buffer a read lands in."""

    __slots__ = ("buf", "drained", "ended", "incoming", "obj", "outgoing", "view")

    def __init__(
        self, obj: ssl.SSLObject, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO
    ) -> None:
        self.obj = obj
        self.incoming = incoming  # ciphertext read from the socket, not yet decrypted
        self.outgoing = outgoing  # ciphertext to write to the socket
        self.buf = bytearray(TLS_READ_SIZE)
        self.view = memoryview(self.buf)
        #: The backend ended the TLS stream (close_notify, or the connection closed).
        self.ended = False
        #: The last read took less than it asked: the kernel had no more then, and the
        #: next read waits for more rather than ask for it (a read that would block is a
        #: syscall for nothing; a wait answers at once if bytes came since).
        self.drained = True

    def decrypt(self) -> bytes | None:
        """The bytes of every complete record the incoming BIO holds, as one piece (at
        most ``READ_SIZE``; the rest stays for the next call).

        Returns:
            The bytes; ``b""`` when the backend ended the stream and nothing is left;
            None when no whole record is there yet.

        Raises:
            TLSError: the backend sent an alert, or a record does not decrypt.
        """
        obj = self.obj
        incoming = self.incoming
        parts: list[bytes] = []
        n = 0
        try:
            # OpenSSL takes a record's bytes from the BIO as far as they go (a partial one
            # into its own buffer): with none left, and no plaintext held back by the
            # bound, nothing more decrypts now, and a read would only raise WantRead.
            while (
                n < READ_SIZE
                and not self.ended
                and (incoming.pending or incoming.eof or obj.pending())
            ):
                part = obj.read(READ_SIZE - n)
                if not part:
                    self.ended = True
                    break
                parts.append(part)
                n += len(part)
        except ssl.SSLWantReadError:
            pass
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
            # close_notify, or a close without it (as SSLSocket's suppress_ragged_eofs
            # took it): the end of the stream; HTTP's framing says whether it was whole.
            self.ended = True
        except ssl.SSLError as exc:
            raise TLSError(reason(exc)) from exc
        if parts:
            return parts[0] if len(parts) == 1 else b"".join(parts)
        return b"" if self.ended else None

    def take(self, n: int) -> None:
        """Hand the first ``n`` bytes of :attr:`buf` (just read) to the TLS engine; 0: EOF."""
        self.drained = n < len(self.buf)
        if n:
            self.incoming.write(self.view[:n])
        else:
            self.incoming.write_eof()


class _Conn:
    """One connection to the backend.

    ``sock``: on TCP, the connection's own socket (non-blocking): every write and read
    is made on it directly, and waits with Trio only when it must; ``tls`` its TLS, if
    it speaks it. ``stream``: any other stream (a test's memory streams), through Trio.
    """

    __slots__ = ("idle_since", "session_kept", "sock", "stream", "tls", "tls13", "unyielded")

    def __init__(
        self,
        stream: trio.abc.Stream | None = None,
        sock: socket.socket | None = None,
        tls: _Secure | None = None,
    ) -> None:
        self.stream = stream
        self.sock = sock
        self.tls = tls
        self.idle_since = 0.0
        #: Bytes moved since this connection's loop last reached a checkpoint.
        self.unyielded = 0
        #: It speaks TLS 1.3 (known once the handshake is done).
        self.tls13 = tls is not None and tls.obj.version() == "TLSv1.3"
        #: Its TLS session is kept for the next new connection: asked once, since
        #: reading ``SSLObject.session`` copies the session (certificates and all).
        self.session_kept = False

    def closed_by_peer(self) -> bool:
        """Whether an idle connection has something to read: the server closed it (or
        sent what it should not have). Only a socket can tell; others are trusted.

        On TLS a readable socket may hold only session tickets (TLS 1.3 sends them
        after the handshake): they are taken in, and the connection is still good.
        """
        sock = self.sock
        if sock is None:
            return False
        tls = self.tls
        try:
            if tls is not None and tls.incoming.pending and tls.decrypt() is not None:
                return True  # left over from the last read: data, or the end
            # A peek, not select(): select() cannot take a descriptor above 1023 (it
            # raised, and every idle connection of a worker with a thousand clients
            # was taken for closed: a new upstream connection for each request).
            try:
                sock.recv(1, socket.MSG_PEEK)  # the socket is non-blocking
            except BlockingIOError:
                return False  # nothing to read: open and clean
            if tls is None:
                return True  # b"": the end; bytes: what it should not have sent
            tls.take(sock.recv_into(tls.buf))
            return tls.decrypt() is not None  # None: tickets only, nothing left over
        except (OSError, ValueError, TLSError):
            return True

    def close(self) -> None:
        """Close at once, without a checkpoint."""
        if self.sock is not None:
            self.sock.close()
        elif self.stream is not None:
            _close_stream(self.stream)


#: Makes a connection: a Trio stream (a TCP one gets the direct path) or a connected,
#: non-blocking socket.
Connector = Callable[[], Awaitable[trio.abc.Stream | socket.socket]]


def _detached(stream: trio.SocketStream) -> socket.socket:
    """The stdlib socket of ``stream``, taken out of Trio's wrapper: one descriptor,
    one owner (this module) that closes it. Non-blocking; TCP_NODELAY as Trio set it."""
    wrapped = stream.socket
    sock = socket.socket(wrapped.family, wrapped.type, wrapped.proto, fileno=wrapped.detach())
    sock.setblocking(False)
    return sock


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
        tls: TLSSettings | None = None,
        max_connecting: int | None = None,
    ) -> None:
        """Args:
        host, port: where the backend listens.
        max_connections: connections busy at once; more requests wait their turn.
        keepalive_expiry: seconds an idle connection is kept.
        connect: makes a new connection (tests hand in memory streams); default TCP.
        tls: speak TLS on each TCP connection (its context, name and session store).
        max_connecting: connections being opened (connect and TLS handshake) at once;
            a request that needs a new one past these waits its turn, within its
            connect timeout (see the module docstring). None (the default): no bound --
            measured, a bound did not keep a connect storm off a small listen backlog
            and its waits became connect timeouts (docs/performance.md, "Ten thousand
            held streams").

        Raises:
            ValueError: ``max_connecting`` is below 1.
        """
        if max_connecting is not None and max_connecting < 1:
            raise ValueError(f"max_connecting must be at least 1, not {max_connecting}")
        self.host = host
        self.port = port
        self.keepalive_expiry = keepalive_expiry
        self.tls = tls
        self._connect = connect
        self._slots = trio.Semaphore(max_connections)
        self._connecting = None if max_connecting is None else trio.Semaphore(max_connecting)
        self._idle: list[_Conn] = []
        self.busy = 0
        self._closed = False
        #: Requests sent again on a new connection because a reused one was closed
        #: before any of it could be read (see the module docstring).
        self.resent = 0

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
            conn.close()
        await trio.lowlevel.checkpoint()

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
            conn.close()
        return None

    async def _open(self, timeouts: Timeouts, *, reuse: bool) -> tuple[_Conn, bool]:
        """A connection for a request that found none idle: (it, whether it was idle).

        Waits for one of the ``max_connecting`` connect slots; when one comes, an idle
        connection given back meanwhile is taken (if ``reuse``) and the slot passed on,
        else a new connection is opened in it. ``timeouts.connect`` bounds the wait and
        the connect together.

        Raises:
            ConnectTimeout: no connection within ``timeouts.connect``.
            ConnectError, TLSError: the connect or the handshake failed.
        """
        with trio.move_on_after(timeouts.connect):
            if self._connecting is None:  # nothing waited for: no idle one came meanwhile
                return await self._new(), False
            async with self._connecting:
                if reuse:
                    conn = self._reuse()
                    if conn is not None:
                        return conn, True
                return await self._new(), False
        raise ConnectTimeout(f"connecting to {self.host}:{self.port} timed out")

    async def _new(self) -> _Conn:
        """A new connection (the caller bounds the time and holds a connect slot)."""
        where = f"{self.host}:{self.port}"
        try:
            if self._connect is not None:
                made = await self._connect()
            else:
                made = await trio.open_tcp_stream(self.host, self.port)
        except OSError as exc:
            raise ConnectError(f"cannot connect to {where}: {exc}") from exc
        if isinstance(made, trio.SocketStream):
            made = _detached(made)
        if not isinstance(made, socket.socket):
            return _Conn(stream=made)  # a test's memory streams
        if self.tls is None:
            return _Conn(sock=made)
        try:
            return _Conn(sock=made, tls=await _handshake(made, self.tls))
        except BaseException:
            made.close()
            raise

    def _keep(self, conn: _Conn) -> None:
        if self._closed:
            conn.close()
            return
        if self.tls is not None and not conn.session_kept and conn.tls is not None:
            conn.session_kept = self.tls.keep_session(conn.tls.obj)
        conn.idle_since = trio.current_time()
        self._idle.append(conn)


async def _handshake(sock: socket.socket, tls: TLSSettings) -> _Secure:
    """TLS over ``sock``, the handshake done (resuming the backend's last session if any).
    The caller closes ``sock`` if this raises.

    Raises:
        TLSError: the handshake failed (the reason in words: :func:`tls.reason`).
        ConnectError: the connection broke during it.
    """
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    try:
        obj = tls.context.wrap_bio(
            incoming, outgoing, server_hostname=tls.server_name, session=tls.session
        )
    except ssl.SSLError as exc:
        raise TLSError(reason(exc)) from exc
    secure = _Secure(obj, incoming, outgoing)
    try:
        while True:
            try:
                obj.do_handshake()
                done = True
            except ssl.SSLWantReadError:
                done = False
            except ssl.SSLError as exc:
                raise TLSError(reason(exc)) from exc
            if outgoing.pending:
                await _send_all(sock, outgoing.read())
            if done:
                break
            while True:
                if secure.drained:  # the answer to a flight just sent is not there yet
                    await trio.lowlevel.wait_readable(sock)
                try:
                    secure.take(sock.recv_into(secure.buf))
                    break
                except BlockingIOError:
                    secure.drained = True
    except OSError as exc:
        raise ConnectError(f"the connection broke during the TLS handshake: {exc}") from exc
    tls.handshake_done(obj)
    return secure


async def _send_all(sock: socket.socket, data: bytes) -> None:
    """All of ``data`` on ``sock``, waiting for room as needed (the handshake's flights)."""
    view = memoryview(data)
    sent = 0
    while sent < len(data):
        try:
            sent += sock.send(view[sent:])
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)


def _close_stream(stream: trio.abc.Stream) -> None:
    """Close a (test's) stream without a checkpoint: the halves' own close, if they have one."""
    halves = (
        (stream.send_stream, stream.receive_stream)
        if isinstance(stream, trio.StapledStream)
        else (stream,)
    )
    for half in halves:
        close = getattr(half, "close", None)
        if close is not None:
            close()


# --- direct socket I/O ----------------------------------------------------------------
#
# A write or read the socket can do at once is done at once (a non-blocking ``send``
# or ``recv``, plain or TLS); only one that must wait goes through Trio. A peer that
# keeps the socket busy could keep such a loop from ever waiting, so each connection
# counts what it moved and reaches a checkpoint every CHECKPOINT_BYTES.

#: Bytes a connection may move without reaching a Trio checkpoint (see docs/architecture.md,
#: "The upstream transport": the cost of moving them is far below the 20 ms bound).
CHECKPOINT_BYTES: Final = 1 << 20


class _Unsent(WriteError):
    """The connection broke before a byte of the request went out."""


async def _fair(conn: _Conn, moved: int) -> None:
    conn.unyielded += moved
    if conn.unyielded >= CHECKPOINT_BYTES:
        conn.unyielded = 0
        await trio.lowlevel.checkpoint()


async def _wait(
    wait: Callable[[socket.socket], Awaitable[None]],
    conn: _Conn,
    sock: socket.socket,
    io: float,
    too_slow: type[H1Timeout],
) -> None:
    conn.unyielded = 0  # waiting is a checkpoint
    with trio.move_on_after(io) as waited:
        try:
            await wait(sock)
        except trio.ClosedResourceError as exc:  # closed while waiting
            raise ReadError(f"the connection was closed while waiting: {exc}") from exc
    if waited.cancelled_caught:
        what = "sending the request" if too_slow is WriteTimeout else "reading the response"
        raise too_slow(f"{what} timed out")


def _alert(conn: _Conn) -> None:
    """After a write failed on TLS: the backend's alert, if one came (a refused client
    certificate shows up here under TLS 1.3), raised as :class:`TLSError`."""
    tls, sock = conn.tls, conn.sock
    if tls is None or sock is None:
        return
    with contextlib.suppress(OSError):
        tls.take(sock.recv_into(tls.buf))
    tls.decrypt()


#: What a new TLS 1.3 connection that ended before any session ticket most likely was.
_REFUSED_WITHOUT_ALERT = (
    "the backend closed the connection right after the TLS handshake, before any "
    "session ticket: it refused the client certificate without an alert"
)


def _dropped_after_handshake(conn: _Conn) -> bool:
    """Whether a new TLS 1.3 connection was closed before the backend sent even a session
    ticket: the sign of a refused client certificate from a backend that closes without
    an alert (Trio's TLS server does). A backend that accepted the handshake sends its
    tickets at once; one that refused the certificate never gets that far."""
    if not conn.tls13 or conn.tls is None:
        return False
    session = conn.tls.obj.session
    return session is None or not session.has_ticket


async def _send_socket(conn: _Conn, sock: socket.socket, data: bytes, io: float) -> None:
    """``data`` on the socket (encrypted first on TLS): at once what it takes, the rest
    after a wait for room."""
    tls = conn.tls
    if tls is not None:
        data = await _encrypt(conn, sock, tls, data, io)
    await _send_raw(conn, sock, data, io)


async def _send_raw(conn: _Conn, sock: socket.socket, data: bytes, io: float) -> None:
    view = memoryview(data)
    sent = 0
    while sent < len(data):
        try:
            n = sock.send(view[sent:] if sent else view)
        except BlockingIOError:
            await _wait(trio.lowlevel.wait_writable, conn, sock, io, WriteTimeout)
            continue
        except OSError as exc:  # reset, broken pipe: the server closed it
            _alert(conn)  # the backend's own reason, if it sent one
            error = _Unsent if sent == 0 else WriteError
            raise error(f"the connection broke while sending: {exc}") from exc
        sent += n
        await _fair(conn, n)


async def _encrypt(conn: _Conn, sock: socket.socket, tls: _Secure, data: bytes, io: float) -> bytes:
    """``data`` as TLS records (the memory BIO takes them all at once)."""
    view = memoryview(data)
    done = 0
    out: list[bytes] = []
    while done < len(data):
        try:
            done += tls.obj.write(view[done:])
        except ssl.SSLWantReadError:
            # A TLS 1.2 renegotiation the backend began: its flight, then its answer.
            out.append(tls.outgoing.read())
            await _send_raw(conn, sock, b"".join(out), io)
            out.clear()
            await _fill(conn, sock, tls, io)
        except ssl.SSLError as exc:
            raise TLSError(reason(exc)) from exc
    out.append(tls.outgoing.read())
    return b"".join(out)


async def _fill(conn: _Conn, sock: socket.socket, tls: _Secure, io: float) -> None:
    """One read of what the kernel has into the TLS engine (after a wait, if it has nothing
    or the last read took all it had)."""
    if tls.drained:
        await _wait(trio.lowlevel.wait_readable, conn, sock, io, ReadTimeout)
    while True:
        try:
            n = sock.recv_into(tls.buf)
        except BlockingIOError:
            await _wait(trio.lowlevel.wait_readable, conn, sock, io, ReadTimeout)
            continue
        except OSError as exc:
            raise ReadError(f"the connection broke while reading: {exc}") from exc
        tls.take(n)
        return


async def _send_stream(conn: _Conn, data: bytes, io: float) -> None:
    assert conn.stream is not None
    with trio.move_on_after(io) as waited:
        try:
            await conn.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise _Unsent(f"the connection broke while sending: {exc}") from exc
    if waited.cancelled_caught:
        raise WriteTimeout("sending the request timed out")


async def _read_socket(conn: _Conn, sock: socket.socket, io: float) -> bytes:
    """A read on a TCP connection: at once when there are bytes, else one wait."""
    tls = conn.tls
    if tls is not None:
        return await _read_tls(conn, sock, tls, io)
    while True:
        try:
            data = sock.recv(READ_SIZE)
        except BlockingIOError:
            await _wait(trio.lowlevel.wait_readable, conn, sock, io, ReadTimeout)
            continue
        except OSError as exc:
            raise ReadError(f"the connection broke while reading: {exc}") from exc
        await _fair(conn, len(data))
        return data


async def _read_tls(conn: _Conn, sock: socket.socket, tls: _Secure, io: float) -> bytes:
    """A read on a TLS connection: the records already whole, else one read of all the
    kernel has (after one wait, if it has nothing) and every record it completes.

    Never waits while a whole record is there: what came is handed on before what is
    still coming is waited for.
    """
    while True:
        data = tls.decrypt()
        if tls.ended:
            tls.outgoing.read()  # an alert about the close: there is no one to tell
        elif tls.outgoing.pending:  # the engine's own answer (a TLS 1.3 key update)
            try:
                await _send_raw(conn, sock, tls.outgoing.read(), io)
            except WriteError as exc:
                raise ReadError(f"the connection broke while reading: {exc}") from exc
        if data is not None:
            await _fair(conn, len(data))
            return data
        await _fill(conn, sock, tls, io)


def content_decoder(coding: bytes) -> zlib._Decompress | None:
    """The decoder of a ``content-encoding`` header's value (None: ``identity``).

    Raises:
        RemoteProtocolError: an encoding the gateway does not decode.
    """
    coding = coding.strip().lower()
    if coding == b"gzip":
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if coding == b"deflate":
        return zlib.decompressobj()
    if coding != b"identity":
        raise RemoteProtocolError(f"unsupported content-encoding {coding!r}")
    return None


def take_body(parts: list[bytes], decoder: zlib._Decompress | None, ended: bool) -> bytes:
    """The body bytes received in ``parts`` (emptied), decoded; ``ended``: the body's end
    came, so the decoder gives up what it still holds.

    Raises:
        RemoteProtocolError: the body does not decode.
    """
    data = parts[0] if len(parts) == 1 else b"".join(parts)
    parts.clear()
    if decoder is not None:
        try:
            data = decoder.decompress(data)
            if ended:
                data += decoder.flush()
        except zlib.error as exc:
            raise RemoteProtocolError(f"the response body does not decode: {exc}") from exc
    return data


async def read_up_to(body: AsyncIterable[bytes], limit: int) -> bytes:
    """The pieces of ``body`` until there are at least ``limit`` bytes, or its end."""
    out = b""
    async for part in body:
        out += part
        if len(out) >= limit:
            break
    return out


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
                self._decoder = content_decoder(value)

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
            reused = conn is not None
            if conn is None:
                conn, reused = await pool._open(timeouts, reuse=True)
            self._conn = conn
            if reused:
                if await self._exchange(conn, reused=True):
                    return self
                # Closed before a byte of the request went out: once more, on a new one.
                conn.close()
                self._conn = None
                self._parser = httptools.HttpResponseParser(self)
                pool.resent += 1
                conn, _ = await pool._open(timeouts, reuse=False)
                self._conn = conn
            await self._exchange(conn, reused=False)
        except BaseException:
            self._release(keep=False)
            raise
        # The head came: the request is never sent again. A stream reads its response
        # for as long as it lasts; its request's bytes (the prompt, serialized) go now.
        self._head = self._request_body = b""
        return self

    async def _exchange(self, conn: _Conn, *, reused: bool) -> bool:
        """Send the request and read up to the end of the response head.

        Returns False when a reused connection broke before a byte of the request
        went out (the caller sends it on a new one).

        Raises:
            ClosedAfterSend: a reused connection closed after the request went out,
                before a byte of the response: the backend may have seen it.
        """
        io = self._timeouts.io
        data = self._head + self._request_body
        try:
            if conn.sock is not None:
                await _send_socket(conn, conn.sock, data, io)
            else:
                await _send_stream(conn, data, io)
        except _Unsent:
            if reused:
                return False
            raise
        first = True
        while not self._headers_done:
            try:
                data = await self._read(conn, io)
            except ReadError as exc:
                if reused and first:
                    raise ClosedAfterSend(str(exc)) from exc
                if first and _dropped_after_handshake(conn):
                    # Reset, not closed: the request written after the backend's close
                    # made its kernel answer with a reset, which can discard the alert.
                    raise TLSError(_REFUSED_WITHOUT_ALERT) from exc
                raise
            if not data:
                if reused and first:
                    raise ClosedAfterSend("the server closed the connection without a response")
                if first and _dropped_after_handshake(conn):
                    raise TLSError(_REFUSED_WITHOUT_ALERT)
                raise RemoteProtocolError("the server closed the connection without a response")
            first = False
            self._feed(data)
        return True

    @staticmethod
    async def _read(conn: _Conn, io: float) -> bytes:
        sock = conn.sock
        if sock is not None:
            return await _read_socket(conn, sock, io)
        assert conn.stream is not None
        with trio.move_on_after(io) as waited:
            try:
                return bytes(await conn.stream.receive_some(READ_SIZE))
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise ReadError(f"the connection broke while reading: {exc}") from exc
        if waited.cancelled_caught:
            raise ReadTimeout("reading the response timed out")
        raise AssertionError("unreachable")  # pragma: no cover

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
        return take_body(self._body, self._decoder, self._complete)

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
        return await read_up_to(self, limit)

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
                conn.close()
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
