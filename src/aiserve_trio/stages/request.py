"""Per-request state shared by the stages, and the one writer of the response.

The stages run as separate tasks; what they learn about the request that is not
the payload itself (the degraded flag, usage, the first-token time) lives in one
:class:`RequestState`. :class:`Responder` owns the ASGI ``send``: it sends the
response head lazily, so that an error before the first byte can still become
a proper HTTP status, and knows whether the stream has started.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from ..api import error_json
from ..errors import GatewayError
from ..observability.metrics import label_value
from ..observability.tracing import NOOP_TRACE, RequestTrace
from ..security.admission import WriteTimeout

if TYPE_CHECKING:
    from ..adapters.base import Adapter, InferenceRequest, Usage
    from ..budgets import Budget
    from ..config import RouteConfig
    from ..policies.base import OutputFilter, Policy, PolicyContext
    from .sse import SSEFramer

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]

JSON_HEADERS: list[tuple[bytes, bytes]] = [(b"content-type", b"application/json")]
SSE_HEADERS: list[tuple[bytes, bytes]] = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


@dataclass(slots=True)
class Route:
    """A configured route, ready to serve: its adapter and policies are built."""

    config: RouteConfig
    label: str
    adapter: Adapter
    policies: list[Policy]
    tenant: str


_STAGE_INDEX = {"parse": 0, "context": 1, "inference": 2, "sse": 3}


@dataclass(slots=True)
class RequestState:
    """What the stages of one request share besides the payload in their channels."""

    request_id: str
    route: Route
    budget: Budget
    created: int
    channel: str
    session_id: str | None
    tenant: str
    #: Request headers, names lower-cased (last value wins).
    headers: dict[str, str]
    model: str = ""
    stream: bool = False
    include_usage: bool = False
    #: Set when the route's ``on_context_timeout = "degrade"`` let the request on.
    degraded: str | None = None
    policy_context: PolicyContext | None = None
    filters: list[OutputFilter] = field(default_factory=list)
    framer: SSEFramer | None = None
    upstream_started: bool = False
    first_token_at: float | None = None
    usage: Usage | None = None
    finish_reason: str | None = None
    #: The reply text actually delivered to the client.
    delivered: list[str] = field(default_factory=list)
    disconnected: bool = False
    #: When each stage got its input (for the stage latency histogram).
    stage_started: dict[str, float] = field(default_factory=dict)
    error: GatewayError | None = None
    error_stage: str | None = None
    #: The request handed to the adapter (it reports history trimming on it).
    inference: InferenceRequest | None = None
    #: Holds one of the worker's open-stream slots (see ``security/admission.py``).
    stream_slot: bool = False
    #: When each stage task ended (for stage spans and the debug listing).
    stage_ended: dict[str, float] = field(default_factory=dict)
    trace: RequestTrace = NOOP_TRACE
    #: Starts the stream's keep-alive watchdog (set by the pipeline).
    on_stream_start: Callable[[], None] | None = None

    def mark(self, stage: str) -> None:
        """Record that ``stage`` has its input and starts working."""
        self.stage_started[stage] = trio.current_time()

    def current_stage(self) -> str:
        """The furthest stage that has started."""
        return max(self.stage_started, key=_STAGE_INDEX.__getitem__, default="parse")

    def fail(self, stage: str, err: GatewayError) -> bool:
        """Record a stage's failure; the earliest stage in pipeline order wins.

        Returns whether ``err`` is now the request's error.
        """
        if self.error_stage is not None and _STAGE_INDEX[self.error_stage] <= _STAGE_INDEX[stage]:
            return False
        self.error, self.error_stage = err, stage
        return True

    def model_label(self) -> str:
        return label_value(self.model) if self.model else "none"

    def response_headers(self) -> list[tuple[bytes, bytes]]:
        out = [(b"x-request-id", self.request_id.encode())]
        if self.degraded:
            out.append((b"x-aiserve-degraded", self.degraded.encode()))
        if self.inference is not None and self.inference.trimmed:
            out.append((b"x-aiserve-trimmed-messages", b"%d" % self.inference.trimmed))
        tr = self.trace.traceresponse()
        if tr is not None:
            out.append((b"traceresponse", tr.encode()))
        return out


class Responder:
    """Writes one HTTP response through ASGI ``send``; remembers whether it started.

    With ``write_timeout`` (seconds) every write is bounded by its own cancel
    scope: a client that takes no byte for that long is given up on
    (:class:`WriteTimeout`). Chat streams pass None and are watched instead by
    the pipeline's keep-alive task, which reads ``writing_since`` (cheaper than
    a scope per token). Writes are serialised, so a heartbeat may go out
    between the stage's writes.
    """

    __slots__ = (
        "_lock",
        "_send",
        "finished",
        "last_write",
        "started",
        "write_timeout",
        "writing_since",
    )

    def __init__(self, send: Send, write_timeout: float | None = None) -> None:
        self._send = send
        self._lock = trio.StrictFIFOLock()
        self.started = False
        self.finished = False
        self.write_timeout = write_timeout
        #: When the last write completed (``trio.current_time()``).
        self.last_write = 0.0
        #: When the write under way started; None when none is.
        self.writing_since: float | None = None

    async def _write(self, message: dict[str, Any]) -> None:
        # Uncontended (the common case) the lock costs no checkpoint; the
        # send itself is one.
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()
        try:
            self.writing_since = trio.current_time()
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
            self.writing_since = None
            self._lock.release()

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        await self._write({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, data: bytes, *, more: bool = True) -> None:
        if not more:
            self.finished = True
        await self._write({"type": "http.response.body", "body": data, "more_body": more})

    async def ping(self) -> None:
        """An SSE comment, if the stream is open and no write is under way."""
        if self.started and not self.finished and not self._lock.locked():
            await self.body(b": ping\n\n")

    async def complete(self, status: int, headers: list[tuple[bytes, bytes]], data: bytes) -> None:
        """A whole response in one go (errors, JSON bodies)."""
        headers = [*headers, (b"content-length", str(len(data)).encode())]
        await self.start(status, headers)
        await self.body(data, more=False)

    async def error(
        self, err: GatewayError, extra: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        """An error response with the OpenAI envelope, before anything was sent."""
        headers = [*JSON_HEADERS, *(extra or [])]
        headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
        await self.complete(err.status, headers, error_json(err))
