"""hypercorn's keep-alive timer, restarted without a lock and without waiting for a task.

Between two requests on one connection hypercorn 0.18 runs a task that closes the
connection after ``keep_alive_timeout``: at the end of every response it restarts
that task (``TrioSingleTask.restart``: a lock, then ``nursery.start``, which waits
until the new task has run), and when the next request arrives it stops it (the lock
again). On the request path those are four trips through Trio's scheduler.

:class:`LeanSingleTask` does the same with no checkpoint at all: the new task is
started with ``start_soon`` inside a cancel scope made beforehand, the old one
cancelled through its scope. With no checkpoint in ``restart`` and ``stop``, two of
them cannot interleave, which is what the lock was for. :func:`install` makes
hypercorn's TCP server use it, for the hypercorn versions it was written for
(:data:`~.hypercorn_version.SUPPORTED`); importing this module changes nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from .hypercorn_version import refusal

#: hypercorn versions (major, minor) whose internals the patch was written against.
_installed = False


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


def install() -> str:
    """Make hypercorn's TCP server use :class:`LeanSingleTask`, if its version is supported."""
    global _installed
    if _installed:
        return "already installed"
    if (why := refusal()) is not None:
        return why
    _installed = True
    from hypercorn.trio import tcp_server

    tcp_server.TrioSingleTask = LeanSingleTask  # type: ignore[attr-defined,assignment]
    return "installed"
