"""OpenTelemetry tracing: a server span per request, a child span per stage (and per
chain step, under the inference span).

Only ``opentelemetry-api`` is required; without an SDK the spans are
non-recording and cost little. With the optional extra
(``pip install 'aiserve-trio[otel]'``) and ``[observability] otlp_endpoint``
set, spans are exported over OTLP/HTTP.

The request span carries the lifecycle anchors as events, in order:
``gateway_receive_time``, ``inference_start_time``, ``first_token_time``,
``response_sent_time``. An incoming W3C ``traceparent`` is continued; the
inference stage forwards the trace upstream; the response carries a
``traceresponse`` header so a client can find the trace.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any

import trio
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, TracerProvider

ANCHORS = ("gateway_receive_time", "inference_start_time", "first_token_time", "response_sent_time")


_CURRENT: ContextVar[RequestTrace | None] = ContextVar("aiserve_request_trace", default=None)


class Tracing:
    """Makes the spans of requests; one per app."""

    def __init__(self, provider: TracerProvider | None = None, *, enabled: bool = True) -> None:
        provider = provider if provider is not None else trace.get_tracer_provider()
        # Without an SDK every span would be a non-recording no-op, and making
        # them anyway is not free (docs/architecture.md): skip.
        recording = not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)
        self.enabled = enabled and recording
        self._tracer = trace.get_tracer("aiserve_trio", tracer_provider=provider)

    def start(self, route: str, headers: dict[str, str], arrival: float) -> RequestTrace:
        """The request's trace; ``arrival`` is its ``trio.current_time()``."""
        if not self.enabled:
            return NOOP_TRACE
        return RequestTrace(self._tracer, route, headers, arrival)


class RequestTrace:
    """The spans of one request.

    The request span and the inference span are live (the inference span's
    context travels upstream). The parse, context and sse spans are made when
    the request ends, from the times the stages recorded, so that they show
    when each stage actually worked rather than how long its task waited for
    input -- and so that tracing adds nothing to the stages' own code paths.
    """

    def __init__(
        self, tracer: trace.Tracer, route: str, headers: dict[str, str], arrival: float
    ) -> None:
        self._tracer = tracer
        # ``arrival`` may be earlier than now (the server's read of the request's head,
        # ``runtime/entry.py``): the span starts then, its wait in the server inside it.
        self._wall0 = time.time_ns() - max(0, int((trio.current_time() - arrival) * 1e9))
        self._clock0 = arrival
        parent = propagate.extract(headers) if "traceparent" in headers else None
        self.span: Span = tracer.start_span(
            f"POST {route}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"aiserve.route": route},
            start_time=self._wall0,
        )
        self._ctx: Context = trace.set_span_in_context(self.span)

    def wall_ns(self, clock: float) -> int:
        """A ``trio.current_time()`` reading as wall-clock nanoseconds."""
        return self._wall0 + int((clock - self._clock0) * 1e9)

    def live_stage(self, name: str) -> AbstractContextManager[Span]:
        """A live child span (the inference stage); upstream attempts nest under it."""
        return self._live_stage(name)

    @contextmanager
    def _live_stage(self, name: str) -> Iterator[Span]:
        with self._tracer.start_as_current_span(
            name, context=self._ctx, record_exception=False, set_status_on_exception=False
        ) as span:
            token = _CURRENT.set(self)
            try:
                yield span
            finally:
                _CURRENT.reset(token)

    def live_step(
        self, name: str, kind: str, *, current: bool = True
    ) -> AbstractContextManager[Span]:
        """A live span for one step of a chain, under the current span (inference);
        the step's upstream attempts nest under it -- unless ``current`` is off (a
        step that runs alongside another, whose attempts they are)."""
        return self._live_step(name, kind, current)

    @contextmanager
    def _live_step(self, name: str, kind: str, current: bool) -> Iterator[Span]:
        attributes = {"aiserve.step": name, "aiserve.step_kind": kind}
        if not current:
            span = self._tracer.start_span(f"step {name}", attributes=attributes)
            try:
                yield span
            finally:
                span.end()
            return
        with self._tracer.start_as_current_span(
            f"step {name}",
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            yield span

    def inject(self, span: Span | None = None) -> dict[str, str]:
        """Headers that carry the trace upstream (``traceparent``, ``tracestate``).

        Args:
            span: the span the upstream call belongs to; default the request's.
        """
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span or self.span))
        return carrier

    @property
    def trace_id(self) -> str | None:
        sc = self.span.get_span_context()
        return format(sc.trace_id, "032x") if sc.is_valid else None

    def traceresponse(self) -> str | None:
        """The W3C ``traceresponse`` header value, if there is a trace to point at."""
        sc = self.span.get_span_context()
        if not sc.is_valid:
            return None
        return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"

    def finish(
        self,
        *,
        stages: dict[str, tuple[float, float]],
        anchors: dict[str, float],
        end: float,
        status: str,
        error: str | None,
        attributes: dict[str, Any],
    ) -> None:
        """End the request: stage spans from recorded times, anchors, status.

        Args:
            stages: (start, end) clock times of the stages without a live span.
            anchors: clock time of each lifecycle anchor that happened.
            end: the clock time the response was sent.
        """
        for name, (t0, t1) in stages.items():
            span = self._tracer.start_span(name, context=self._ctx, start_time=self.wall_ns(t0))
            span.end(end_time=self.wall_ns(t1))
        for name in ANCHORS:
            if name in anchors:
                self.span.add_event(name, timestamp=self.wall_ns(anchors[name]))
        self.span.set_attributes({f"aiserve.{k}": v for k, v in attributes.items()})
        self.span.set_attribute("aiserve.outcome", status)
        if error is not None:
            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end(end_time=self.wall_ns(end))


