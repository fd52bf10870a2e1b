"""Accepting every waiting connection in one step, in the order they arrived.

hypercorn's Trio worker serves its listening sockets with ``trio.serve_listeners``,
which takes one connection per ``listener.accept()``; ``trio.SocketListener.accept``
reaches a checkpoint after each, so a worker accepts *one connection per pass of the
run loop*. Idle, a pass is microseconds. Under load it is every runnable task's step:
at c = 256 on one worker, tens of milliseconds -- so 256 clients connecting at once
waited up to ~6 s to be accepted while the connections already accepted went round
and round (measured: p99 4.7 s, p99.9 5.9 s, max the whole 6 s run, with the gateway's
own time for every request under 0.5 s; ``docs/performance.md``). A request's wait
in the kernel's accept queue is invisible to the app: no deadline, no shedding sees it.

:class:`DrainingListener` is hypercorn's ``trio.SocketListener`` with an ``accept`` that,
once it has one connection, takes every other one already waiting (up to
:data:`ACCEPT_BATCH`) from the listening socket at once, and hands them out from then
on without a checkpoint: ``serve_listeners``' loop starts a handler for each in the
same step. The kernel's accept queue is FIFO, so connections are served in the order
they arrived. The listening socket is read through a duplicate of its descriptor
(the same accept queue); what ``accept`` would raise (a full descriptor table) is left
to the next ordinary ``accept``, which raises it to ``serve_listeners`` as before.

:func:`trio_view` is what hypercorn's worker module sees as ``trio``: the real module's
names, with ``SocketListener`` this class (``seam.py`` installs it; nothing else in the
process changes).
"""

from __future__ import annotations

import errno
import os
import socket
import types
from collections import deque
from typing import Final

import trio

#: Connections taken at once after an accept (a bound on one step's work: starting a
#: handler is a few microseconds).
ACCEPT_BATCH: Final = 512

#: What ``accept`` may fail with for one connection that went away before it was taken
#: (trio's ``SocketListener`` retries these too).
_GONE: Final = {errno.ECONNABORTED, errno.EPERM, errno.EPROTO}


class DrainingListener(trio.abc.Listener[trio.SocketStream]):
    """hypercorn's ``trio.SocketListener`` (a final class: held, not subclassed), taking
    every waiting connection at once (module docstring)."""

    def __init__(self, socket_: trio.socket.SocketType) -> None:
        self.listener = trio.SocketListener(socket_)
        self.socket = socket_
        raw = socket.socket(fileno=os.dup(socket_.fileno()))
        raw.setblocking(False)
        self._raw = raw
        self._ready: deque[trio.SocketStream] = deque()

    async def accept(self) -> trio.SocketStream:
        if self._ready:
            # Taken in an earlier step: no checkpoint, so serve_listeners starts the
            # handler of every waiting connection in this one.
            return self._ready.popleft()
        stream = await self.listener.accept()
        self.drain()
        return stream

    def drain(self) -> int:
        """Take the connections waiting now (at most :data:`ACCEPT_BATCH`); how many."""
        taken = 0
        while taken < ACCEPT_BATCH:
            try:
                conn, _ = self._raw.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno in _GONE:
                    continue
                break  # the next ordinary accept raises it, to serve_listeners
            self._ready.append(trio.SocketStream(trio.socket.from_stdlib_socket(conn)))
            taken += 1
        return taken

    async def aclose(self) -> None:
        self._raw.close()
        while self._ready:
            self._ready.popleft().socket.close()
        await self.listener.aclose()


def trio_view() -> types.ModuleType:
    """``trio`` as hypercorn's worker module sees it: ``SocketListener`` draining."""
    view = types.ModuleType("trio", "trio, with the seam's SocketListener (server/accept.py)")
    view.__dict__.update({k: v for k, v in vars(trio).items() if not k.startswith("__")})
    view.SocketListener = DrainingListener  # type: ignore[attr-defined]
    return view
