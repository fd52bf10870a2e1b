"""hypercorn's socket reads and writes made at once when the socket can do them.

hypercorn 0.18 writes every chunk of bytes through ``TCPServer.protocol_send``: the
connection's send lock, a shielded cancel scope, and Trio's ``send_all`` (a conflict
check, the socket call, a trip through the scheduler) -- for a reply the kernel
takes whole in one ``send``, which on a connection with room in its buffer is
nearly always. It reads through ``TCPServer._read_data``: a cancel scope per read
(even with no read timeout set) and Trio's ``receive_some``, which tries the socket,
waits, reads, and then yields to the scheduler once more.

:func:`install` puts direct attempts in their place on plain TCP connections:

- a write, when nothing else is writing on the connection (its send lock is free),
  goes to the socket with one non-blocking ``send`` on its descriptor; what the
  socket does not take, and every write it cannot try (TLS, another write in
  progress), goes hypercorn's own way, after the part already written; a broken
  connection is reported as hypercorn reports it (``Closed``);
- a read takes what the socket has at once, and otherwise waits until the socket
  is readable (within ``read_timeout`` when one is set) and reads then. The end of
  the stream, a reset, a timeout and a close end the loop as they end hypercorn's,
  with ``Closed`` handed to the protocol.

When reading ends, the connection's keep-alive timer (``http/idle.py``) is told, so
that its task ends with the connection.

No two writes interleave: the direct one is synchronous and only runs while no
other write holds the lock. Versions other than :data:`~.hypercorn_version.SUPPORTED`
are left alone; importing this module changes nothing; installing twice is harmless.
"""

from __future__ import annotations

import math
import os
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from .hypercorn_version import Patch

#: hypercorn's read size (``hypercorn.trio.tcp_server.MAX_RECV``).
MAX_RECV = 2**16


def _apply() -> None:
    """Patch hypercorn's ``TCPServer`` writes and reads (see :data:`install`)."""
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

    original_read: Callable[[Any], Awaitable[None]] = TCPServer._read_data

    async def read_data(self: Any) -> None:
        try:
            stream = self.stream
            if type(stream) is not trio.SocketStream:  # TLS: hypercorn's own loop
                await original_read(self)
                return
            await _read_loop(self, stream.socket, Closed, RawData)
        finally:
            ended = getattr(self.idle_task, "reading_ended", None)
            if ended is not None:
                ended()

    TCPServer.protocol_send = protocol_send  # type: ignore[method-assign]
    TCPServer._read_data = read_data  # type: ignore[method-assign]


install = Patch(_apply)


async def _read_loop(server: Any, sock: Any, closed: type, raw_data: type) -> None:
    """hypercorn's read loop, reading the socket directly (see the module docstring)."""
    timeout = server.config.read_timeout or math.inf
    protocol = server.protocol
    while True:
        try:
            data = os.read(sock.fileno(), MAX_RECV)
        except BlockingIOError:
            try:
                if timeout == math.inf:
                    await trio.lowlevel.wait_readable(sock)
                else:
                    with trio.fail_after(timeout):
                        await trio.lowlevel.wait_readable(sock)
            except (trio.ClosedResourceError, trio.TooSlowError):
                break
            continue
        except OSError:  # reset, or closed under us
            break
        await protocol.handle(raw_data(data=data))
        if not data:
            break
    await protocol.handle(closed())
