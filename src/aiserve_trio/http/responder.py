"""The one writer of an HTTP response: :class:`Responder` owns the ASGI ``send``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from ..core.api import error_json
from ..core.errors import GatewayError, WriteTimeout
from .types import DEFER, JSON_HEADERS, Headers, Send

#: An error as an API's status and body (``apis/``).
ErrorShape = Callable[[GatewayError], tuple[int, bytes]]


class Responder:
    """Writes one HTTP response through ASGI ``send``; remembers whether it started.

    The head is sent lazily, so that an error before the first byte can still
    become a proper HTTP status. With ``write_timeout`` (seconds) every write is
    bounded by its own cancel scope: a client that takes no byte for that long
    is given up on (:class:`WriteTimeout`). Chat streams pass None: the sse
    stage bounds its writes and sends its heartbeats itself, on one cancel scope
    whose deadline it moves (cheaper than a scope per token). Writes are
    serialised. ``headers`` go into
    every head this responder sends, whoever starts it (the CORS headers,
    computed once per request). ``errors`` renders an error in the API the
    endpoint speaks (``apis/``); without it, errors are the OpenAI envelope.
    """

    __slots__ = (
        "_errors",
        "_headers",
        "_lock",
        "_send",
        "bytes_written",
        "finished",
        "last_write",
        "started",
        "write_timeout",
        "writes",
    )

    def __init__(
        self,
        send: Send,
        write_timeout: float | None = None,
        headers: Headers | None = None,
        errors: ErrorShape | None = None,
    ) -> None:
        self._send = send
        self._errors = errors
        self._headers = headers
        self._lock = trio.StrictFIFOLock()
        self.started = False
        self.finished = False
        self.write_timeout = write_timeout
        #: When the last write completed (``trio.current_time()``).
        self.last_write = 0.0
        #: ASGI sends (each is at least one socket write by the server) and body bytes sent.
        self.writes = 0
        self.bytes_written = 0

    async def _write(self, message: dict[str, Any]) -> None:
        # Uncontended (the common case) the lock costs no checkpoint; the
        # send itself is one.
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()
        try:
            self.writes += 1
            if self.write_timeout is None:
                await self._send(message)
            else:
                with trio.move_on_after(self.write_timeout) as scope:
                    await self._send(message)
                if scope.cancelled_caught:
                    self.finished = True  # nothing more can usefully be sent
                    raise WriteTimeout("the client stopped reading the response")
            self.last_write = trio.current_time()
        finally:
            self._lock.release()

    async def start(self, status: int, headers: Headers, *, body_follows: bool = False) -> None:
        """Send the head; ``body_follows``: the caller writes a body at once, so the
        server may hold the head and write it with that body (``coalesce.py``)."""
        if self._headers:
            headers = [*headers, *self._headers]
        self.started = True
        message: dict[str, Any] = {"type": "http.response.start", "status": status}
        message["headers"] = headers
        if body_follows:
            message[DEFER] = True
        await self._write(message)

    async def body(self, data: bytes, *, more: bool = True) -> None:
        if not more:
            self.finished = True
        self.bytes_written += len(data)
        await self._write({"type": "http.response.body", "body": data, "more_body": more})

    async def complete(self, status: int, headers: Headers, data: bytes) -> None:
        """A whole response in one go (errors, JSON bodies)."""
        headers = [*headers, (b"content-length", b"%d" % len(data))]
        await self.start(status, headers, body_follows=True)
        await self.body(data, more=False)

    async def error(self, err: GatewayError, extra: Headers | None = None) -> None:
        """An error response in the endpoint's API's shape (the OpenAI envelope unless
        the responder was given another), before anything was sent."""
        headers = [*JSON_HEADERS, *(extra or [])]
        headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
        if self._errors is not None:
            status, body = self._errors(err)
        else:
            status, body = err.status, error_json(err)
        await self.complete(status, headers, body)
