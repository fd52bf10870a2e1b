"""Fakes for unit tests (real components are used everywhere else)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import trio

from aiserve_trio.adapters.base import Adapter, Delta, DeltaSink, InferenceRequest
from aiserve_trio.adapters.retry import Progress
from aiserve_trio.core.errors import UpstreamError
from aiserve_trio.observability.events import UpstreamHook
from aiserve_trio.sessions.bus import Event, Session, SessionBus, Turn


class RecordingAdapter(Adapter):
    """Wraps an adapter; records its tries, their requests, and when one was cancelled.

    The wrapper runs the inner adapter's tries under the base's ``stream`` with
    the inner adapter's retry policy, hook and jitter, so it behaves as the
    inner adapter would.
    """

    def __init__(self, inner: Adapter) -> None:
        super().__init__(
            inner.name, inner.models, policy=inner.policy, hook=inner.hook, rng=inner.rng
        )
        self.inner = inner
        self.capabilities = inner.capabilities
        self.calls = 0
        self.requests: list[InferenceRequest] = []
        self.cancelled_at: float | None = None
        self.finished = False
        #: Deltas the inner adapter got rid of (each send into the stage's channel returned).
        self.produced = 0

    async def aopen(self, nursery: trio.Nursery) -> None:
        await self.inner.aopen(nursery)

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def ready(self) -> bool:
        return await self.inner.ready()

    async def prepare(self, request: InferenceRequest) -> InferenceRequest:
        return await self.inner.prepare(request)

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        self.calls += 1
        self.requests.append(request)
        try:
            await self.inner.attempt(request, _Counting(send, self), progress)
        except trio.Cancelled:
            self.cancelled_at = trio.current_time()
            raise
        self.finished = True


class _Counting:
    """A delta sink that counts what passed through it."""

    def __init__(self, inner: DeltaSink, rec: RecordingAdapter) -> None:
        self.inner = inner
        self.rec = rec

    async def send(self, value: Delta, /) -> None:
        await self.inner.send(value)
        self.rec.produced += 1


class RecordingHook(UpstreamHook):
    """An upstream hook that records what it is told, in order."""

    def __init__(self) -> None:
        #: ("attempt", n), ("attempt failed", n), ("retrying", err), ("failed", err)
        self.events: list[tuple[str, object]] = []
        self.adapters: set[str] = set()

    @contextlib.contextmanager
    def attempt(self, adapter: str, number: int) -> Iterator[None]:
        self.adapters.add(adapter)
        self.events.append(("attempt", number))
        try:
            yield
        except UpstreamError:
            self.events.append(("attempt failed", number))
            raise

    def retrying(self, adapter: str, error: UpstreamError) -> None:
        self.adapters.add(adapter)
        self.events.append(("retrying", error))

    def failed(self, adapter: str, error: UpstreamError) -> None:
        self.adapters.add(adapter)
        self.events.append(("failed", error))

    def tls_handshake(self, adapter: str, kind: str) -> None:
        self.adapters.add(adapter)
        self.events.append(("tls handshake", kind))

    @property
    def handshakes(self) -> list[object]:
        return [e for kind, e in self.events if kind == "tls handshake"]

    @property
    def retried(self) -> list[object]:
        return [e for kind, e in self.events if kind == "retrying"]

    @property
    def errors(self) -> list[object]:
        return [e for kind, e in self.events if kind == "failed"]


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

    async def follow(
        self,
        tenant: str,
        session_id: str,
        after: str | None,
        send: trio.MemorySendChannel[Event],
        *,
        limit: int = 100,
        block_ms: int = 5_000,
    ) -> None:
        raise AssertionError("not used by these tests")
