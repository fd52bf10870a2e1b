"""hypercorn's keep-alive timer: one task per connection whose deadline moves.

Between two requests on one connection hypercorn 0.18 runs a task that closes the
connection after ``keep_alive_timeout``: at the end of every response it restarts
that task (``TrioSingleTask.restart``: a lock, then ``nursery.start``, which waits
until the new task has run), and when the next request arrives it stops it (the lock
again). On the request path those are four trips through Trio's scheduler, and a
task spawned and cancelled per request.

:class:`IdleTimer` keeps one task per connection instead, waiting in a cancel scope
whose deadline is the idle deadline: ``restart`` moves the deadline to
``keep_alive_timeout`` from now, ``stop`` moves it to never -- two assignments, no
task, no cancellation, no checkpoint (so two of them cannot interleave, which is
what the lock was for). When the deadline passes while idle, or the server shuts
down while the connection is idle, the task closes the connection as hypercorn's
own ``_idle_timeout`` does; a shutdown during a request closes the connection once
it is answered. When the connection reads no more (the client closed it; hypercorn's
read loop, as ``directio.py`` makes it, calls :meth:`IdleTimer.reading_ended`),
the task ends at once -- hypercorn's kept an idle connection's task, and its socket,
until the timeout. An action that is not the TCP server's idle timeout runs as
:class:`LeanSingleTask` runs it: a task started in a cancel scope made beforehand,
stopped through the scope.

The seam's ``GatewayTCPServer`` (``tcp.py``) uses it as its ``idle_task``.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import trio


async def _in_scope(scope: trio.CancelScope, action: Callable[[], Awaitable[None]]) -> None:
    with scope:
        await action()


class LeanSingleTask:
    """At most one task running ``action`` at a time: ``restart`` replaces it, ``stop`` ends it."""

    __slots__ = ("_scope",)

    def __init__(self) -> None:
        self._scope: trio.CancelScope | None = None

    async def restart(self, task_group: Any, action: Callable[[], Awaitable[None]]) -> None:
        if self._scope is not None:
            self._scope.cancel()
        scope = self._scope = trio.CancelScope()
        task_group._nursery.start_soon(_in_scope, scope, action)

    async def stop(self) -> None:
        if self._scope is not None:
            self._scope.cancel()
            self._scope = None


class IdleTimer:
    """hypercorn's idle-connection timer as one task whose deadline moves (module docstring)."""

    __slots__ = ("_armed", "_done", "_generic", "_rearmed", "_scope")

    def __init__(self) -> None:
        self._scope: trio.CancelScope | None = None
        self._armed = False
        self._done = False
        self._rearmed: trio.Event | None = None
        self._generic: LeanSingleTask | None = None

    def reading_ended(self) -> None:
        """The connection reads no more (the client closed it, or it broke): the task ends
        now instead of waiting out a timeout (closing the connection if it was idle)."""
        self._done = True
        if self._scope is not None:
            self._scope.cancel()
        if self._rearmed is not None:
            self._rearmed.set()

    async def restart(self, task_group: Any, action: Callable[[], Awaitable[None]]) -> None:
        server = getattr(action, "__self__", None)
        timeout = getattr(getattr(server, "config", None), "keep_alive_timeout", None)
        if getattr(action, "__name__", "") != "_idle_timeout" or timeout is None:
            if self._generic is None:
                self._generic = LeanSingleTask()
            await self._generic.restart(task_group, action)
            return
        self._armed = True
        deadline = trio.current_time() + timeout
        if self._scope is None:
            self._scope = trio.CancelScope(deadline=deadline)
            task_group._nursery.start_soon(self._run, server)
        else:
            self._scope.deadline = deadline
        if self._rearmed is not None:
            self._rearmed.set()

    async def stop(self) -> None:
        if self._generic is not None:
            await self._generic.stop()
        self._armed = False
        if self._scope is not None:
            self._scope.deadline = math.inf

    async def _run(self, server: Any) -> None:
        terminated: trio.Event = server.context.terminated
        while True:
            scope = self._scope
            assert scope is not None  # set before this task was started
            with scope:
                await terminated.wait()
            if self._armed:  # idle past the keep-alive timeout, or shutting down while idle
                break
            if self._done:  # mid-request, and the client is gone: hypercorn closes it
                return
            if terminated.is_set():  # shutting down mid-request: close once it is answered
                self._rearmed = trio.Event()
                await self._rearmed.wait()
                if self._done and not self._armed:
                    return
                break
            # The deadline passed just as a request came in (stop() came too late to
            # move it): the connection is busy, not idle; wait again.
            self._scope = trio.CancelScope(deadline=math.inf)
        with trio.CancelScope(shield=True):
            await server._initiate_server_close()
