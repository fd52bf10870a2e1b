"""The gateway's one seam into hypercorn: its own server class for hypercorn's Trio worker.

hypercorn's Trio worker (``hypercorn.trio.run.worker_serve``) builds one ``TCPServer``
per accepted connection, looked up by that name in its module when the worker
starts serving -- after the app's lifespan start-up. :func:`install`, called from
that start-up, replaces that one name with :class:`GatewayTCPServer`, a subclass the
project owns; everything the gateway changes in hypercorn hangs off it:

- :class:`GatewayTCPServer`: direct socket reads and writes with a fairness
  checkpoint (``http/directio.py``), the keep-alive timer as one task
  (``http/idle.py``), one connection's exception contained to it and addresses in
  the penalty box refused at accept (``security/edge.py``), the config seen
  through :class:`DatedConfig` (the ``Date`` header formatted once a second);
- :class:`GatewayTaskGroup`: starts the app with a :class:`~.http.disconnect.ServerCall`
  in the scope's ``extensions`` and HTTP/1.1 writes coalesced (``http/coalesce.py``);
- :class:`GatewayProtocols`: picks :class:`GatewayH11` or :class:`GatewayH2`;
- :class:`GatewayH11`: holds the writes one ASGI message makes, and names the status in
  the status line (``200 OK``: some clients read it);
- :class:`GatewayH2`: meters floods (``security/edge.py``) and feeds h2 in slices,
  yielding between them; holds a stream's writer while the client's flow-control
  window keeps its buffer full (:class:`WindowedBuffer`), resets a stream the app gave
  up on, refuses streams over the limit one by one, and lets a client's GOAWAY drain
  the streams already open (:class:`GatewayConnection`).

Every hypercorn method these override, reimplement or call is pinned by a
fingerprint of its source (``http/hypercorn_version.py``). Before it replaces
anything, :func:`install` checks the version and every fingerprint; on a mismatch
it raises :class:`SeamRefused` (the app then refuses to start) unless hypercorn's
TOML has ``aiserve_allow_unpatched = true``, which logs an ERROR and leaves
hypercorn as shipped. ``AISERVE_HYPERCORN_PATCHES=off`` leaves it as shipped too,
on purpose. Importing this module changes nothing.
"""

from __future__ import annotations

import contextlib
import http
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from functools import partial
from time import time
from typing import Any, Final
from wsgiref.handlers import format_date_time

import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import h11
import priority.priority as priority
import trio
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.events import Body, EndBody, Response, StreamClosed
from hypercorn.protocol.h2 import (
    BUFFER_HIGH_WATER,
    BUFFER_LOW_WATER,
    BufferCompleteError,
    H2Protocol,
    StreamBuffer,
)
from hypercorn.protocol.h11 import H2CProtocolRequiredError, H2ProtocolAssumedError, H11Protocol
from hypercorn.trio.task_group import TaskGroup, _handle
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.utils import parse_socket_addr

from ..security import edge
from ..security.edge import FloodMeter, FrameCounter, ResetMeter
from . import datecache, directio
from .coalesce import HeldWrites, send_coalesced
from .disconnect import EXTENSION, ServerCall
from .fingerprints import problems
from .idle import IdleTimer

log = logging.getLogger("aiserve_trio.seam")

#: Environment switch: ``off`` runs hypercorn exactly as shipped.
SWITCH: Final = "AISERVE_HYPERCORN_PATCHES"
#: hypercorn's TOML key: a hypercorn the seam does not know runs as shipped (ERROR logged).
ALLOW_UNPATCHED: Final = "aiserve_allow_unpatched"
#: The one attribute of hypercorn the seam replaces: (module, name).
SEAM: Final = ("hypercorn.trio.run", "TCPServer")


class SeamRefused(Exception):
    """The installed hypercorn is not the one the seam was written against."""


# --- the config, with the Date header formatted once a second -------------------------


_date = datecache.cached(format_date_time)


class DatedConfig(Config):
    """hypercorn's config, whose ``Date`` header is formatted once a second.

    Made by :func:`dated` as a view sharing the config's attributes, so it reads
    exactly what hypercorn loaded.
    """

    def response_headers(self, protocol: str) -> list[tuple[bytes, bytes]]:
        if self.alt_svc_headers or self._quic_addresses:  # HTTP/3 advertised: hypercorn's own
            return super().response_headers(protocol)
        headers = []
        if self.include_date_header:
            headers.append((b"date", _date(time()).encode("ascii")))
        if self.include_server_header:
            headers.append((b"server", f"hypercorn-{protocol}".encode("ascii")))
        return headers


