"""The bare-server ceiling: a minimal ASGI app on hypercorn-Trio that streams the
same ten SSE chunks as the gateway's short reply, with no stages at all.
Run: hypercorn --config configs/hypercorn.toml --bind 127.0.0.1:8001 bench.ceiling_app:app
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

_CHUNK = (
    b'id: %d\ndata: {"id":"chatcmpl-x","object":"chat.completion.chunk","created":0,'
    b'"model":"m","choices":[{"index":0,"delta":{"content":" w"},"finish_reason":null}]}\n\n'
)
_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


async def app(
    scope: MutableMapping[str, Any],
    receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
    send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
) -> None:
    if scope["type"] != "http":
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
    for i in range(10):
        await send({"type": "http.response.body", "body": _CHUNK % i, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
