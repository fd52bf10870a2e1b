"""How the pipeline hears that its client went away: one interface, two implementations.

ASGI tells an app that its client went away only through ``receive()``
(``http.disconnect``), and hypercorn's ``send()`` does not raise after a
disconnect: a request must keep a task waiting in ``receive()`` to notice. For a
request whose body was all there when it started, that task did nothing else --
it was spawned, woke once more when hypercorn queued the disconnect that ends every
exchange, and exited: a task per request for one bit.

:class:`Disconnect` is what the pipeline asks: ``set(callback)`` to be called once
when the client's stream closes, ``clear()`` when the request is over.

- :class:`ServerCall`: the server calls. The seam (``tcp.py``) puts one in
  every HTTP scope's ``extensions`` under :data:`EXTENSION` and calls it when the
  stream closes -- the moment hypercorn queues ``http.disconnect``.
- :class:`ReceiveWatcher`: any other ASGI server (or hypercorn as shipped). A task in
  the request's nursery waits in ``receive()`` for ``http.disconnect`` and calls.

:func:`server_call` finds the server's in a scope.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, Protocol

import trio

#: ``scope["extensions"]`` key: the :class:`ServerCall` of a server that calls on a disconnect.
EXTENSION: Final = "aiserve.disconnect"


class Disconnect(Protocol):
    """Tells the request once that its client's stream closed."""

    def set(self, callback: Callable[[], None]) -> None:
        """Have ``callback`` called (once) when the client's stream closes."""

    def clear(self) -> None:
        """No more calls: the request is over."""


class ServerCall:
    """The server's side: it calls :meth:`closed` when the stream closes."""

    __slots__ = ("_callback", "_closed")

    def __init__(self) -> None:
        self._callback: Callable[[], None] | None = None
        self._closed = False

    def set(self, callback: Callable[[], None]) -> None:
        """``callback`` is called when the stream closes, or now if it has closed already."""
        if self._closed:
            callback()
        else:
            self._callback = callback

    def clear(self) -> None:
        self._callback = None

    def closed(self) -> None:
        """The stream closed: call what was set, once (from the server's task)."""
        self._closed = True
        callback, self._callback = self._callback, None
        if callback is not None:
            callback()


class ReceiveWatcher:
    """A task in ``nursery`` waits in ``receive()`` for ``http.disconnect`` and calls."""

    __slots__ = ("_callback", "_nursery", "_receive")

    def __init__(
        self, receive: Callable[[], Awaitable[Mapping[str, Any]]], nursery: trio.Nursery
    ) -> None:
        self._receive = receive
        self._nursery = nursery
        self._callback: Callable[[], None] | None = None

    def set(self, callback: Callable[[], None]) -> None:
        self._callback = callback
        self._nursery.start_soon(self._watch)

    def clear(self) -> None:
        self._callback = None

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        callback, self._callback = self._callback, None
        if callback is not None:
            callback()


def server_call(scope: Mapping[str, Any]) -> ServerCall | None:
    """The :class:`ServerCall` the server put in ``scope``; None when it will not call."""
    call = (scope.get("extensions") or {}).get(EXTENSION)
    return call if isinstance(call, ServerCall) else None