_views: dict[int, tuple[Config, DatedConfig]] = {}


def dated(config: Config) -> DatedConfig:
    """The :class:`DatedConfig` view of ``config`` (one per config)."""
    if isinstance(config, DatedConfig):
        return config
    held = _views.get(id(config))
    if held is None or held[0] is not config:
        view = object.__new__(DatedConfig)
        view.__dict__ = config.__dict__  # the same attributes, not a copy
        held = _views[id(config)] = (config, view)
    return held[1]


# --- the server -----------------------------------------------------------------------


class GatewayTCPServer(TCPServer):
    """hypercorn's connection handler, as the gateway runs it (module docstring)."""

    def __init__(self, app: Any, config: Config, context: Any, state: Any, stream: Any) -> None:
        super().__init__(app, dated(config), context, state, stream)
        self.idle_task = IdleTimer()  # type: ignore[assignment]

    async def run(self) -> None:
        try:
            edge.configure(self.config)
            if await refused(self.stream):
                return
            await self._serve()
        except Exception:
            # One connection's failure must not end the worker and, through
            # hypercorn's parent, every other worker.
            log.exception("a connection handler failed; the connection was closed")
        except BaseExceptionGroup as group:
            errors, rest = group.split(Exception)
            if errors is not None:
                log.error("a connection handler failed", exc_info=errors)
            if rest is not None:
                raise rest from None

    async def _serve(self) -> None:
        # hypercorn's TCPServer.run, with the seam's task group and protocols.
        try:
            try:
                with trio.fail_after(self.config.ssl_handshake_timeout):
                    await self.stream.do_handshake()
            except (trio.BrokenResourceError, trio.TooSlowError):
                return  # Handshake failed
            alpn_protocol = self.stream.selected_alpn_protocol()
            sock = self.stream.transport_stream.socket
            ssl = True
        except AttributeError:  # Not SSL
            alpn_protocol = "http/1.1"
            sock = self.stream.socket
            ssl = False
        try:
            client = parse_socket_addr(sock.family, sock.getpeername())
            server = parse_socket_addr(sock.family, sock.getsockname())
            async with GatewayTaskGroup() as task_group:
                self._task_group = task_group
                self.protocol = GatewayProtocols(
                    self.app,
                    self.config,
                    self.context,
                    task_group,
                    self.state,
                    ssl,
                    client,
                    server,
                    self.protocol_send,
                    alpn_protocol,
                )
                await self.protocol.initiate()
                await self.idle_task.restart(self._task_group, self._idle_timeout)
                await self._read_data()
        except OSError:
            pass
        finally:
            await self._close()

    async def protocol_send(self, event: Event) -> None:
        stream: Any = self.stream  # hypercorn types it as TLS; plain TCP is the common case
        if (
            type(event) is RawData
            and type(stream) is trio.SocketStream
            and not self.send_lock.locked()
        ):
            data = event.data
            sent = directio.write_now(stream, data)
            if sent is None:  # the client is gone
                await self.protocol.handle(Closed())
                return
            if sent == len(data):
                return
            if sent:
                event = RawData(data=data[sent:])
        await super().protocol_send(event)

    async def _read_data(self) -> None:
        try:
            stream: Any = self.stream
            if type(stream) is not trio.SocketStream:  # TLS: hypercorn's loop (it yields per read)
                await super()._read_data()
                return
            await directio.read_loop(self, stream.socket, Closed, RawData)
        finally:
            timer: Any = self.idle_task
            timer.reading_ended()


async def refused(stream: Any) -> bool:
    """Close ``stream`` at once if its peer is in the penalty box; whether it was.

    Before TLS and before h2: a refusal must cost less than what it saves.
    """
    box = edge.box()
    transport = getattr(stream, "transport_stream", stream)  # TLS: the TCP below
    sock = transport.socket
    if box is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    try:
        host = sock.getpeername()[0]
    except OSError:
        return False  # already gone: hypercorn's own code deals with it
    if not box.refuses(edge.peer_key(host), trio.current_time()):
        return False
    with contextlib.suppress(OSError):
        # A reset, not a FIN: no TIME_WAIT kept here for it, and the client's
        # next write fails at once.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await transport.aclose()
    return True


