"""A lean HTTP/2 client for one job: a request to a model backend, its reply streamed.

``transport.py``'s :class:`~.transport.H2Transport` speaks through it for ``http2 = true``
(h2c with prior knowledge on ``http://``, TLS with ALPN ``h2`` on ``https://``). The frames
are the ``h2`` state machine's (sans-IO, the one httpcore uses); the sockets, the TLS, the
timeouts and the exceptions are ``h1.py``'s, so ``translate_errors`` maps them unchanged.
What it keeps per stream is one ``__slots__`` object (:class:`Response`): the status and
headers, the DATA received and not yet taken, and the one task waiting for it. httpx2 and
httpcore2 kept a request with its header tuples, a response, two async generators and the
request body for as long as the stream lasted (docs/performance.md, "Where a held stream's
memory goes").

- **Pool.** A pool per backend (:class:`H2Pool`) of HTTP/2 connections. A stream goes on
  the first connection with room: fewer streams than our cap (``per_connection``, 100 by
  default) and than the server's ``SETTINGS_MAX_CONCURRENT_STREAMS``. When all are full a
  new connection is opened, and streams that come while it is being opened join it
  rather than open their own (a storm of 10,000 streams makes ~100 connects, not 10,000);
  should the stream that opens it be cancelled meanwhile, they try again, not fail.
  At most ``max_connections`` exchanges at once, as for ``h1.py``: more wait, within
  their ``io`` time, then :class:`~.h1.PoolTimeout`. A connection with no stream for
  ``keepalive_expiry`` is closed when the pool next looks at it.
- **One reader per connection**, a ``trio.lowlevel.spawn_system_task`` that reads the
  socket, feeds ``h2`` and hands each event to its stream (wakes its waiter). Chosen over
  "whoever waits reads": with 100 slow streams on a connection every stream's task would
  contend for one read lock and an event read by one task would wait for the other's
  turn (httpcore2's way: a token could wait one inter-token interval). The reader catches
  everything: a connection that breaks fails all its streams, never the process.
- **A new connection** sends its preface and SETTINGS and waits for the server's
  SETTINGS (within the connect timeout) before it takes a stream: the server's
  ``MAX_CONCURRENT_STREAMS`` is then known, so a stream is never refused for it. The
  server sends its SETTINGS first thing; on loopback the wait is not measurable.
- **Flow control.** Our initial stream window is :data:`STREAM_WINDOW` and the connection's
  room for all its streams' windows at once, so a normal answer never waits for a
  WINDOW_UPDATE round trip and streams whose clients do not read never stop the others.
  Received DATA is acknowledged as the consumer takes it, not as it arrives: a
  client that does not read stops its stream's window, so the backend is held back and a
  stream buffers at most its window. A request body larger than the send window waits for
  the server's WINDOW_UPDATE (within ``io``: :class:`~.h1.WriteTimeout`).
- **Timeouts** as ``h1.py``'s: connect (TCP, TLS handshake and the server's SETTINGS), each
  write and each wait for the response's head or its next DATA bounded by ``io``.
- **Errors.** RST_STREAM from the server: :class:`~.h1.RemoteProtocolError` naming the
  code (REFUSED_STREAM: :class:`~.h1.ConnectError`, the request was not processed). GOAWAY:
  the streams above its ``last_stream_id`` fail with :class:`~.h1.ConnectError` (never
  processed, safe to retry), the connection takes no new stream and closes when its last
  stream ends. A connection that breaks fails all its streams (closed before their end:
  :class:`~.h1.RemoteProtocolError`; a socket error: :class:`~.h1.ReadError`).
- **Cancel safety.** A stream left before its body ended (cancelled, failed, not read to
  its end) is reset with RST_STREAM(CANCEL), shielded and bounded, so the backend stops
  generating; its unread DATA is given back to the connection's window; the connection
  goes on serving its other streams.
- **The 20 ms rule.** The reader reaches a checkpoint every ``h1.CHECKPOINT_BYTES`` it moves
  (it also waits whenever the socket runs dry); a consumer's buffered data is at most its
  window.
- **TLS** is ``h1.py``'s (``_handshake``: an ``ssl.SSLObject`` over memory BIOs on the
  socket, the session resumed); ALPN offers ``h2`` only, and a backend that does not select
  it fails the connect (:class:`~.h1.TLSError`, :data:`NO_H2`). HTTP/2 forbids TLS renegotiation.
- **Content-Encoding** gzip and deflate are decoded (as ``h1.py`` does; we ask for none),
  anything else is refused with :class:`~.h1.RemoteProtocolError`.
"""

