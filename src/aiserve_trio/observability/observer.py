"""The one sink of the request path's event hook: Prometheus, OpenTelemetry, the baseline,
the debug list.

:class:`RequestObserver` implements :class:`~.events.Hook`. Everything an
operator uses to attribute latency (request -> stage -> upstream attempt) is
recorded here, off the stages' own code paths: the stages and adapters only
say what happened.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from opentelemetry.trace import Span

from ..core.errors import Shed, StageDeadlineExceeded
from .baseline import BaselineMonitor
from .metrics import STAGES, Metrics, label_value
from .tracing import NOOP_TRACE, upstream_attempt

if TYPE_CHECKING:
    from prometheus_client import Counter, Histogram

    from ..core.errors import UpstreamError
    from ..stages.outcome import Outcome

log = logging.getLogger("aiserve_trio.observer")


class RecordSink(Protocol):
    """Takes finished requests for the traffic recording (``record.recorder.Recorder``)."""

    def offer(self, outcome: Outcome) -> None:
        """Queue ``outcome`` if it is to be recorded; never blocks."""
        ...


class RecentRequest(msgspec.Struct, kw_only=True):
    request_id: str
    route: str
    model: str
    channel: str
    outcome: str
    total_ms: float
    ttft_ms: float | None
    #: Milliseconds each stage worked (from getting its input to its end).
    stages_ms: dict[str, float]
    trace_id: str | None = None
    error_stage: str | None = None
    #: Writes to the client (ASGI sends) and body bytes; upstream reads and bytes.
    client_writes: int = 0
    client_bytes: int = 0
    upstream_reads: int = 0
    upstream_bytes: int = 0
    #: The tenant it acted for ("" with auth off).
    tenant: str = ""


class RecentList(msgspec.Struct, kw_only=True):
    requests: list[RecentRequest]


#: What is kept of a finished request for the listing: total and TTFT seconds, then the
#: fields of :class:`RecentRequest` as the outcome had them (see ``_listed``).
_Recent = tuple[
    float, float | None, str, str, str, str, str, Mapping[str, tuple[float, float]], str | None,
    str | None, int, int, int, int, str,
]


class _RouteModel:
    """The metric children one (route, model) pair touches at the end of every request."""

    __slots__ = (
        "completion",
        "duration",
        "model_completion",
        "model_prompt",
        "model_ttft",
        "prompt",
        "ttft",
    )

    def __init__(self, m: Metrics, route: str, model: str) -> None:
        self.ttft = m.ttft.labels(route)
        self.model_ttft = m.model_ttft.labels(route, model)
        self.prompt = m.tokens.labels(route, "prompt")
        self.completion = m.tokens.labels(route, "completion")
        self.model_prompt = m.model_tokens.labels(route, model, "prompt")
        self.model_completion = m.model_tokens.labels(route, model, "completion")
        self.duration = m.request_duration.labels(route, model)


class RequestObserver:
    """Records what the request path reports; one per app."""

    def __init__(
        self,
        metrics: Metrics,
        baseline: BaselineMonitor | None,
        *,
        keep_recent: int = 0,
        recorder: RecordSink | None = None,
        sinks: Sequence[RecordSink] = (),
    ) -> None:
        """Args:
        recorder: the traffic recording, when ``[record]`` is on.
        sinks: more takers of every finished request: the spend counters, the audit log.
        """
        self.metrics = metrics
        self.baseline = baseline
        self.keep_recent = keep_recent
        # The slowest are picked from a window ten times the listing's size.
        self._recent: deque[_Recent] = deque(maxlen=max(keep_recent * 10, 1))
        m = metrics
        # Children bound once: `labels()` is a dict lookup under a lock per call.
        # Live stage tasks: plain counts, which the gauge reads when it is scraped
        # (two updates per stage per request; a gauge's inc and dec each take a lock).
        self._live = dict.fromkeys(STAGES, 0)
        for stage in STAGES:
            m.task_count.labels(stage).set_function(partial(self._live.__getitem__, stage))
        self._latency = {s: m.stage_latency.labels(s) for s in STAGES}
        self._children: dict[tuple[Any, ...], Any] = {}
        # Bounded: routes and models come from the config (unknown models are folded).
        self._route_models: dict[tuple[str, str], _RouteModel] = {}
        self._attempts: dict[tuple[str, str], Any] = {}
        #: The traffic recording, when ``[record]`` is on.
        self.recorder = recorder
        #: More takers of every finished request: the spend counters, the audit log.
        self.sinks: list[RecordSink] = list(sinks)

    def _child(self, metric: Counter | Histogram, *values: str) -> Any:
        key = (metric, *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.metrics.child(metric, *values)
        return child

    # --- stages ---------------------------------------------------------------

    def stage_started(self, stage: str) -> None:
        self._live[stage] += 1

    def stage_ended(self, stage: str, worked: float | None, expired: str | None) -> None:
        self._live[stage] -= 1
        if worked is not None:
            self._latency[stage].observe(worked)
        if expired is not None:
            self.metrics.stage_expiries.labels(label_value(expired)).inc()

    # --- upstream -------------------------------------------------------------

    def _attempt(self, adapter: str, result: str) -> Any:
        child = self._attempts.get((adapter, result))
        if child is None:
            child = self._attempts[adapter, result] = self.metrics.upstream_attempts.labels(
                adapter, result
            )
        return child

    def attempt(self, adapter: str, number: int) -> _Attempt:
        """One upstream try: its span, and its result counted (ok, failed, cancelled)."""
        return _Attempt(self, adapter, upstream_attempt(number, adapter=adapter))

    def retrying(self, adapter: str, error: UpstreamError) -> None:
        self.metrics.upstream_retries.labels(adapter).inc()

    def failed(self, adapter: str, error: UpstreamError) -> None:
        self.metrics.upstream_errors.labels(adapter, error.code or "upstream_error").inc()

    def tls_handshake(self, adapter: str, kind: str) -> None:
        self.metrics.upstream_tls_handshakes.labels(adapter, kind).inc()

    # --- the response cache ---------------------------------------------------

    def cache_error(self, op: str) -> None:
        self._child(self.metrics.cache_backend_errors, op).inc()

    def cache_stored(self, route: str, result: str) -> None:
        self._child(self.metrics.cache_stores, route, result).inc()

    def cache_similarity(self, route: str, similarity: float, result: str) -> None:
        self._child(self.metrics.cache_similarity, route, result).observe(similarity)

    # --- the end of a request -------------------------------------------------

    def server_wait(self, seconds: float) -> None:
        """A request waited ``seconds`` in the server (its head read, its app not started)."""
        self.metrics.server_wait.observe(seconds)

    def request_complete(self, outcome: Outcome) -> None:
        """Count and keep what a request did, then offer it to the sinks (the audit log,
        the spend counters): a failure in one never keeps the others from it -- a row and
        a charge are never lost to a metric that refused a value."""
        try:
            self._measure(outcome)
        except Exception:
            log.exception("request %s could not be measured", outcome.request_id)
        for sink in self.sinks:
            try:
                sink.offer(outcome)
            except Exception:
                log.exception("a sink refused request %s", outcome.request_id)

    def _measure(self, outcome: Outcome) -> None:
        m = self.metrics
        route = outcome.route
        model = outcome.model_label
        self._child(m.requests, route, model, outcome.channel, outcome.status).inc()
        if outcome.policy is not None:  # policy names like "gdpr-redact" are folded
            for (policy, action), n in outcome.policy.counts.items():
                self._child(m.policy_actions, label_value(policy), action).inc(n)
        if outcome.info is None and isinstance(outcome.error, StageDeadlineExceeded):
            # Served outside the pipeline's stage shells (embeddings), which count theirs.
            m.stage_expiries.labels(label_value(outcome.error.stage)).inc()
        if isinstance(outcome.error, Shed):
            m.shed.labels(outcome.error.reason).inc()
        if outcome.disconnected:
            m.disconnects.labels(outcome.error_stage or "parse").inc()
        if outcome.capped is not None:
            m.caps.labels(route, outcome.capped).inc()
        if outcome.chain is not None:
            for step in outcome.chain.steps:
                self._child(m.chain_step_latency, route, step.name).observe(
                    step.ended - step.started
                )
        if outcome.cache is not None:
            # ``semantic-hit`` (the header's spelling) is ``semantic_hit`` as a label.
            self._child(m.cache_requests, route, outcome.cache.replace("-", "_")).inc()
            if self.baseline is not None and outcome.cache != "bypass":
                # The storm detector's hit ratio: answered without a model call or not.
                self.baseline.record_cache(route, outcome.cache in ("hit", "coalesced"))
        rm = self._route_models.get((route, model))
        if rm is None:
            rm = self._route_models[route, model] = _RouteModel(m, route, model)
        if outcome.first_token_at is not None:
            ttft = outcome.first_token_at - outcome.arrival
            rm.ttft.observe(ttft)
            rm.model_ttft.observe(ttft)
        usage = outcome.usage
        if usage is not None:
            rm.prompt.inc(usage.prompt_tokens)
            rm.model_prompt.inc(usage.prompt_tokens)
            rm.completion.inc(usage.completion_tokens)
            rm.model_completion.inc(usage.completion_tokens)
        total = outcome.ended - outcome.arrival
        if outcome.ok:
            rm.duration.observe(total)
            if self.baseline is not None:
                self.baseline.record(route, total, usage.prompt_tokens if usage else 0)
        if outcome.info is not None and outcome.info.trace is not NOOP_TRACE:
            self._trace(outcome)
        if self.keep_recent:
            self._remember(outcome)
        if self.recorder is not None:
            self.recorder.offer(outcome)

    def request_refused(self, outcome: Outcome) -> None:
        """A chat request the gate refused before its handler ran (bad key, rate,
        budget): only the sinks (the audit log) take it; the request metrics count
        what reached a route."""
        for sink in self.sinks:
            sink.offer(outcome)

    @staticmethod
    def _trace(outcome: Outcome) -> None:
        assert outcome.info is not None
        # The inference stage has a live span of its own.
        stages = {k: v for k, v in outcome.stages.items() if k != "inference"}
        anchors = {"gateway_receive_time": outcome.arrival, "response_sent_time": outcome.ended}
        if "inference" in outcome.stages:
            anchors["inference_start_time"] = outcome.stages["inference"][0]
        if outcome.first_token_at is not None:
            anchors["first_token_time"] = outcome.first_token_at
        attrs: dict[str, Any] = {"model": outcome.model, "channel": outcome.channel}
        if outcome.usage is not None:
            attrs["prompt_tokens"] = outcome.usage.prompt_tokens
            attrs["completion_tokens"] = outcome.usage.completion_tokens
        attrs["client_writes"] = outcome.client_writes
        attrs["client_bytes"] = outcome.client_bytes
        attrs["upstream_reads"] = outcome.upstream_reads
        attrs["upstream_bytes"] = outcome.upstream_bytes
        if outcome.cache is not None:
            attrs["cache"] = outcome.cache
        if outcome.chain is not None:
            attrs["steps"] = ",".join(outcome.chain.names)
        if outcome.cost or outcome.saved:
            attrs["cost"] = outcome.cost
            attrs["served_model"] = outcome.served_model
        error = outcome.error.message if outcome.error is not None else None
        outcome.info.trace.finish(
            stages=stages,
            anchors=anchors,
            end=outcome.ended,
            status=outcome.status,
            error=error,
            attributes=attrs,
        )

    def _remember(self, outcome: Outcome) -> None:
        # The raw numbers only: the listing (rounded milliseconds) is built when asked for.
        arrival = outcome.arrival
        ttft = outcome.first_token_at
        self._recent.append(
            (
                outcome.ended - arrival,
                None if ttft is None else ttft - arrival,
                outcome.request_id,
                outcome.route,
                outcome.served_model or outcome.model,
                outcome.channel,
                outcome.status,
                outcome.stages,
                outcome.info.trace.trace_id if outcome.info is not None else None,
                outcome.error_stage,
                outcome.client_writes,
                outcome.client_bytes,
                outcome.upstream_reads,
                outcome.upstream_bytes,
                outcome.tenant,
            )
        )

    def slowest(self, tenant: str | None = None) -> RecentList:
        """The slowest of the recent requests, slowest first; of one ``tenant``'s only
        when given (what an admin of that tenant may see)."""
        kept = self._recent if tenant is None else [r for r in self._recent if r[14] == tenant]
        ranked = sorted(kept, key=lambda r: r[0], reverse=True)[: self.keep_recent]
        return RecentList(requests=[_listed(r) for r in ranked])


def _listed(r: _Recent) -> RecentRequest:
    (total, ttft, request_id, route, model, channel, status, stages, trace_id, error_stage,
     writes, written, reads, read, tenant) = r
    return RecentRequest(
        request_id=request_id,
        route=route,
        model=model,
        channel=channel,
        outcome=status,
        total_ms=round(total * 1000, 3),
        ttft_ms=round(ttft * 1000, 3) if ttft is not None else None,
        stages_ms={name: round((t1 - t0) * 1000, 3) for name, (t0, t1) in stages.items()},
        trace_id=trace_id,
        error_stage=error_stage,
        client_writes=writes,
        client_bytes=written,
        upstream_reads=reads,
        upstream_bytes=read,
        tenant=tenant,
    )


class _Attempt:
    """:meth:`RequestObserver.attempt`'s block (a class: entered on every upstream try)."""

    __slots__ = ("_adapter", "_observer", "_span", "_span_cm")

    def __init__(
        self, observer: RequestObserver, adapter: str, span: AbstractContextManager[Span]
    ) -> None:
        self._observer = observer
        self._adapter = adapter
        self._span_cm = span
        self._span: Span | None = None

    def __enter__(self) -> None:
        self._span = self._span_cm.__enter__()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if exc is None:
            result = "ok"
        elif isinstance(exc, Exception):
            code = getattr(exc, "code", None) or type(exc).__name__
            if self._span is not None:
                self._span.set_attribute("aiserve.error_code", code)
            result = "failed"
        else:  # cancelled: a hedge's loser, a client gone, the deadline
            result = "cancelled"
        self._observer._attempt(self._adapter, result).inc()
        return self._span_cm.__exit__(exc_type, exc, tb)