# --- the task group that starts the app -------------------------------------------------


class GatewayTaskGroup(TaskGroup):
    """Starts each app with the disconnect call in its scope, HTTP/1.1 writes coalesced."""

    async def spawn_app(
        self,
        app: Any,
        config: Config,
        scope: Any,
        send: Callable[[Any], Awaitable[None]],
    ) -> Callable[[Any], Awaitable[None]]:
        app_send_channel, app_receive_channel = trio.open_memory_channel[Any](
            config.max_app_queue_size
        )
        put: Callable[[Any], Awaitable[None]] = app_send_channel.send
        if scope["type"] == "http":
            call = ServerCall()
            scope["extensions"][EXTENSION] = call
            put = partial(_put, call, put)
            # send is the HTTPStream's app_send; its send, the protocol's stream_send.
            protocol = getattr(
                getattr(getattr(send, "__self__", None), "send", None), "__self__", None
            )
            if isinstance(protocol, GatewayH11):
                send = partial(send_coalesced, protocol.writes, send, protocol.write_held)
        assert self._nursery is not None
        self._nursery.start_soon(
            _handle,
            app,
            config,
            scope,
            app_receive_channel.receive,
            send,
            trio.to_thread.run_sync,
            trio.from_thread.run,
        )
        return put


async def _put(call: ServerCall, put: Callable[[Any], Awaitable[None]], message: Any) -> None:
    """hypercorn queues a message for the app; a disconnect is also called."""
    if message["type"] == "http.disconnect":
        call.closed()
    await put(message)


# --- the protocols ------------------------------------------------------------------------


class GatewayProtocols(ProtocolWrapper):
    """hypercorn's protocol wrapper, picking the seam's HTTP/1.1 and HTTP/2 protocols."""

    def __init__(
        self,
        app: Any,
        config: Config,
        context: Any,
        task_group: Any,
        state: Any,
        ssl: bool,
        client: tuple[str, int] | None,
        server: tuple[str, int] | None,
        send: Callable[[Event], Awaitable[None]],
        alpn_protocol: str | None = None,
    ) -> None:
        self.app = app
        self.config = config
        self.context = context
        self.task_group = task_group
        self.ssl = ssl
        self.client = client
        self.server = server
        self.send = send
        self.state = state
        kind = GatewayH2 if alpn_protocol == "h2" else GatewayH11
        self.protocol = self._make(kind)

    def _make(self, kind: type[GatewayH11 | GatewayH2]) -> Any:
        return kind(
            self.app,
            self.config,
            self.context,
            self.task_group,
            self.state,
            self.ssl,
            self.client,
            self.server,
            self.send,
        )

    async def handle(self, event: Event) -> None:
        try:
            return await self.protocol.handle(event)
        except H2ProtocolAssumedError as error:
            self.protocol = self._make(GatewayH2)
            await self.protocol.initiate()
            if error.data != b"":
                return await self.protocol.handle(RawData(data=error.data))
        except H2CProtocolRequiredError as error:
            h2_protocol: GatewayH2 = self._make(GatewayH2)
            self.protocol = h2_protocol
            await h2_protocol.initiate(error.headers, error.settings)
            if error.data != b"":
                return await self.protocol.handle(RawData(data=error.data))


#: ``HTTP/1.1 200 \r\n`` -> ``HTTP/1.1 200 OK\r\n``, for every status Python names.
_STATUS_LINES: Final = {
    s.value: (b"HTTP/1.1 %d \r\n" % s.value, b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()))
    for s in http.HTTPStatus
}


def status_line_named(head: bytes, status: int) -> bytes:
    """``head`` (a response head as h11 wrote it) with the status's reason phrase.

    h11 writes the empty reason phrase hypercorn gives it (``HTTP/1.1 200 \r\n``): valid
    HTTP/1.1, but clients that read the status from the phrase -- ``h2load --h1`` among
    them, which then counts every answer as failed -- do better with ``200 OK``.
    """
    lines = _STATUS_LINES.get(status)
    if lines is None or not head.startswith(lines[0]):
        return head
    return lines[1] + head[len(lines[0]) :]


