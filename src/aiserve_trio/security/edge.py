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
connection with a token bucket (:class:`FloodMeter`, sans-IO) -- a client over
budget gets ``GOAWAY(ENHANCE_YOUR_CALM)`` and is disconnected, as Envoy and
nginx do. The patch reaches into hypercorn's internals, so it is applied only to
the hypercorn versions it was written for (:data:`SUPPORTED`), and the log says
whether it was. Importing this module changes nothing; installing twice is harmless.
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
from hypercorn.events import Closed
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.trio.tcp_server import TCPServer

log = logging.getLogger("aiserve_trio.edge")

#: Control frames a connection may send in a burst, and per second after it.
FLOOD_BURST = 1_000
FLOOD_RATE = 200.0
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
        log.warning("HTTP/2 client %s disconnected: %s", getattr(self, "client", "?"), why)
        self.connection.close_connection(error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
        await self._flush()
        await self.send(Closed())

    async def handle_events(self: Any, events: list[Any]) -> None:
        meter: FloodMeter | None = self.__dict__.get("_aiserve_meter")
        now = trio.current_time()
        if meter is None:
            meter = self.__dict__["_aiserve_meter"] = FloodMeter(now)
        if getattr(self, "_aiserve_closed", False):
            return
        if not meter.spend(now, control_frames(events)):
            self._aiserve_closed = True
            await calm_down(self, "control-frame flood")
            return
        await original_events(self, events)

    async def handle(self: Any, event: Any) -> None:
        try:
            await original_handle(self, event)
        except priority.PriorityError as exc:
            if not getattr(self, "_aiserve_closed", False):
                self._aiserve_closed = True
                await calm_down(self, f"priority tree refused it ({type(exc).__name__})")

    TCPServer.run = run  # type: ignore[method-assign]
    H2Protocol._handle_events = handle_events  # type: ignore[method-assign]
    H2Protocol.handle = handle  # type: ignore[method-assign]
    return f"installed (hypercorn {hv})"