from __future__ import annotations

import contextlib
import math
import ssl
import zlib
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Final, final

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import trio

from . import h1
from .h1 import (
    READ_SIZE,
    ConnectError,
    ConnectTimeout,
    H1Error,
    PoolTimeout,
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    Timeouts,
    TLSError,
    WriteError,
    WriteTimeout,
)
from .tls import TLSSettings

__all__ = [
    "FORBIDDEN",
    "NO_H2",
    "PER_CONNECTION",
    "STREAM_WINDOW",
    "H2Pool",
    "Response",
]

#: Streams one connection carries at most (the server may allow fewer).
PER_CONNECTION: Final = 100
#: Our initial window of a stream: what the backend may send ahead of the consumer.
STREAM_WINDOW: Final = 1 << 18
#: Request headers HTTP/2 forbids (connection-specific) or carries as a pseudo-header.
FORBIDDEN: Final = frozenset(
    {b"connection", b"host", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"}
)


class _H2Connection(h2.connection.H2Connection):
    """h2's client connection, which goes on carrying the streams a server's graceful
    GOAWAY (NO_ERROR) left running.

    h2 takes any GOAWAY it receives as the end of the connection: its state machine goes
    to CLOSED and every later frame -- the rest of the streams the server said it
    processed, their WINDOW_UPDATEs -- is refused. A GOAWAY with NO_ERROR becomes h2's
    ``ConnectionTerminated`` event and leaves the state as it was (this connection opens
    no stream after it: :attr:`_Conn.goaway`); one with an error code is h2's own.
    The server's seam does the same on its side (``server/h2.py``); the h2 method both
    override is pinned by its fingerprint in ``server/fingerprints.py`` and ``pyproject.toml``
    pins h2's minor version.
    """

    def _receive_goaway_frame(self, frame: Any) -> tuple[list[Any], list[h2.events.Event]]:
        if frame.error_code != h2.errors.ErrorCodes.NO_ERROR:
            return super()._receive_goaway_frame(frame)
        event = h2.events.ConnectionTerminated()
        event.error_code = h2.errors.ErrorCodes.NO_ERROR
        event.last_stream_id = frame.last_stream_id
        event.additional_data = frame.additional_data or None
        return [], [event]


#: Why a stream above a GOAWAY's last stream id failed.
_GONE: Final = "the backend went away (GOAWAY) before it processed the request"
#: The connect error of a TLS backend that did not select ``h2``.
NO_H2: Final = "the backend did not agree to HTTP/2 (ALPN); set http2 = false"

#: Seconds the RST_STREAM of a stream left early may take to go out.
_RESET_GRACE: Final = 1.0
#: Seconds a write of the reader's own (SETTINGS and PING acks, WINDOW_UPDATE) may take.
_READER_WRITE_S: Final = 30.0

_CONFIG = h2.config.H2Configuration(client_side=True, header_encoding=None)


def _settings() -> h2.settings.Settings:
    return h2.settings.Settings(
        client=True,
        initial_values={
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: PER_CONNECTION,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 1 << 16,
        },
    )


def _reset_error(code: int) -> H1Error:
    try:
        name = h2.errors.ErrorCodes(code).name
    except ValueError:
        name = f"error code {code}"
    if code == h2.errors.ErrorCodes.REFUSED_STREAM:
        return ConnectError(f"the backend refused the stream ({name}): it was not processed")
    return RemoteProtocolError(f"the backend reset the stream ({name})")


class _Left(ConnectError):
    """The stream opening a connection left (was cancelled) before it was ready."""


class _Conn(h1._Conn):
    """One HTTP/2 connection: the socket (``h1._Conn``'s), its ``h2`` state, its streams."""

    __slots__ = (
        "error",
        "goaway",
        "h2",
        "lock",
        "pool",
        "ready",
        "reserved",
        "settled",
        "streams",
        "windows",
    )

    def __init__(self, pool: H2Pool) -> None:
        super().__init__()
        self.pool = pool
        self.h2 = _H2Connection(config=_CONFIG)
        self.h2.local_settings = _settings()
        #: The open streams by id (the reader hands them their events).
        self.streams: dict[int, Response] = {}
        #: Streams given this connection (opening or open): what its room is counted in.
        self.reserved = 0
        #: Set once it is usable (the server's SETTINGS came) or failed (``error``).
        self.ready = trio.Event()
        self.settled = False
        #: Why it is unusable (broken or closed); None while it is fine.
        self.error: H1Error | None = None
        #: The server sent GOAWAY: no new stream.
        self.goaway = False
        #: Writes go out whole and in order.
        self.lock = trio.Lock()
        #: Senders waiting for the server's window to open.
        self.windows = trio.lowlevel.ParkingLot()

    def room(self) -> int:
        """Streams it can take now (0 while broken or going away)."""
        if self.error is not None or self.goaway:
            return 0
        limit = self.pool.per_connection
        if self.settled:
            limit = min(limit, self.h2.remote_settings.max_concurrent_streams)
        return limit - self.reserved

    # --- writing ---------------------------------------------------------------------

    async def flush(self, io: float) -> None:
        """Send what ``h2`` has queued (nothing, at once and without a checkpoint, when
        it has nothing and no one is sending).

        Once taken from ``h2`` the bytes go out whole (shielded, within ``io``): a frame
        cut by one stream's cancel would break the connection for all its streams.

        Raises:
            WriteError, WriteTimeout: the connection broke, or no room came in ``io``:
                the connection is failed (a frame may be cut).
        """
        if self.sock is None:
            return  # failed or closed: its streams were told; what h2 queued has nowhere to go
        lock = self.lock
        if not lock.locked():
            data = self.h2.data_to_send()
            if not data:
                return
            lock.acquire_nowait()
        else:
            await lock.acquire()
            data = self.h2.data_to_send()
        try:
            with trio.CancelScope(shield=True):
                while data and self.sock is not None:
                    await self._send(data, io)
                    data = self.h2.data_to_send()
        except BaseException as exc:
            error = exc if isinstance(exc, H1Error) else WriteError("a write was interrupted")
            self.fail(error)
            raise
        finally:
            lock.release()

    async def _send(self, data: bytes, io: float) -> None:
        sock = self.sock
        assert sock is not None
        tls = self.tls
        if tls is not None:
            try:
                tls.obj.write(data)
            except ssl.SSLError as exc:  # renegotiation (SSLWantReadError) included
                raise WriteError(f"TLS failed while sending: {exc}") from exc
            data = tls.outgoing.read()
        try:
            await h1._send_raw(self, sock, data, io)
        except WriteError as exc:
            if type(exc) is not WriteError:  # h1's "nothing went out" is a write error here
                raise WriteError(str(exc)) from exc
            raise

    # --- reading (the reader task) ---------------------------------------------------

    async def read_loop(self) -> None:
        """The connection's reader: events to their streams until it breaks or closes."""
        try:
            while self.sock is not None:
                data = await self._receive()
                if not data:
                    raise RemoteProtocolError("the backend closed the connection before the end")
                try:
                    events = self.h2.receive_data(data)
                except h2.exceptions.ProtocolError as exc:
                    with trio.move_on_after(_RESET_GRACE):
                        await self.flush(_RESET_GRACE)  # the GOAWAY h2 queued
                    raise RemoteProtocolError(f"the backend broke HTTP/2: {exc}") from exc
                for event in events:
                    self._dispatch(event)
                await self.flush(_READER_WRITE_S)
                if self.goaway and not self.reserved:
                    self.fail(ConnectError("the backend went away (GOAWAY)"))
                await h1._fair(self, len(data))
        except trio.Cancelled:
            self.fail(ReadError("the gateway is shutting down"))
            raise
        except H1Error as exc:
            self.fail(exc)
        except BaseException as exc:  # the reader must never take the process down
            self.fail(ReadError(f"the connection failed: {exc!r}"))

    async def _receive(self) -> bytes:
        """What the socket has (decrypted on TLS), after a wait if it has nothing."""
        sock = self.sock
        assert sock is not None
        tls = self.tls
        if tls is None:
            while True:
                try:
                    return sock.recv(READ_SIZE)
                except BlockingIOError:
                    await h1._wait(trio.lowlevel.wait_readable, self, sock, math.inf, ReadTimeout)
                except OSError as exc:
                    raise ReadError(f"the connection broke while reading: {exc}") from exc
        while True:
            data = tls.decrypt()
            if tls.ended:
                tls.outgoing.read()
            elif tls.outgoing.pending:  # the engine's own answer (a TLS 1.3 key update)
                async with self.lock:
                    await h1._send_raw(self, sock, tls.outgoing.read(), _READER_WRITE_S)
            if data is not None:
                return data
            await h1._fill(self, sock, tls, math.inf)

    def _dispatch(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.DataReceived):
            stream = self.streams.get(event.stream_id)
            if stream is None:  # left early: give its window back to the connection
                self.h2.acknowledge_received_data(
                    event.flow_controlled_length,
                    event.stream_id,
                )
                return
            assert event.data is not None
            stream._data(event.data, event.flow_controlled_length or 0)
        elif isinstance(event, h2.events.ResponseReceived):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                stream._head(event.headers or [])
        elif isinstance(event, h2.events.StreamEnded):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                stream._end()
        elif isinstance(event, h2.events.StreamReset):
            stream = self.streams.get(event.stream_id)
            if stream is not None and not stream._ended:
                stream._fail(_reset_error(event.error_code or 0))
            self.windows.unpark_all()
        elif isinstance(event, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged)):
            if not self.settled and isinstance(event, h2.events.RemoteSettingsChanged):
                self.settled = True
                self.ready.set()
            self.windows.unpark_all()
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.goaway = True
            last = event.last_stream_id or 0
            code = event.error_code or 0
            for sid, stream in list(self.streams.items()):
                if sid > last:
                    stream._fail(ConnectError(_GONE))
                elif code:  # an error: the connection ends now
                    stream._fail(_reset_error(code))
                # else a graceful GOAWAY: the streams it processed go on to their end
            self.windows.unpark_all()
            self.pool._drop(self)

    # --- ending ----------------------------------------------------------------------

    def fail(self, error: H1Error) -> None:
        """The connection is unusable: its streams fail with ``error``; it is closed."""
        if self.error is None:
            self.error = error
        for stream in list(self.streams.values()):
            if not stream._ended:
                stream._fail(type(error)(str(error)))
        self.windows.unpark_all()
        if not self.ready.is_set():
            self.ready.set()
        self.pool._drop(self)
        self.close()

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            trio.lowlevel.notify_closing(sock)
            sock.close()


