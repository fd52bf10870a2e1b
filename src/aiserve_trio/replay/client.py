"""Sending recorded requests over HTTP (httpx2 under Trio): the I/O half of a replay.

:class:`HttpSender` is the ``send`` of :func:`~.runner.run`: it posts a record's
body as it was recorded, with its recorded headers (channel, hashed session id,
timeout) and the API key, and reports the response to the timer chunk by chunk.
A ``/mcp`` line (a recorded tool call) goes as the stateless 2026-07-28 request it
was recorded as: its JSON-RPC message (the version in its ``_meta``), the
``MCP-Protocol-Version`` header, no session.
It sets no timeout of its own: the runner bounds every request.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from urllib.parse import urlsplit

import httpx2
import trio

from ..record.schema import (
    HEADERS,
    MCP_ROUTE,
    MCP_VERSION,
    REPLAY_HEADER,
    SESSION_HEADER,
    Record,
)
from .schedule import Slot
from .timing import StreamTimer

_USER_AGENT = "aiserve-replay"


def request_url(target: str, route: str) -> str:
    """Where a record goes: the target's own path when it has one, else the record's route."""
    parts = urlsplit(target)
    if parts.path not in ("", "/"):
        return target
    return target.rstrip("/") + route


def request_headers(
    record: Record, api_key: str | None, run_id: str, *, sessions: bool = False
) -> list[tuple[str, str]]:
    """The recorded headers that a record may carry, the content type, the key, and the
    replay's mark (``run_id``), so that a recording target leaves the replay out.

    ``sessions``: send the (hashed) session id, so a target with sessions builds
    the conversations' history again as the recording goes on.
    """
    mcp = record.route == MCP_ROUTE
    keep = HEADERS if sessions and not mcp else tuple(h for h in HEADERS if h != SESSION_HEADER)
    headers = [
        ("content-type", "application/json"),
        ("user-agent", _USER_AGENT),
        (REPLAY_HEADER, run_id),
    ]
    if mcp:  # stateless: the version says so, and no Mcp-Session-Id is sent
        headers += [
            ("accept", "application/json, text/event-stream"),
            ("mcp-protocol-version", MCP_VERSION),
        ]
    headers += [(k, v) for k, v in record.headers.items() if k in keep]
    if api_key:
        headers.append(("authorization", f"Bearer {api_key}"))
    return headers


class HttpSender:
    """Sends records to a target through one pooled httpx2 client."""

    def __init__(
        self,
        records: Sequence[Record],
        target: str,
        *,
        api_key: str | None,
        max_connections: int,
        sessions: bool = False,
        transport: httpx2.AsyncBaseTransport | None = None,
    ) -> None:
        self.records = records
        self.target = target
        self.api_key = api_key
        self.sessions = sessions
        #: This replay's mark on every request it sends.
        self.run_id = secrets.token_hex(8)
        limits = httpx2.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )
        # No client timeout: the runner's cancel scope is the one deadline.
        self.client = httpx2.AsyncClient(
            limits=limits, timeout=None, transport=transport, trust_env=False
        )

    async def __call__(self, slot: Slot, timer: StreamTimer) -> None:
        record = self.records[slot.record]
        url = request_url(self.target, record.route)
        body = bytes(record.body)
        headers = request_headers(record, self.api_key, self.run_id, sessions=self.sessions)
        async with self.client.stream("POST", url, content=body, headers=headers) as response:
            timer.head(response.status_code)
            async for chunk in response.aiter_bytes():
                timer.feed(chunk, trio.current_time())

    async def aclose(self) -> None:
        await self.client.aclose()