class GatewayH11(H11Protocol):
    """hypercorn's HTTP/1.1 protocol, writing what one ASGI message makes at once, with
    the status named in the status line (:func:`status_line_named`)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.writes = HeldWrites()

    async def write_held(self, data: bytes) -> None:
        await self.send(RawData(data=data))

    async def _send_h11_event(self, event: Any) -> None:
        try:
            data = self.connection.send(event)
        except h11.LocalProtocolError:
            if self.connection.their_state != h11.ERROR:
                raise
            return
        if type(event) is h11.Response and not event.reason:
            data = status_line_named(data, event.status_code)
        if not self.writes.hold(data):
            await self.send(RawData(data=data))

    async def stream_send(self, event: Any) -> None:
        if self.writes.held is not None and not isinstance(event, Response | Body | EndBody):
            data = (
                self.writes.take()
            )  # the stream's close, websocket data: what was held goes first
            if data:
                await self.write_held(data)
        await super().stream_send(event)


class WindowedBuffer(StreamBuffer):
    """hypercorn's per-stream send buffer, whose writer waits while the buffer is full.

    hypercorn 0.18's ``StreamBuffer.pop`` releases the writer blocked in ``push`` when
    the piece it pops is under the low-water mark -- and a stream whose flow-control
    window is 0 pops 0 bytes, every time the send task looks at it. So a client that
    never opens its window lets every ``push`` through: the app's ``send()`` never
    blocks, the gateway never stops reading the upstream, and the worker holds every
    reply whole (64 streams of 3 MB on one connection: +525 MB, bench/h2_window.py).
    Here the writer is released by what is *left*: ``push`` returns once the buffer
    is under the high-water mark, and a blocked one waits until it drained under the
    low-water mark (or the stream was closed). A window of 0 (or of a few bytes) pops
    little or nothing, so the buffer stays full, ``send()`` blocks, the sse stage's
    write deadline sees the stall, and the pipeline stops reading the upstream.
    """

    async def push(self, data: bytes) -> None:
        if self._complete:
            raise BufferCompleteError()
        self.buffer.extend(data)
        await self._is_empty.clear()
        while len(self.buffer) >= BUFFER_HIGH_WATER:  # close() empties it
            await self._paused.clear()  # a release from before this push is stale
            await self._paused.wait()

    async def pop(self, max_length: int) -> bytes:
        length = min(len(self.buffer), max_length)
        data = bytes(self.buffer[:length])
        del self.buffer[:length]
        if len(self.buffer) < BUFFER_LOW_WATER:
            await self._paused.set()
        if len(self.buffer) == 0:
            await self._is_empty.set()
        return data


class DrainRequested(h2.events.ConnectionTerminated):
    """The client sent GOAWAY(NO_ERROR): it opens no more streams, the open ones may finish."""


class AdvertisedLimits(h2.settings.Settings):
    """Our SETTINGS, whose stream limit h2 advertises but does not enforce.

    h2 refuses a stream over ``max_concurrent_streams`` by failing the whole connection
    (``TooManyStreamsError``, a PROTOCOL_ERROR), from the first byte -- although a client
    may open streams freely until our SETTINGS reach it (RFC 9113 §5.1.2, §6.5.3): a
    compliant client that opens 65 streams at once lost all of them, and its address
    went into the penalty box. :class:`GatewayH2` refuses the extra streams itself, each
    with RST_STREAM(REFUSED_STREAM). h2 reads this property only to make that check
    (``H2Connection._receive_headers_frame``, pinned); the value advertised is the
    setting's own, unchanged.
    """

    @property
    def max_concurrent_streams(self) -> int:
        return 2**32 + 1  # h2's "no limit"

    @max_concurrent_streams.setter
    def max_concurrent_streams(self, value: int) -> None:
        self[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] = value


class GatewayConnection(h2.connection.H2Connection):
    """h2's server connection, which keeps serving the open streams after a client's
    graceful GOAWAY.

    h2 takes any GOAWAY it receives as the end of the connection: its state machine goes
    to CLOSED and every later frame we would send -- the rest of the replies already
    under way -- is refused; hypercorn then closes the socket at once, cutting every
    stream. But a GOAWAY only says the sender opens no new streams (RFC 9113 §6.8:
    proxies send GOAWAY(NO_ERROR, last_stream_id 0) to drain a connection on reload). A
    GOAWAY with NO_ERROR becomes :class:`DrainRequested` and leaves the connection open;
    one with an error code is h2's own.
    """

    def _receive_goaway_frame(self, frame: Any) -> tuple[list[Any], list[h2.events.Event]]:
        if frame.error_code != h2.errors.ErrorCodes.NO_ERROR:
            return super()._receive_goaway_frame(frame)
        event = DrainRequested()
        event.error_code = h2.errors.ErrorCodes.NO_ERROR
        event.last_stream_id = frame.last_stream_id
        event.additional_data = frame.additional_data or None
        return [], [event]


class GatewayH2(H2Protocol):
    """hypercorn's HTTP/2 protocol, metered (``security/edge.py``) and fed in slices, with
    backpressure, stream refusal and a graceful drain (the classes above)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        # The h2 connection hypercorn's __init__ built, as GatewayConnection with
        # AdvertisedLimits: the same config, the same settings (nothing is sent before
        # initiate()).
        shipped = self.connection
        self.connection = GatewayConnection(config=shipped.config)
        self.connection.DEFAULT_MAX_INBOUND_FRAME_SIZE = shipped.DEFAULT_MAX_INBOUND_FRAME_SIZE
        advertised: dict[Any, int] = dict(shipped.local_settings.items())
        self.connection.local_settings = AdvertisedLimits(client=False, initial_values=advertised)
        #: The client sent GOAWAY(NO_ERROR): no new streams; closed once the open ones end.
        self.draining = False
        #: ... and they did: our GOAWAY went out (h2 is closed: a frame the client sent
        #: meanwhile is a protocol error to h2, not the client's fault).
        self.drained = False
        now = trio.current_time()
        settings = edge.configure(self.config)
        self._control = FloodMeter(now)
        self._idle = FloodMeter(now, edge.IDLE_BURST, edge.IDLE_RATE)
        self._resets = ResetMeter(settings.h2_reset_min_streams, settings.h2_reset_max_ratio)
        self._frames = FrameCounter()
        self._slice_frames = 0
        self.calmed = False

    async def handle(self, event: Event) -> None:
        if not isinstance(event, RawData):
            await self._guarded(event)
            if isinstance(event, Closed):
                # Writers still blocked on a full buffer: the stream is gone, so is its
                # window. Released, their next push fails (hypercorn ignores it).
                for buffer in list(self.stream_buffers.values()):
                    await buffer.close()
            return
        # hypercorn reads up to 64 KiB, and h2 parses all of it before the meters see
        # one event: thousands of small frames. In slices the meters judge every few
        # hundred frames, what follows a verdict is dropped unparsed, and the other
        # connections get the loop between slices.
        data = event.data
        for at in range(0, max(len(data), 1), edge.FEED_SLICE):  # b"" (EOF) still goes through
            if at:
                await trio.lowlevel.checkpoint()
            if self.calmed or self.closed:
                return
            piece = data[at : at + edge.FEED_SLICE]
            self._slice_frames = self._frames.feed(piece)
            await self._guarded(RawData(data=piece))

    async def _guarded(self, event: Event) -> None:
        try:
            if not isinstance(event, RawData):
                await super().handle(event)
                return
            # hypercorn's handle of RawData, and a client that broke the protocol is
            # remembered: reconnecting to break it again is refused at accept.
            try:
                events = self.connection.receive_data(event.data)
            except h2.exceptions.ProtocolError as exc:
                await self._flush()
                await self.send(Closed())
                if not self.drained:
                    self.punish(f"protocol error ({type(exc).__name__})")
            else:
                await self._handle_events(events)
        except priority.PriorityError as exc:
            if not self.calmed:
                await self.calm_down(f"priority tree refused it ({type(exc).__name__})")

    async def _handle_events(self, events: list[Any]) -> None:
        now = trio.current_time()
        frames, self._slice_frames = self._slice_frames, 0
        if not self._control.spend(now, edge.control_frames(events)):
            await self.calm_down("control-frame flood")
            return
        if not self._idle.spend(now, edge.idle_frames(events, frames)):
            await self.calm_down("flood of frames that need no answer")
            return
        events, refused = self._admit(events)
        # Each refusal costs an RST_STREAM, as a control frame does. (A refused stream
        # is not one the rapid-reset rule counts as opened: it cannot dilute the ratio.)
        if refused and not self._control.spend(now, refused):
            await self.calm_down("flood of streams over the limit")
            return
        opened, premature, cancelled = edge.early_resets(events, self._unanswered)
        if not self._resets.count(opened, premature):
            r = self._resets
            await self.calm_down(
                f"rapid reset ({r.premature} of {r.streams} streams reset unanswered)"
            )
            return
        if cancelled:
            events = self._skip_streams(events, cancelled)
        await super()._handle_events(events)
        await self._end_drain()

    def _admit(self, events: list[Any]) -> tuple[list[Any], int]:
        """``events`` without the streams refused, and how many were.

        A stream over ``h2_max_concurrent_streams`` (a client may open more before our
        SETTINGS reach it) or opened after the client's GOAWAY is refused with
        RST_STREAM(REFUSED_STREAM): the client may retry it, and the connection and the
        other streams go on (RFC 9113 §5.1.2, §8.7). The body bytes of a refused stream
        still count against the connection's window, so they are acknowledged. While
        the worker shuts down, hypercorn refuses new streams its own way.
        """
        limit = self.config.h2_max_concurrent_streams
        open_streams = len(self.streams)
        # Streams the client opened and reset within these events hold no slot: they are
        # the rapid-reset rule's to count, and _skip_streams' to drop.
        cancelled = {
            e.stream_id for e in events if isinstance(e, h2.events.StreamReset) and e.remote_reset
        }
        refused: set[int] = set()
        kept = []
        for e in events:
            if isinstance(e, DrainRequested):
                if not self.draining:
                    log.debug(
                        "HTTP/2 client %s sent GOAWAY: %d streams drain",
                        self.client,
                        len(self.streams),
                    )
                self.draining = True
                continue
            sid = getattr(e, "stream_id", None)
            if isinstance(e, h2.events.RequestReceived):
                if self.context.terminated.is_set() or e.stream_id in cancelled:
                    pass
                elif self.draining or open_streams >= limit:
                    refused.add(e.stream_id)
                    with contextlib.suppress(h2.exceptions.StreamClosedError):  # gone anyway
                        self.connection.reset_stream(
                            e.stream_id, h2.errors.ErrorCodes.REFUSED_STREAM
                        )
                    continue
                else:
                    open_streams += 1
            elif sid in refused:
                if isinstance(e, h2.events.DataReceived):
                    self.connection.acknowledge_received_data(e.flow_controlled_length, sid)
                continue
            kept.append(e)
        return kept, len(refused)

    async def _end_drain(self) -> None:
        """After the client's GOAWAY: once no stream is open and every reply has been
        handed to h2, our own GOAWAY(NO_ERROR) and the close."""
        if not self.draining or self.drained or self.closed:
            return
        if self.streams or self.stream_buffers:
            return
        self.drained = True  # once: the send task and the reader may both get here
        self.connection.close_connection()
        await self._flush()
        await self.send(Closed())

    async def _create_stream(self, request: h2.events.RequestReceived) -> None:
        await super()._create_stream(request)
        # hypercorn makes the stream's StreamBuffer, then starts the app (start_soon) with
        # no checkpoint in between: nothing can have been pushed yet. Swapped for the
        # buffer whose writer waits for the client's window.
        buffer = self.stream_buffers.get(request.stream_id)
        if type(buffer) is StreamBuffer and not buffer.buffer:
            self.stream_buffers[request.stream_id] = WindowedBuffer(self.context.event_class)

    async def _send_data(self, stream_id: int) -> None:
        await super()._send_data(stream_id)
        if self.draining:
            await self._end_drain()  # the last stream's end may just have gone out

    async def stream_send(self, event: Any) -> None:
        if type(event) is not StreamClosed:
            await super().stream_send(event)
            return
        buffer = self.stream_buffers.get(event.stream_id)
        if buffer is not None and not buffer.complete:
            await self._abandon(event.stream_id, buffer)
        await super().stream_send(event)
        await self._end_drain()

    async def _abandon(self, stream_id: int, buffer: StreamBuffer) -> None:
        """The app ended a stream whose reply it had not finished: RST_STREAM.

        This is how a reply the gateway gave up on ends -- the sse stage's write
        deadline on a client whose window stayed 0, an error after the head -- where
        hypercorn would leave the h2 stream open with its buffer, which the send task
        would write out (without an end) if the window ever opened. The client learns
        the reply is incomplete. The send task then drops the stream (its end fails on
        a reset stream, which hypercorn takes as closed).
        """
        with contextlib.suppress(h2.exceptions.ProtocolError):  # already closed or reset
            self.connection.reset_stream(stream_id, h2.errors.ErrorCodes.INTERNAL_ERROR)
        await buffer.close()
        await self._window_updated(stream_id)  # the send task looks at it once more
        await self._flush()

    def _unanswered(self, stream_id: int) -> bool:
        # hypercorn's stream is in state REQUEST (HANDSHAKE for a WebSocket) until
        # the app sends the response head; a stream it no longer holds is done.
        stream = self.streams.get(stream_id)
        state = getattr(stream, "state", None)
        return getattr(state, "name", "") in ("REQUEST", "HANDSHAKE")

    def _skip_streams(self, events: list[Any], cancelled: set[int]) -> list[Any]:
        # Streams the client opened and reset within one slice: hypercorn would start
        # an app task for each only to cancel it. Their body bytes still count
        # against the connection's flow-control window, so they are acknowledged.
        kept = []
        for e in events:
            if getattr(e, "stream_id", None) not in cancelled:
                kept.append(e)
            elif isinstance(e, h2.events.DataReceived):
                self.connection.acknowledge_received_data(e.flow_controlled_length, e.stream_id)
        return kept

    def punish(self, why: str) -> None:
        """Put the client's address into the penalty box, and say so."""
        self.calmed = True
        box = edge.box()
        if box is not None and self.client:
            penalty = box.punish(edge.peer_key(self.client[0]), trio.current_time())
            why += f"; its address is refused for {penalty:g} s ({box.refused} refused so far)"
        log.warning("HTTP/2 client %s disconnected: %s", self.client, why)

    async def calm_down(self, why: str) -> None:
        """Close the connection with GOAWAY(ENHANCE_YOUR_CALM), its address into the box."""
        self.punish(why)
        self.connection.close_connection(error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
        await self._flush()
        await self.send(Closed())


# --- installing it ------------------------------------------------------------------------


def _worker_module() -> Any:
    import importlib

    return importlib.import_module(SEAM[0])


def installed() -> bool:
    """Whether hypercorn's Trio worker builds :class:`GatewayTCPServer` now."""
    return getattr(_worker_module(), SEAM[1], None) is GatewayTCPServer


def install(config: object | None = None, *, pinned: dict[str, str] | None = None) -> str:
    """Put the seam in place (once); say what was done, for the start-up log.

    Args:
        config: hypercorn's config (its TOML's ``aiserve_allow_unpatched``); None
            outside hypercorn's worker.
        pinned: the fingerprints to check (tests); hypercorn_version.PINNED by default.
    Raises:
        SeamRefused: this hypercorn is not the one the seam was written against, and
            ``aiserve_allow_unpatched`` is not set.
    """
    if os.environ.get(SWITCH, "").strip().lower() == "off":
        return f"off ({SWITCH}=off): hypercorn as shipped, without the edge guard"
    if installed():
        return "already installed"
    found = problems(pinned)
    if found:
        why = "; ".join(found)
        if getattr(config, ALLOW_UNPATCHED, False) is True:
            log.error(
                "hypercorn seam not installed, running hypercorn as shipped without the edge"
                " guard (%s = true): %s",
                ALLOW_UNPATCHED,
                why,
            )
            return "not installed (hypercorn as shipped)"
        raise SeamRefused(
            f"the hypercorn seam cannot be installed: {why} (pin hypercorn>=0.18,<0.19, or set"
            f" {ALLOW_UNPATCHED} = true in hypercorn's TOML to run hypercorn as shipped)"
        )
    setattr(_worker_module(), SEAM[1], GatewayTCPServer)
    return f"installed: {SEAM[0]}.{SEAM[1]} = {__name__}.GatewayTCPServer"


def uninstall() -> None:
    """Put hypercorn's own ``TCPServer`` back (tests)."""
    setattr(_worker_module(), SEAM[1], TCPServer)