@final
class Response:
    """One exchange (a stream): its status and headers, then its body by iteration.

    Entering sends the request and waits for the response's head; leaving ends the stream
    (reset if its body had not ended) and gives its place on the connection back.
    """

    __slots__ = (
        "_body",
        "_chunks",
        "_conn",
        "_decoder",
        "_ended",
        "_error",
        "_headers",
        "_pool",
        "_sid",
        "_slot",
        "_timeouts",
        "_unacked",
        "_waiter",
        "headers",
        "status",
    )

    def __init__(
        self,
        pool: H2Pool,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        timeouts: Timeouts,
    ) -> None:
        self._pool = pool
        self._headers = headers
        self._body = body
        self._timeouts = timeouts
        self._conn: _Conn | None = None
        self._slot = False
        self._sid = 0
        self.status = 0
        #: The response's headers (names in lower case, as HTTP/2 has them), in order.
        self.headers: Sequence[tuple[bytes, bytes]] = ()
        #: DATA received and not yet taken.
        self._chunks: list[bytes] = []
        #: Flow-controlled bytes received and not yet acknowledged.
        self._unacked = 0
        self._ended = False
        self._error: H1Error | None = None
        self._waiter: trio.lowlevel.Task | None = None
        self._decoder: zlib._Decompress | None = None

    # --- the reader's calls ----------------------------------------------------------

    def _wake(self) -> None:
        task = self._waiter
        if task is not None:
            self._waiter = None
            trio.lowlevel.reschedule(task)

    def _head(self, headers: Sequence[tuple[bytes, bytes]]) -> None:
        status = 0
        for name, value in headers:
            if name == b":status":
                status = int(value)
            elif name == b"content-encoding":
                try:
                    self._decoder = h1.content_decoder(value)
                except RemoteProtocolError as exc:
                    self._fail(exc)
                    return
        self.status = status
        self.headers = [(k, v) for k, v in headers if not k.startswith(b":")]
        self._wake()

    def _data(self, data: bytes, flow: int) -> None:
        if data:
            self._chunks.append(data)
        self._unacked += flow
        self._wake()

    def _end(self) -> None:
        self._ended = True
        self._wake()

    def _fail(self, error: H1Error) -> None:
        if self._error is None:
            self._error = error
        self._wake()

    def _abort(self, _: object) -> trio.lowlevel.Abort:
        self._waiter = None
        return trio.lowlevel.Abort.SUCCEEDED

    async def _park(self) -> None:
        """Wait for the reader's next event for this stream, within ``io``."""
        with trio.move_on_after(self._timeouts.io) as waited:
            self._waiter = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(self._abort)
        if waited.cancelled_caught:
            raise ReadTimeout("reading the response timed out")

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
            conn = self._conn = await pool._place(timeouts)
            await self._send(conn)
            while not self.status:
                if self._error is not None:
                    raise self._error
                if self._ended:
                    raise RemoteProtocolError("the stream ended without a response")
                await self._park()
        except BaseException:
            await self._leave()
            raise
        # The head came: a stream keeps its response for as long as it lasts, not its
        # request (the prompt, serialized, and its headers).
        self._headers = []
        self._body = b""
        return self

    async def _send(self, conn: _Conn) -> None:
        state = conn.h2
        io = self._timeouts.io
        body = self._body
        try:
            sid = self._sid = state.get_next_available_stream_id()
            state.send_headers(sid, self._headers, end_stream=not body)
        except h2.exceptions.ProtocolError as exc:
            raise RemoteProtocolError(f"the request could not be sent: {exc}") from exc
        conn.streams[sid] = self
        view = memoryview(body)
        sent = 0
        while sent < len(body):
            if self._error is not None or self._ended:
                break  # the backend answered (or reset) before taking the whole body
            try:
                room = min(state.local_flow_control_window(sid), state.max_outbound_frame_size)
            except h2.exceptions.StreamClosedError:
                break
            if room <= 0:
                await conn.flush(io)
                with trio.move_on_after(io) as waited:
                    await conn.windows.park()
                if waited.cancelled_caught:
                    raise WriteTimeout("sending the request timed out (no flow-control window)")
                if conn.error is not None:
                    raise type(conn.error)(str(conn.error))
                continue
            n = min(room, len(body) - sent)
            try:
                state.send_data(
                    sid, view[sent : sent + n].tobytes(), end_stream=sent + n == len(body)
                )
            except h2.exceptions.StreamClosedError:
                break  # reset meanwhile: the reader has told the stream why
            except h2.exceptions.ProtocolError as exc:
                raise RemoteProtocolError(f"the request could not be sent: {exc}") from exc
            sent += n
        await conn.flush(io)

    def __aiter__(self) -> Response:
        return self

    async def __anext__(self) -> bytes:
        """The body bytes received since the last call (never empty); the end stops it."""
        while True:
            if self._chunks:
                conn = self._conn
                data = h1.take_body(self._chunks, self._decoder, self._ended)
                unacked, self._unacked = self._unacked, 0
                if conn is not None and unacked:
                    conn.h2.acknowledge_received_data(unacked, self._sid)
                    await conn.flush(self._timeouts.io)
                if data:
                    return data
                continue
            if self._error is not None:
                raise self._error
            if self._ended:
                raise StopAsyncIteration
            await self._park()

    async def read(self, limit: int) -> bytes:
        """Up to about ``limit`` bytes of the body (an error body, a whole JSON answer)."""
        return await h1.read_up_to(self, limit)

    @property
    def complete(self) -> bool:
        """The whole response has been received (and taken)."""
        return self._ended and not self._chunks

    async def _leave(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            sid = self._sid
            if sid and conn.streams.pop(sid, None) is not None:
                state = conn.h2
                if conn.error is None:
                    try:
                        if self._unacked:  # the connection's window, for the others
                            state.acknowledge_received_data(self._unacked, sid)
                        if not self._ended:
                            state.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
                    except h2.exceptions.H2Error:
                        pass  # closed meanwhile: nothing to reset
                    # Shielded, bounded; a failed connection failed its other streams itself.
                    with (
                        trio.CancelScope(shield=True),
                        trio.move_on_after(_RESET_GRACE),
                        contextlib.suppress(H1Error),
                    ):
                        await conn.flush(_RESET_GRACE)
            self._chunks.clear()
            self._pool._release(conn)
        if self._slot:
            self._slot = False
            self._pool._give()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._leave()


class H2Pool:
    """HTTP/2 connections to one backend, and the way to make a request on them."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_connections: int,
        per_connection: int = PER_CONNECTION,
        keepalive_expiry: float = 30.0,
        tls: TLSSettings | None = None,
    ) -> None:
        """Args:
        host, port: where the backend listens.
        max_connections: exchanges (streams) at once; more wait their turn.
        per_connection: streams one connection carries at most.
        keepalive_expiry: seconds a connection without a stream is kept.
        tls: speak TLS (ALPN ``h2``) on each connection; its context is set to offer h2.
        """
        self.host = host
        self.port = port
        self.per_connection = per_connection
        self.keepalive_expiry = keepalive_expiry
        self.tls = tls
        if tls is not None:
            tls.context.set_alpn_protocols(["h2"])
        self._slots = trio.Semaphore(max_connections)
        self._conns: list[_Conn] = []
        self._idle_since: dict[_Conn, float] = {}
        self.busy = 0
        self._closed = False

    def connections(self) -> tuple[int, int]:
        """(open connections, of which carry a stream)."""
        conns = self._conns
        return len(conns), sum(1 for c in conns if c.streams)

    def request(
        self, headers: list[tuple[bytes, bytes]], body: bytes, timeouts: Timeouts
    ) -> Response:
        """The exchange, as an async context manager (see :class:`Response`).

        ``headers``: the whole header list, pseudo-headers first (the caller builds it).
        """
        return Response(self, headers, body, timeouts)

    async def aclose(self) -> None:
        """Close the connections without a stream; the others close as their last ends."""
        self._closed = True
        for conn in list(self._conns):
            if not conn.reserved:
                self._drop(conn)
                conn.close()
        await trio.lowlevel.checkpoint()

    # --- used by Response ------------------------------------------------------------

    async def _take(self, timeouts: Timeouts) -> None:
        try:
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            with trio.move_on_after(timeouts.io) as waited:
                await self._slots.acquire()
            if waited.cancelled_caught:
                raise PoolTimeout("no stream to the backend came free in time") from None
        self.busy += 1

    def _give(self) -> None:
        self.busy -= 1
        self._slots.release()

    def _drop(self, conn: _Conn) -> None:
        """``conn`` takes no new stream (broken, going away or closed)."""
        if conn in self._idle_since:
            del self._idle_since[conn]
        with contextlib.suppress(ValueError):
            self._conns.remove(conn)

    def _release(self, conn: _Conn) -> None:
        """A stream of ``conn`` ended."""
        conn.reserved -= 1
        tls = self.tls
        if tls is not None and not conn.session_kept and conn.tls is not None:
            conn.session_kept = tls.keep_session(conn.tls.obj)
        if conn.reserved == 0:
            if conn.error is not None or conn.goaway or self._closed:
                self._drop(conn)
                conn.close()
            else:
                self._idle_since[conn] = trio.current_time()

    async def _place(self, timeouts: Timeouts) -> _Conn:
        """A connection with room for one more stream, reserved for it (opened if none has).

        Raises:
            ConnectTimeout, ConnectError, TLSError: a new connection could not be made.
        """
        while True:
            conn = self._pick()
            made = conn is None
            if conn is None:
                conn = _Conn(self)
                conn.reserved = 1
                self._conns.append(conn)
                try:
                    await self._connect(conn, timeouts)
                except BaseException as exc:
                    conn.fail(exc if isinstance(exc, H1Error) else _Left("the connect was left"))
                    conn.reserved -= 1
                    raise
            else:
                conn.reserved += 1
                if not conn.ready.is_set():
                    try:
                        with trio.move_on_after(timeouts.connect) as waited:
                            await conn.ready.wait()
                        if waited.cancelled_caught:
                            raise ConnectTimeout(f"connecting to {self.host}:{self.port} timed out")
                    except BaseException:
                        conn.reserved -= 1
                        raise
                if isinstance(conn.error, _Left):
                    conn.reserved -= 1
                    continue  # the stream that opened it was cancelled: not this one's failure
                if conn.error is not None:
                    conn.reserved -= 1
                    raise type(conn.error)(str(conn.error))
            if conn.room() >= 0 and conn.error is None and not conn.goaway:
                self._idle_since.pop(conn, None)
                return conn
            # The server allows fewer streams than were waiting for it: another one.
            self._release(conn)
            if made and conn.h2.remote_settings.max_concurrent_streams == 0:
                raise ConnectError(f"{self.host}:{self.port} allows no HTTP/2 stream")

    def _pick(self) -> _Conn | None:
        now = trio.current_time()
        expired: list[_Conn] = []
        found = None
        for conn in self._conns:
            if conn.reserved == 0:
                since = self._idle_since.get(conn)
                if since is not None and now - since >= self.keepalive_expiry:
                    expired.append(conn)
                    continue
            if conn.room() > 0:
                found = conn
                break
        for conn in expired:
            self._drop(conn)
            conn.close()
        return found

    async def _connect(self, conn: _Conn, timeouts: Timeouts) -> None:
        """TCP, TLS (ALPN h2), the preface, and the server's SETTINGS, within ``connect``."""
        where = f"{self.host}:{self.port}"
        with trio.move_on_after(timeouts.connect):
            try:
                stream = await trio.open_tcp_stream(self.host, self.port)
            except OSError as exc:
                raise ConnectError(f"cannot connect to {where}: {exc}") from exc
            sock = h1._detached(stream)
            try:
                if self.tls is not None:
                    conn.tls = await h1._handshake(sock, self.tls)
                    if conn.tls.obj.selected_alpn_protocol() != "h2":
                        raise TLSError(NO_H2)
            except BaseException:
                sock.close()
                raise
            conn.sock = sock
            conn.tls13 = conn.tls is not None and conn.tls.obj.version() == "TLSv1.3"
            conn.h2.initiate_connection()
            # Room for every stream's whole window: streams whose consumers do not read
            # cannot stop the others on the connection.
            window = min(self.per_connection * STREAM_WINDOW, (1 << 31) - 1)
            conn.h2.increment_flow_control_window(window - 65535)
            await conn.flush(timeouts.io)
            trio.lowlevel.spawn_system_task(conn.read_loop, name=f"h2 reader {where}")
            await conn.ready.wait()
            if conn.error is not None:
                raise ConnectError(f"the backend at {where} closed HTTP/2 at once: {conn.error}")
            return
        raise ConnectTimeout(f"connecting to {where} timed out")
