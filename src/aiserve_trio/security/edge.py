"""Guards around hypercorn's connection handling, installed by the app's start-up.

hypercorn 0.18 has two failure modes we measured (see docs/architecture.md):

- an exception in one connection's handler (``priority.TooManyStreamsError``
  from a PRIORITY or HEADERS flood) escapes ``trio.serve_listeners`` and ends
  the worker, and hypercorn's parent then stops every worker: one hostile
  client takes the whole server down;
- HTTP/2 control-frame floods (rapid reset, SETTINGS, PING, PRIORITY) cost the
  server work per frame with no limit, starving well-behaved clients.

:func:`install` patches three methods, keeping hypercorn's own code: the
connection runner contains any exception to its connection (logged, the
connection closed), and the HTTP/2 protocol meters control frames per
connection with a token bucket (:class:`FloodMeter`, sans-IO) and counts the
streams its client resets before they are answered (:class:`ResetMeter`, the
rapid-reset rule of Envoy) -- a client over either gets
``GOAWAY(ENHANCE_YOUR_CALM)`` and is disconnected, as Envoy and nginx do, and
no ASGI task is started for anything else it sent. The patch reaches into
hypercorn's internals, so it is applied only to the hypercorn versions it was
written for (:data:`SUPPORTED`), and the log says whether it was. Importing this
module changes nothing; installing twice is harmless.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from typing import Any

import h2.errors
import h2.events as ev
import priority.priority as priority
import trio
from hypercorn.events import Closed, RawData
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.trio.tcp_server import TCPServer

log = logging.getLogger("aiserve_trio.edge")

#: Control frames a connection may send in a burst, and per second after it.
FLOOD_BURST = 1_000
FLOOD_RATE = 200.0
#: A connection that opened more than this many streams is closed once more than
#: RESET_MAX_RATIO of them were reset by its client before the server answered
#: (Envoy: 500 streams, 50 %; fewer here, as each stream that gets that far costs
#: a Python task, and an attacker is caught after one or two reads).
RESET_MIN_STREAMS = 100
RESET_MAX_RATIO = 0.5
#: Bytes of one read handed to h2 at a time, the meters judging between slices
#: (a few hundred small frames; a 16 KiB DATA frame arrives in four).
FEED_SLICE = 4096
#: hypercorn versions (major, minor) whose internals the patch was written against.
SUPPORTED = ((0, 18),)
_installed = False


class FloodMeter:
    """A per-connection token bucket over control frames (sans-IO)."""

    __slots__ = ("_at", "_level", "burst", "rate")

    def __init__(self, now: float, burst: int = FLOOD_BURST, rate: float = FLOOD_RATE) -> None:
        self.burst = burst
        self.rate = rate
        self._level = float(burst)
        self._at = now

    def spend(self, now: float, frames: int) -> bool:
        """Charge ``frames`` control frames; False once the connection is over budget."""
        self._level = min(float(self.burst), self._level + (now - self._at) * self.rate)
        self._at = now
        self._level -= frames
        return self._level >= 0


class ResetMeter:
    """Streams one connection opened, and how many its client reset early (sans-IO).

    Rapid reset (CVE-2023-44487) opens streams and resets them at once: each costs
    the server a stream and an app task, the client nothing, and the resets keep
    it under any limit on concurrent streams. A client reset before the server
    answered is *premature*; a connection whose streams are mostly that is closed.
    """

    __slots__ = ("max_ratio", "min_streams", "premature", "streams")

    def __init__(
        self, min_streams: int = RESET_MIN_STREAMS, max_ratio: float = RESET_MAX_RATIO
    ) -> None:
        self.min_streams = min_streams
        self.max_ratio = max_ratio
        self.streams = 0
        self.premature = 0

    def count(self, opened: int, premature: int) -> bool:
        """Add ``opened`` streams and ``premature`` resets; False once the connection is
        over the rule (more than ``min_streams`` streams, more than ``max_ratio`` reset early)."""
        self.streams += opened
        self.premature += premature
        return not (
            self.streams > self.min_streams and self.premature > self.max_ratio * self.streams
        )


def early_resets(events: list[Any], unanswered: Callable[[int], bool]) -> tuple[int, int, set[int]]:
    """Streams ``events`` open, resets by the client before an answer, streams both opened
    and reset in ``events``.

    Args:
        events: what h2 made of one read.
        unanswered: whether an already open stream has not been answered yet.
    Returns:
        (streams opened, premature resets, the ids of streams opened and reset in
        ``events``: the client cancelled them before the server even saw them).
    """
    opened: set[int] = set()
    cancelled: set[int] = set()
    premature = 0
    for e in events:
        if isinstance(e, ev.RequestReceived):
            opened.add(e.stream_id)
        elif isinstance(e, ev.StreamReset) and e.remote_reset:
            if e.stream_id in opened:
                cancelled.add(e.stream_id)
                premature += 1
            elif unanswered(e.stream_id):
                premature += 1
    return len(opened), premature, cancelled


def control_frames(events: list[Any]) -> int:
    """How many of h2's ``events`` are control frames a flood is made of."""
    n = 0
    for e in events:
        if isinstance(e, ev.StreamReset):
            n += 1 if e.remote_reset else 0
        elif isinstance(e, (ev.PingReceived, ev.RemoteSettingsChanged, ev.PriorityUpdated)):
            n += 1
    return n


