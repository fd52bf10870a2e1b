"""Fakes for unit tests (real components are used everywhere else)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import trio

from aiserve_trio.adapters.base import Adapter, Delta, InferenceRequest
from aiserve_trio.sessions.bus import Event, Session, SessionBus, Turn


class RecordingAdapter(Adapter):
    """Wraps an adapter; records calls, requests, and when it was cancelled."""

    def __init__(self, inner: Adapter) -> None:
        super().__init__(inner.name, inner.models)
        self.inner = inner
        self.calls = 0
        self.requests: list[InferenceRequest] = []
        self.cancelled_at: float | None = None
        self.finished = False

    async def prepare(self, request: InferenceRequest) -> InferenceRequest:
        return await self.inner.prepare(request)

    async def stream(self, request: InferenceRequest, send: trio.MemorySendChannel[Delta]) -> None:
        self.calls += 1
        self.requests.append(request)
        try:
            await self.inner.stream(request, send)
        except trio.Cancelled:
            self.cancelled_at = trio.current_time()
            raise
        self.finished = True


class SlowBus(SessionBus):
    """A session bus whose loads take ``delay`` seconds (a slow Redis)."""

    def __init__(self, delay: float, session: Session | None = None) -> None:
        self.delay = delay
        self.session = session or Session()

    async def ping(self) -> bool:
        return True

    async def load(self, tenant: str, session_id: str, history_turns: int, ttl: int) -> Session:
        await trio.sleep(self.delay)
        return self.session

    async def append(self, tenant: str, session_id: str, turns: list[Turn], ttl: int) -> list[str]:
        return []

    async def set_vars(
        self, tenant: str, session_id: str, values: dict[str, str], ttl: int
    ) -> None:
        self.session.variables.update(values)

    def follow(self, tenant: str, session_id: str, after: str | None) -> AsyncIterator[Event]:
        raise AssertionError("not used by these tests")
