"""Fewer socket writes per HTTP/1.1 response under hypercorn: the head goes out with the
first body, and a response's last body with its end.

hypercorn 0.18 writes every h11 event on its own: the head, each body, the end of the
message (the chunked terminator, or nothing at all with a Content-Length), each a
socket write behind the connection's send lock and a shielded cancel scope. A gateway
reply that is in hand at once (a short answer, a cache hit, an error) took three or
four writes, and those writes were a fifth of the worker's time at 16 concurrent
streams (docs/benchmarks.md, ab; 2026-12-01).

:class:`HeldWrites` is the rule, used by the seam's HTTP/1.1 protocol
(``tcp.py``):

- an ``http.response.start`` message carrying ``DEFER`` (``http/types.py``) -- the app's promise
  that a body follows at once -- has its head held, not written;
- the events of one ``http.response.body`` message (the body, and when it is the
  last one, the end of the message) are held while hypercorn makes them;
- what is held goes out in one write when that message is done, and before any
  other event of the connection (the stream's close, websocket data), so nothing
  is reordered and nothing is held past the app's send that made it. Empty writes
  are skipped.

On hypercorn as shipped (``AISERVE_HYPERCORN_PATCHES=off``), ``DEFER`` is an
unknown key the server ignores.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from ..http.types import DEFER


class HeldWrites:
    """The bytes an HTTP/1.1 connection holds back while one ASGI message is made (sans-IO)."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        #: None: nothing is held, writes go out as they are made.
        self.held: list[bytes] | None = None

    def begin(self, message: Any) -> bool:
        """Start holding for the app's ``message``; True when its writes must go out
        after it (False: the head of a promised body, held until that body)."""
        kind = None if message is None else message.get("type")
        if kind == "http.response.start" and message.get(DEFER):
            if self.held is None:
                self.held = []
            return False
        if kind == "http.response.body" and self.held is None:
            self.held = []
        return True

    def hold(self, data: bytes) -> bool:
        """Keep ``data`` if writes are held; False when it must be written now."""
        if self.held is None:
            return False
        if data:
            self.held.append(data)
        return True

    def take(self) -> bytes:
        """What is held, in one piece; writes go out as they are made again."""
        held, self.held = self.held, None
        return b"".join(held) if held else b""


async def send_coalesced(
    writes: HeldWrites,
    app_send: Callable[[Any], Awaitable[None]],
    flush: Callable[[bytes], Awaitable[None]],
    message: Any,
) -> None:
    """The app's ``send`` of ``message`` through hypercorn's ``app_send``, its writes held
    by ``writes`` and given to ``flush`` in one piece when the message is done."""
    if not writes.begin(message):
        await app_send(message)
        return  # held until the body the app promised
    try:
        await app_send(message)
    finally:
        data = writes.take()
        if data:
            await flush(data)
