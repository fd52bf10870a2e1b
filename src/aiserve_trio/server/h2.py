"""The seam's HTTP/2: hypercorn's protocol metered, fed in slices, with backpressure, stream
refusal and a client's graceful GOAWAY.

- :class:`GatewayH2` (hypercorn's ``H2Protocol``): meters floods with the edge guard's
  rules (``security/edge.py``) and puts a client over them into its worker's penalty box;
  feeds h2 in slices, yielding between them; refuses streams over the limit one by one;
  resets a stream the app gave up on; lets a client's GOAWAY drain the open streams;
- :class:`WindowedBuffer` (hypercorn's ``StreamBuffer``): holds a stream's writer while
  the client's flow-control window keeps its buffer full;
- :class:`GatewayConnection` and :class:`AdvertisedLimits` (h2's ``H2Connection`` and
  ``Settings``): a GOAWAY(NO_ERROR) drains instead of closing; the stream limit is
  enforced per stream, not by failing the connection.

``docs/hypercorn.md`` has the measurements behind each.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import priority.priority as priority
import trio
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol.events import StreamClosed
from hypercorn.protocol.h2 import (
    BUFFER_HIGH_WATER,
    BUFFER_LOW_WATER,
    BufferCompleteError,
    H2Protocol,
    StreamBuffer,
)

from ..security import edge
from ..security.edge import FloodMeter, FrameCounter, ResetMeter

if TYPE_CHECKING:
    from .worker import Worker

log = logging.getLogger("aiserve_trio.seam")


class WindowedBuffer(StreamBuffer):
    """hypercorn's per-stream send buffer, whose writer waits while the buffer is full.

    hypercorn 0.18's ``StreamBuffer.pop`` releases the writer blocked in ``push`` when
    the piece it pops is under the low-water mark -- and a stream whose flow-control
    window is 0 pops 0 bytes, every time the send task looks at it. So a client that
    never opens its window lets every ``push`` through: the app's ``send()`` never
    blocks, the gateway never stops reading the upstream, and the worker holds every
    reply whole (64 streams of 3 MB on one connection: +525 MB; docs/benchmarks.md, h2 window).
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

    def __init__(self, *args: Any, worker: Worker) -> None:
        super().__init__(*args)
        #: The worker's settings and penalty box (``worker.py``).
        self.worker = worker
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
        settings = worker.settings
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
        box = self.worker.box
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

