"""ASGI types, the keys the gateway adds to ASGI's, and the header lists every response
reuses."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

Message = MutableMapping[str, Any]
Scope = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]
Receive = Callable[[], Awaitable[Message]]
Headers = list[tuple[bytes, bytes]]

#: Key of an ``http.response.start`` message: a body follows at once, the server may hold
#: the head for it (the seam's HTTP/1.1 does, ``server/coalesce.py``; others ignore it).
DEFER: Final = "aiserve.body_follows"
#: ``scope["extensions"]`` key: a callable that counts a failed authentication by a host
#: (its address) and returns how long the host's new connections are refused (0: not).
#: The seam puts its worker's penalty box there (``server/worker.py``); without the seam
#: there is none, and nothing is counted.
STRIKE: Final = "aiserve.strike"
#: ``scope["extensions"]`` key: when the server read the request's head, in
#: ``trio.current_time()`` seconds (a float). The seam stamps it (``server/directio.py``);
#: the request's deadline counts from it (``runtime/entry.py``). Without it (hypercorn as
#: shipped, another server), from the moment the app starts.
ARRIVED: Final = "aiserve.arrived"
#: ``scope["extensions"]`` key: the worker's queue of requests starting
#: (``http.turns.Turns``), when the server keeps it: the seam's worker does, so that it can
#: leave a request unread while the queue is full (``server/preread.py``). Without it the
#: app keeps its own.
TURNS: Final = "aiserve.turns"
#: ``scope["extensions"]`` key: the request's turn (``http.turns.Turn``), when the server
#: took it before reading the request; the app gives it back (it may hold it until its
#: upstream call starts), and the seam gives it back at the latest when the app ends.
TURN: Final = "aiserve.turn"

JSON_HEADERS: Headers = [(b"content-type", b"application/json")]
SSE_HEADERS: Headers = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
METRICS_HEADERS: Headers = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]