def supported(version: str) -> bool:
    """Whether the guard was written for hypercorn ``version``."""
    parts = version.split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return False
    return (major, minor) in SUPPORTED


def install() -> str:
    """Patch hypercorn with the guards above if its version is supported.

    Returns:
        what was done, for the start-up log: ``installed``, ``already installed``,
        ``not installed: ...`` (hypercorn missing, or a version the patch does not know).
    """
    global _installed
    if _installed:
        return "already installed"
    try:
        hv = dist_version("hypercorn")
    except PackageNotFoundError:
        return "not installed: hypercorn is not installed"
    if not supported(hv):
        known = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED)
        return f"not installed: hypercorn {hv} is not a version it was written for ({known})"
    _installed = True

    original_run: Callable[[Any], Awaitable[None]] = TCPServer.run
    original_events: Callable[[Any, list[Any]], Awaitable[None]] = H2Protocol._handle_events
    original_handle: Callable[[Any, Any], Awaitable[None]] = H2Protocol.handle

    async def run(self: Any) -> None:
        try:
            await original_run(self)
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

    async def calm_down(self: Any, why: str) -> None:
        self._aiserve_closed = True
        log.warning("HTTP/2 client %s disconnected: %s", getattr(self, "client", "?"), why)
        self.connection.close_connection(error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
        await self._flush()
        await self.send(Closed())

    def unanswered(self: Any, stream_id: int) -> bool:
        # hypercorn's stream is in state REQUEST (HANDSHAKE for a WebSocket) until
        # the app sends the response head; a stream it no longer holds is done.
        stream = self.streams.get(stream_id)
        state = getattr(stream, "state", None)
        return getattr(state, "name", "") in ("REQUEST", "HANDSHAKE")

    async def handle_events(self: Any, events: list[Any]) -> None:
        meter: FloodMeter | None = self.__dict__.get("_aiserve_meter")
        resets: ResetMeter | None = self.__dict__.get("_aiserve_resets")
        now = trio.current_time()
        if meter is None:
            meter = self.__dict__["_aiserve_meter"] = FloodMeter(now)
        if resets is None:
            resets = self.__dict__["_aiserve_resets"] = ResetMeter()
        if not meter.spend(now, control_frames(events)):
            await calm_down(self, "control-frame flood")
            return
        opened, premature, cancelled = early_resets(events, lambda sid: unanswered(self, sid))
        if not resets.count(opened, premature):
            why = f"rapid reset ({resets.premature} of {resets.streams} streams reset unanswered)"
            await calm_down(self, why)
            return
        if cancelled:
            events = skip_streams(self, events, cancelled)
        await original_events(self, events)

    def skip_streams(self: Any, events: list[Any], cancelled: set[int]) -> list[Any]:
        # Streams the client opened and reset within one read: hypercorn would start
        # an app task for each only to cancel it. Their body bytes still count
        # against the connection's flow-control window, so they are acknowledged.
        kept = []
        for e in events:
            if getattr(e, "stream_id", None) not in cancelled:
                kept.append(e)
            elif isinstance(e, ev.DataReceived):
                self.connection.acknowledge_received_data(e.flow_controlled_length, e.stream_id)
        return kept

    async def handle(self: Any, event: Any) -> None:
        if not isinstance(event, RawData):
            await guarded_handle(self, event)
            return
        # hypercorn reads up to 64 KiB, and h2 parses all of it before the meters see
        # one event: some 2,000 rapid-reset streams or 4,000 SETTINGS frames. In
        # slices the meters judge every few hundred frames, and what follows a
        # verdict is dropped unparsed.
        data = event.data
        for at in range(0, max(len(data), 1), FEED_SLICE):  # b"" (EOF) still goes through
            if getattr(self, "_aiserve_closed", False) or self.closed:
                return
            await guarded_handle(self, RawData(data=data[at : at + FEED_SLICE]))

    async def guarded_handle(self: Any, event: Any) -> None:
        try:
            await original_handle(self, event)
        except priority.PriorityError as exc:
            if not getattr(self, "_aiserve_closed", False):
                await calm_down(self, f"priority tree refused it ({type(exc).__name__})")

    TCPServer.run = run  # type: ignore[method-assign]
    H2Protocol._handle_events = handle_events  # type: ignore[method-assign]
    H2Protocol.handle = handle  # type: ignore[method-assign]
    return f"installed (hypercorn {hv})"
