"""A client's disconnect told to the app by a call, not only by ``receive()``.

ASGI tells an app that its client went away only through ``receive()``
(``http.disconnect``), and hypercorn's ``send()`` does not raise after a
disconnect: a request must keep a task waiting in ``receive()`` to notice. For a
request whose body was all there when it started, that task did nothing else --
it was spawned, woke once more when hypercorn queued the disconnect that ends every
exchange, and exited: a task per request for one bit.

:func:`install` makes hypercorn's HTTP stream (HTTP/1.1 and HTTP/2) mark each
scope it hands the app as one whose disconnect it will also *call* (``SUPPORTED``),
and call the function the app put under ``HOOK`` in the scope, if any, when the
stream closes -- the moment it queues ``http.disconnect``. :class:`DisconnectHook`
is the app's side. A scope without the mark (another server, a test's client) has
no hook, and the app waits in ``receive()`` as before. hypercorn versions other than
:data:`~.hypercorn_version.SUPPORTED` are left alone; importing this module changes
nothing; installing twice is harmless.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

from .hypercorn_version import Patch

#: Scope key: the server will call ``HOOK`` when the stream closes.
SUPPORTED: Final = "aiserve.disconnect_call"
#: Scope key: what the server calls (no arguments) when the stream closes.
HOOK: Final = "aiserve.on_disconnect"


class DisconnectHook:
    """The app's side: a function for the server to call when the client's stream closes."""

    __slots__ = ("_scope",)

    def __init__(self, scope: MutableMapping[str, Any]) -> None:
        self._scope = scope

    @classmethod
    def of(cls, scope: MutableMapping[str, Any]) -> DisconnectHook | None:
        """The hook of ``scope``; None when its server will not call one."""
        return cls(scope) if scope.get(SUPPORTED) else None

    def set(self, callback: Callable[[], None]) -> None:
        """Have ``callback`` called (once, from the server's task) when the stream closes."""
        self._scope[HOOK] = callback

    def clear(self) -> None:
        self._scope.pop(HOOK, None)


def _apply() -> None:
    """Patch hypercorn's ``HTTPStream.handle`` (see :data:`install`)."""
    from hypercorn.protocol.events import Request, StreamClosed
    from hypercorn.protocol.http_stream import HTTPStream

    original: Callable[[Any, Any], Awaitable[None]] = HTTPStream.handle

    async def handle(self: Any, event: Any) -> None:
        if type(event) is StreamClosed and not self.closed:
            scope = getattr(self, "scope", None)
            callback = scope.pop(HOOK, None) if scope is not None else None
            if callback is not None:
                callback()
        await original(self, event)
        # The app is spawned (start_soon) inside the original and has not run yet.
        if type(event) is Request and getattr(self, "scope", None) is not None:
            self.scope[SUPPORTED] = True

    HTTPStream.handle = handle  # type: ignore[method-assign]


install = Patch(_apply)
