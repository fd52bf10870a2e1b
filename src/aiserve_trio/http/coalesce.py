"""Fewer socket writes per HTTP/1.1 response under hypercorn: the head goes out with the
first body, and a response's last body with its end.

hypercorn 0.18 writes every h11 event on its own: the head, each body, the end of the
message (the chunked terminator, or nothing at all with a Content-Length), each a
socket write behind the connection's send lock and a shielded cancel scope. A gateway
reply that is in hand at once (a short answer, a cache hit, an error) took three or
four writes, and those writes were a fifth of the worker's time at 16 concurrent
streams (``python -m bench.ab``, ``bench/results/2026-12-01``).

:func:`install` patches three methods, keeping hypercorn's own code:

- an ``http.response.start`` message carrying :data:`DEFER` -- the app's promise
  that a body follows at once -- has its head held, not written;
- the events of one ``http.response.body`` message (the body, and when it is the
  last one, the end of the message) are held while hypercorn makes them;
- what is held goes out in one write when that message is done, and before any
  other event of the connection (the stream's close, websocket data), so nothing
  is reordered and nothing is held past the app's send that made it. Empty writes
  are skipped.

Only HTTP/1.1 (hypercorn's ``H11Protocol``); HTTP/2 frames are written by their own
path. The patch reaches into hypercorn's internals, so it is applied only to the
versions it was written for (:data:`~.hypercorn_version.SUPPORTED`); elsewhere
:data:`DEFER` is an unknown key the server ignores. Importing this module changes
nothing; installing twice is harmless.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Final

from .hypercorn_version import Patch

#: Key of an ``http.response.start`` message: a body follows at once, the head may wait for it.
DEFER: Final = "aiserve.body_follows"


def _apply() -> None:
    """Patch hypercorn's HTTP/1.1 writes (see :data:`install`)."""
    import h11
    from hypercorn.events import RawData
    from hypercorn.protocol.events import Body, EndBody, Response
    from hypercorn.protocol.h11 import H11Protocol
    from hypercorn.protocol.http_stream import HTTPStream

    original_event: Callable[[Any, Any], Awaitable[None]] = H11Protocol._send_h11_event
    original_stream_send: Callable[[Any, Any], Awaitable[None]] = H11Protocol.stream_send
    original_app_send: Callable[[Any, Any], Awaitable[None]] = HTTPStream.app_send
    # The bytes an H11Protocol holds; None: it holds nothing and writes as it goes.
    H11Protocol._aiserve_held = None  # type: ignore[attr-defined]

    async def send_h11_event(self: Any, event: Any) -> None:
        held: list[bytes] | None = self._aiserve_held
        if held is None:
            await original_event(self, event)
            return
        try:
            data = self.connection.send(event)
        except h11.LocalProtocolError:
            if self.connection.their_state != h11.ERROR:
                raise
        else:
            if data:
                held.append(data)

    async def flush(protocol: Any) -> None:
        held: list[bytes] | None = protocol._aiserve_held
        protocol._aiserve_held = None
        if held:
            await protocol.send(RawData(data=b"".join(held)))

    async def stream_send(self: Any, event: Any) -> None:
        if self._aiserve_held is not None and not isinstance(event, Response | Body | EndBody):
            await flush(self)  # the stream's close, websocket data: what was held goes first
        await original_stream_send(self, event)

    async def app_send(self: Any, message: Any) -> None:
        protocol = getattr(self.send, "__self__", None)
        if not isinstance(protocol, H11Protocol):
            await original_app_send(self, message)
            return
        kind = None if message is None else message.get("type")
        if kind == "http.response.start" and message.get(DEFER):
            if protocol._aiserve_held is None:  # type: ignore[attr-defined]
                protocol._aiserve_held = []  # type: ignore[attr-defined]
            await original_app_send(self, message)
            return  # held until the body the app promised
        if kind == "http.response.body" and protocol._aiserve_held is None:  # type: ignore[attr-defined]
            protocol._aiserve_held = []  # type: ignore[attr-defined]
        try:
            await original_app_send(self, message)
        finally:
            await flush(protocol)

    H11Protocol._send_h11_event = send_h11_event  # type: ignore[method-assign]
    H11Protocol.stream_send = stream_send  # type: ignore[method-assign]
    HTTPStream.app_send = app_send  # type: ignore[method-assign]


install = Patch(_apply)
