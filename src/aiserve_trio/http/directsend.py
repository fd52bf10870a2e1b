"""hypercorn's socket writes made at once when the socket takes them.

hypercorn 0.18 writes every chunk of bytes through ``TCPServer.protocol_send``: the
connection's send lock, a shielded cancel scope, and Trio's ``send_all`` (a conflict
check, the socket call, a trip through the scheduler) -- for a reply the kernel
takes whole in one ``send``, which on a connection with room in its buffer is
nearly always. :func:`install` puts a direct attempt in front: when nothing else
is writing on the connection (its send lock is free) and it is a plain TCP one,
the bytes go to the socket with one non-blocking ``send`` on its descriptor. What
the socket does not take, and every write it cannot try (TLS, another write in
progress), goes hypercorn's own way, after the part already written; a broken
connection is reported as hypercorn reports it (``Closed``).

No two writes interleave: the direct one is synchronous and only runs while no
other write holds the lock. Versions other than :data:`~.hypercorn_version.SUPPORTED`
are left alone; importing this module changes nothing; installing twice is harmless.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from .hypercorn_version import refusal

_installed = False


def install() -> str:
    """Patch hypercorn's ``TCPServer.protocol_send``, if its version is supported."""
    global _installed
    if _installed:
        return "already installed"
    if (why := refusal()) is not None:
        return why
    _installed = True
    from hypercorn.events import Closed, RawData
    from hypercorn.trio.tcp_server import TCPServer

    original: Callable[[Any, Any], Awaitable[None]] = TCPServer.protocol_send

    async def protocol_send(self: Any, event: Any) -> None:
        stream = self.stream
        if (
            type(event) is RawData
            and type(stream) is trio.SocketStream
            and not self.send_lock.locked()
        ):
            data = event.data
            try:
                sent = os.write(stream.socket.fileno(), data)
            except BlockingIOError:
                sent = 0
            except OSError:  # reset, broken pipe, closed: the client is gone
                await self.protocol.handle(Closed())
                return
            if sent == len(data):
                return
            if sent:
                event = RawData(data=data[sent:])
        await original(self, event)

    TCPServer.protocol_send = protocol_send  # type: ignore[method-assign]
    return "installed"