#: The span of an operation that is not traced: one context manager for all of them.
_NO_SPAN: AbstractContextManager[Span] = nullcontext(trace.INVALID_SPAN)


class _NoopTrace(RequestTrace):
    def __init__(self) -> None:
        self.span = trace.INVALID_SPAN
        self._ctx = Context()

    def live_stage(self, name: str) -> AbstractContextManager[Span]:
        return _NO_SPAN

    def live_step(
        self, name: str, kind: str, *, current: bool = True
    ) -> AbstractContextManager[Span]:
        return _NO_SPAN

    def inject(self, span: Span | None = None) -> dict[str, str]:
        return {}

    def finish(
        self,
        *,
        stages: dict[str, tuple[float, float]],
        anchors: dict[str, float],
        end: float,
        status: str,
        error: str | None,
        attributes: dict[str, Any],
    ) -> None:
        pass


#: The trace of a request when tracing is off.
NOOP_TRACE: RequestTrace = _NoopTrace()


def upstream_attempt(attempt: int, **attributes: Any) -> AbstractContextManager[Span]:
    """A span for one upstream attempt, under the current inference span.

    Adapters call this around each try; outside a traced request it is a no-op.
    """
    rt = _CURRENT.get()
    if rt is None or rt is NOOP_TRACE:
        return _NO_SPAN
    attrs = {"aiserve.attempt": attempt, **{f"aiserve.{k}": v for k, v in attributes.items()}}
    return rt._tracer.start_as_current_span(
        "upstream_attempt", attributes=attrs, record_exception=False
    )


def configure_otlp(endpoint: str, service_name: str) -> TracerProvider:
    """An SDK provider exporting to ``endpoint`` over OTLP/HTTP (needs the ``otel`` extra).

    Raises:
        RuntimeError: the SDK or the exporter is not installed.
    """
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider as SDKProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError(
            "`observability.otlp_endpoint` needs the OpenTelemetry SDK: "
            "pip install 'aiserve-trio[otel]'"
        ) from exc
    provider = SDKProvider(resource=Resource.create({"service.name": service_name}))
    # The batch processor exports from its own thread, off the request path.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider
