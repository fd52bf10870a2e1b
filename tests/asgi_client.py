"""An in-process ASGI client for tests, so that timed behaviour runs on Trio's virtual clock.

It drives the app the way hypercorn does: ``receive()`` yields the body, then
blocks until the test disconnects; ``send()`` events are collected. A test can
read the response as it streams and disconnect at any point.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

import trio

if TYPE_CHECKING:
    from typing_extensions import Unpack

Message = MutableMapping[str, Any]


@dataclass
class Response:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    chunks: list[tuple[float, bytes]] = field(default_factory=list)
    complete: bool = False

    @property
    def body(self) -> bytes:
        return b"".join(c for _, c in self.chunks)

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[str]:
        """The ``data:`` payloads of an SSE body, in order."""
        out = []
        for block in self.body.decode().split("\n\n"):
            data = [line[6:] for line in block.split("\n") if line.startswith("data: ")]
            if data:
                out.append("\n".join(data))
        return out

    def event_ids(self) -> list[str]:
        return [
            line[4:]
            for block in self.body.decode().split("\n\n")
            for line in block.split("\n")
            if line.startswith("id: ")
        ]

    def text(self) -> str:
        """The streamed reply's content, joined."""
        parts = []
        for ev in self.events():
            if ev == "[DONE]":
                continue
            obj = json.loads(ev)
            for ch in obj.get("choices", []):
                parts.append(ch.get("delta", {}).get("content") or "")
        return "".join(parts)


class ExchangeOptions(TypedDict, total=False):
    """The pacing keywords of :class:`Exchange`, passed through by :class:`Client`."""

    body_delay: float
    send_delay: float
    stall_after: float


class Exchange:
    """One request in flight."""

    def __init__(
        self,
        app: Any,
        scope: dict[str, Any],
        body_parts: list[bytes],
        *,
        body_delay: float = 0.0,
        send_delay: float = 0.0,
        stall_after: float = 0,
    ) -> None:
        self.app = app
        self.scope = scope
        self._body = list(body_parts)
        #: Seconds before each body part after the first (a slow uploader).
        self.body_delay = body_delay
        #: Seconds each body chunk takes to be accepted (a slow reader).
        self.send_delay = send_delay
        #: Stop reading (block every send) once this many body chunks arrived.
        self.stall_after = int(stall_after)
        self.parts_read = 0
        self._disconnect = trio.Event()
        self.response = Response()
        self._changed = trio.Event()
        self.done = trio.Event()

    async def _receive(self) -> Message:
        if self._body:
            if self.parts_read and self.body_delay:
                await trio.sleep(self.body_delay)
            chunk = self._body.pop(0)
            self.parts_read += 1
            return {"type": "http.request", "body": chunk, "more_body": bool(self._body)}
        await self._disconnect.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: Message) -> None:
        r = self.response
        if message["type"] == "http.response.start":
            r.status = message["status"]
            r.headers = {k.decode(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            if self.send_delay:
                await trio.sleep(self.send_delay)
            if self.stall_after and len(r.chunks) >= self.stall_after:
                await trio.sleep_forever()
            if message.get("body"):
                r.chunks.append((trio.current_time(), message["body"]))
            if not message.get("more_body", False):
                r.complete = True
        self._changed.set()
        self._changed = trio.Event()

    async def run(self) -> None:
        try:
            await self.app(self.scope, self._receive, self._send)
        finally:
            self.done.set()

    def disconnect(self) -> None:
        self._disconnect.set()

    async def wait_for_bytes(self, n: int = 1) -> None:
        """Wait until at least ``n`` body chunks have arrived."""
        while len(self.response.chunks) < n and not self.done.is_set():
            await self._changed.wait()


def make_scope(
    method: str, path: str, headers: dict[str, str] | None = None, http_version: str = "1.1"
) -> dict[str, Any]:
    hdrs = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    path, _, query = path.partition("?")  # as a server splits the target
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": http_version,
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": hdrs,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }


class Client:
    """Calls an ASGI app in-process."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        body: bytes | list[bytes] | None = None,
        headers: dict[str, str] | None = None,
        **options: Unpack[ExchangeOptions],
    ) -> Response:
        async with self.open(
            method, path, json_body=json_body, body=body, headers=headers, **options
        ) as ex:
            await ex.done.wait()
        return ex.response

    async def chat(
        self,
        payload: Any,
        headers: dict[str, str] | None = None,
        **options: Unpack[ExchangeOptions],
    ) -> Response:
        return await self.request(
            "POST", "/v1/chat/completions", json_body=payload, headers=headers, **options
        )

    @asynccontextmanager
    async def open(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        body: bytes | list[bytes] | None = None,
        headers: dict[str, str] | None = None,
        **options: Unpack[ExchangeOptions],
    ) -> AsyncIterator[Exchange]:
        hdrs = dict(headers or {})
        if json_body is not None:
            body = json.dumps(json_body).encode()
            hdrs.setdefault("content-type", "application/json")
        parts = body if isinstance(body, list) else [body or b""]
        ex = Exchange(self.app, make_scope(method, path, hdrs), parts, **options)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ex.run)
            yield ex
            await ex.done.wait()
            ex.disconnect()


def chat_body(text: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": "aiserve-mock", "messages": [{"role": "user", "content": text}], **extra}
