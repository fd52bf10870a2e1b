"""OpenTelemetry tracing: a server span per request, a child span per stage.

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
from contextlib import contextmanager
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, TracerProvider

ANCHORS = ("gateway_receive_time", "inference_start_time", "first_token_time", "response_sent_time")


class Tracing:
    """Makes the spans of requests; one per app."""

    def __init__(self, provider: TracerProvider | None = None, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._tracer = trace.get_tracer("aiserve_trio", tracer_provider=provider)

    def start(self, route: str, headers: dict[str, str]) -> RequestTrace:
        return RequestTrace(self._tracer, route, headers) if self.enabled else _NOOP


class RequestTrace:
    """The spans of one request."""

    def __init__(self, tracer: trace.Tracer, route: str, headers: dict[str, str]) -> None:
        self._tracer = tracer
        parent = propagate.extract(headers) if "traceparent" in headers else None
        self.span: Span = tracer.start_span(
            f"POST {route}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"aiserve.route": route},
        )
        self._ctx: Context = trace.set_span_in_context(self.span)
        self.anchor("gateway_receive_time")

    def anchor(self, name: str) -> None:
        """Record a lifecycle anchor (an event with its wall-clock time)."""
        self.span.add_event(name, timestamp=time.time_ns())

    @contextmanager
    def stage(self, name: str) -> Iterator[Span]:
        """A child span for a pipeline stage (or an upstream attempt)."""
        with self._tracer.start_as_current_span(
            name, context=self._ctx, end_on_exit=True, record_exception=False
        ) as span:
            yield span

    def set(self, **attributes: Any) -> None:
        self.span.set_attributes({f"aiserve.{k}": v for k, v in attributes.items()})

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

    def end(self, status: int, error: str | None = None) -> None:
        self.span.set_attribute("http.response.status_code", status)
        if error is not None:
            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end()


class _NoopTrace(RequestTrace):
    def __init__(self) -> None:
        self.span = trace.INVALID_SPAN
        self._ctx = Context()

    def anchor(self, name: str) -> None:
        pass

    @contextmanager
    def stage(self, name: str) -> Iterator[Span]:
        yield trace.INVALID_SPAN

    def set(self, **attributes: Any) -> None:
        pass

    def inject(self, span: Span | None = None) -> dict[str, str]:
        return {}

    def end(self, status: int, error: str | None = None) -> None:
        pass


_NOOP = _NoopTrace()


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
