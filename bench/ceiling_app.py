"""The bare-server ceiling: a minimal ASGI app on hypercorn-Trio that streams the
same ten SSE chunks as the gateway's short reply, with no stages at all; a request
that does not ask to stream (no ``"stream":true`` in its body) gets one fixed
``chat.completion`` JSON body instead. No upstream: the floor of what any app on
this server costs (``bench/throughput.py``'s ``floor``).
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
_WHOLE = (
    b'{"id":"chatcmpl-x","object":"chat.completion","created":0,"model":"m","choices":'
    b'[{"index":0,"message":{"role":"assistant","content":"w0 w1 w2 w3 w4 w5 w6 w7 w8 w9 '
    b'w10 w11 w12 w13 w14 w15"},"finish_reason":"stop"}],"usage":{"prompt_tokens":8,'
    b'"completion_tokens":16,"total_tokens":24}}'
)
_JSON_HEADERS = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(_WHOLE))]


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
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    if b'"stream":true' not in body:
        await send({"type": "http.response.start", "status": 200, "headers": _JSON_HEADERS})
        await send({"type": "http.response.body", "body": _WHOLE, "more_body": False})
        return
    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
    for i in range(10):
        await send({"type": "http.response.body", "body": _CHUNK % i, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def patched(
    scope: MutableMapping[str, Any],
    receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
    send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
) -> None:
    """:func:`app` on a hypercorn with the gateway's seam in (``bench.floor_patches``)."""
    if scope["type"] == "lifespan":
        from aiserve_trio import server

        server.install()
    await app(scope, receive, send)
