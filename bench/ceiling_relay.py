"""The bench's ``ceiling``: what the server stack alone costs in front of an upstream.

A minimal ASGI app on hypercorn's Trio worker that relays every POST body to the
upstream (``BENCH_UPSTREAM``, default ``http://127.0.0.1:8100``, same path) and
streams the upstream's response bytes back as they arrive, with the same HTTP
client the gateway's ``openai`` adapter uses (one pooled ``httpx2.AsyncClient``).
No parsing, no stages, no sessions, no policies, no metrics: the gateway's
throughput can at best reach this.

Run: BENCH_UPSTREAM=http://127.0.0.1:8100 hypercorn --worker-class trio \
     --bind 127.0.0.1:8001 bench.ceiling_relay:app
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx2

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_client: httpx2.AsyncClient | None = None


async def _lifespan(receive: Receive, send: Send) -> None:
    global _client
    await receive()
    limits = httpx2.Limits(max_connections=20000, max_keepalive_connections=20000)
    _client = httpx2.AsyncClient(
        base_url=os.environ.get("BENCH_UPSTREAM", "http://127.0.0.1:8100"),
        limits=limits,
        timeout=httpx2.Timeout(120.0),
        trust_env=False,
    )
    await send({"type": "lifespan.startup.complete"})
    await receive()
    await _client.aclose()
    await send({"type": "lifespan.shutdown.complete"})


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """Relay one request to the upstream and stream its answer back."""
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
        return
    if scope["type"] != "http" or _client is None:
        return
    body = bytearray()
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    async with _client.stream(
        "POST", scope["path"], content=bytes(body), headers={"content-type": "application/json"}
    ) as resp:
        ctype = resp.headers.get("content-type", "application/octet-stream").encode()
        await send(
            {"type": "http.response.start", "status": resp.status_code, "headers": [(b"content-type", ctype)]}
        )
        async for chunk in resp.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
