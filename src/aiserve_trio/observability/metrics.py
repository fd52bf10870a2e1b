"""Prometheus metrics, one registry per app.

Label values must match ``^[a-z][a-z0-9_]*$``. Values the config fixes (stage
and route names) are checked and refused if they do not; values derived from
requests (model, channel) go through :func:`label_value`, which folds them into
that alphabet, and are bounded by the caller (only configured models reach here;
unknown channels are ``other``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from http import HTTPStatus
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from ..core.budgets import STAGES
from .baseline import Assessment

#: The semantic cache's similarity histogram: fine near the thresholds one tunes.
SIMILARITY_BUCKETS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.88, 0.9, 0.92, 0.94, 0.96, 0.98, 0.99, 1.0)

__all__ = ["STAGES", "Metrics", "check_label", "label_value", "status_label"]

M = TypeVar("M", bound=MetricWrapperBase)

LABEL_RE = re.compile(r"^[a-z][a-z0-9_]*$")
#: 1 ms x 2^k, 16 buckets: 1 ms .. ~32.8 s.
STAGE_BUCKETS = tuple(0.001 * 2**k for k in range(16))
_FOLD_RE = re.compile(r"[^a-z0-9_]+")


def check_label(value: str) -> str:
    """Return ``value`` if it is a valid label value.

    Raises:
        ValueError: it does not match ``^[a-z][a-z0-9_]*$``.
    """
    if not LABEL_RE.match(value):
        raise ValueError(f"label value {value!r} does not match {LABEL_RE.pattern}")
    return value


def label_value(raw: str) -> str:
    """Fold any string into a valid label value (``gpt-4o`` -> ``gpt_4o``)."""
    folded = _FOLD_RE.sub("_", raw.lower()).strip("_")
    if not folded:
        return "none"
    return folded if folded[0].isalpha() else f"x_{folded}"


def status_label(status: int) -> str:
    """``200`` -> ``ok``, ``504`` -> ``gateway_timeout``: a label-safe HTTP status."""
    try:
        return HTTPStatus(status).name.lower()
    except ValueError:
        return f"status_{status}"


class Metrics:
    """The gateway's metrics and the registry ``GET /metrics`` renders."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self._add_requests(r)
        self._add_upstream(r)
        self._add_sessions(r)
        self._add_operations(r)
        self._add_sla_and_baseline(r)
        self._add_cache(r)

    def _add_requests(self, r: CollectorRegistry) -> None:
        """The requests: stage times and live tasks, results, first tokens, deadlines, tokens,
        disconnects, caps and chain steps."""
        self.stage_latency = Histogram(
            "pipeline_stage_latency_seconds",
            "Time spent in each pipeline stage.",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.task_count = Gauge(
            "task_count_by_stage",
            "Live pipeline tasks per stage (the Trio analogue of a goroutine count).",
            ["stage"],
            registry=r,
        )
        self.requests = Counter(
            "aiserve_requests",
            "Finished chat requests by route, model, channel and HTTP status.",
            ["route", "model", "channel", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "aiserve_time_to_first_token_seconds",
            "Arrival to the first content byte sent to the client.",
            ["route"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.stage_expiries = Counter(
            "aiserve_stage_deadline_expiries",
            "Deadlines run out, by the stage or chain step named: cut points passed, and "
            "refusals to start an upstream call with too little of the budget left.",
            ["stage"],
            registry=r,
        )
        self.server_wait = Histogram(
            "aiserve_server_wait_seconds",
            "From the server's read of a request's head to its app task's start (with the "
            "hypercorn seam): inside the request's deadline, before any stage.",
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.shed = Counter(
            "aiserve_shed",
            "Requests shed under overload (503 with Retry-After), by reason: queue (waited "
            "past [deadline] queue_share), ttft (a stream past its ttft_ms).",
            ["reason"],
            registry=r,
        )
        self.tokens = Counter(
            "aiserve_tokens",
            "Tokens by route and direction (prompt, completion).",
            ["route", "direction"],
            registry=r,
        )
        self.disconnects = Counter(
            "aiserve_client_disconnects",
            "Requests ended because the client went away.",
            ["stage"],
            registry=r,
        )
        self.caps = Counter(
            "aiserve_reply_caps",
            "Replies a route's cap ended early (max_tokens, max_reply_bytes, max_stream_s).",
            ["route", "cap"],
            registry=r,
        )
        self.chain_step_latency = Histogram(
            "aiserve_chain_step_latency_seconds",
            "Time each step of a route's chain took (chains/), by route and step name.",
            ["route", "step"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        for stage in STAGES:
            self.task_count.labels(stage)
            self.stage_latency.labels(stage)

    def _add_upstream(self, r: CollectorRegistry) -> None:
        """The backends: failures, tries, retries, TLS handshakes."""
        self.upstream_errors = Counter(
            "aiserve_upstream_errors",
            "Upstream failures by adapter and error code.",
            ["adapter", "code"],
            registry=r,
        )
        self.upstream_attempts = Counter(
            "aiserve_upstream_attempts",
            "Upstream tries by adapter (a group's deployment) and result (ok, failed, cancelled).",
            ["adapter", "result"],
            registry=r,
        )
        self.upstream_retries = Counter(
            "aiserve_upstream_retries",
            "Upstream attempts retried before the first token.",
            ["adapter"],
            registry=r,
        )
        self.upstream_tls_handshakes = Counter(
            "aiserve_upstream_tls_handshakes",
            "TLS handshakes with a backend by adapter and kind (full, resumed).",
            ["adapter", "kind"],
            registry=r,
        )

    def _add_sessions(self, r: CollectorRegistry) -> None:
        """The session bus and the outbox in front of it."""
        self.session_errors = Counter(
            "aiserve_session_bus_errors",
            "Session bus operations that failed.",
            ["op"],
            registry=r,
        )
        self.session_outbox_size = Gauge(
            "aiserve_session_outbox_size",
            "Session turn writes waiting in the in-process outbox for the bus to return.",
            registry=r,
        )
        self.session_outbox_dropped = Counter(
            "aiserve_session_outbox_dropped",
            "Session turn writes dropped because the outbox was full.",
            registry=r,
        )
        self.session_bytes = Gauge(
            "aiserve_session_bytes",
            "Bytes the memory session bus holds in this worker (bounded by [sessions] max_bytes).",
            registry=r,
        )
        self.sessions_held = Gauge(
            "aiserve_sessions",
            "Sessions the memory session bus holds in this worker ([sessions] max_sessions).",
            registry=r,
        )

    def _add_operations(self, r: CollectorRegistry) -> None:
        """Policies' actions, configuration reloads, the traffic recording."""
        self.policy_actions = Counter(
            "policy_actions",
            "Actions taken by policies (redacted, blocked, flagged, rewritten).",
            ["policy", "action"],
            registry=r,
        )
        self.config_reloads = Counter(
            "aiserve_config_reloads",
            "Configuration reloads, by result (applied, refused, unchanged).",
            ["result"],
            registry=r,
        )
        self.records_written = Counter(
            "aiserve_records_written",
            "Requests written to the traffic recording ([record]).",
            registry=r,
        )
        self.record_dropped = Counter(
            "aiserve_record_dropped",
            "Requests the recording dropped: its buffer was full (the disk is slow), "
            "writing failed, the request could not be recorded, or aiserve-replay sent it "
            "(left out unless [record] include_replays = true).",
            ["reason"],
            registry=r,
        )

    def _add_cache(self, r: CollectorRegistry) -> None:
        """The response cache (cache issue): results, stores, backend failures, what is held."""
        self.cache_requests = Counter(
            "aiserve_cache_requests",
            "Requests on routes with a cache, by result: hit, semantic_hit (a stored answer "
            "to a question worded differently, every guard equal), miss, coalesced (shared "
            "an identical request's answer in flight), bypass (not looked up).",
            ["route", "result"],
            registry=r,
        )
        self.cache_stores = Counter(
            "aiserve_cache_stores",
            "Finished answers stored, or why not (unfinished, refused, capped, too_large).",
            ["route", "result"],
            registry=r,
        )
        self.cache_backend_errors = Counter(
            "aiserve_cache_backend_errors",
            "Cache backend calls that failed, timed out or were skipped while it was down "
            "(the request went on without the cache).",
            ["op"],
            registry=r,
        )
        self.cache_similarity = Histogram(
            "aiserve_cache_semantic_similarity",
            "Semantic lookups' nearest stored question under the same guard: its cosine "
            "similarity, by result (hit: at or above the route's threshold, served; miss).",
            ["route", "result"],
            buckets=SIMILARITY_BUCKETS,
            registry=r,
        )
        self.cache_bytes = Gauge(
            "aiserve_cache_bytes",
            "Bytes of entries this worker holds (memory backend).",
            registry=r,
        )
        self.cache_entries = Gauge(
            "aiserve_cache_entries", "Entries this worker holds (memory backend).", registry=r
        )
        self.cache_semantic_bytes = Gauge(
            "aiserve_cache_semantic_bytes",
            "Bytes this worker's semantic index holds (vectors, unused rows, questions, "
            "overheads), bounded by [cache] semantic_max_bytes; not in aiserve_cache_bytes.",
            registry=r,
        )
        self.cache_flights = Gauge(
            "aiserve_cache_flights",
            "Answers in flight that identical requests share (single flight).",
            registry=r,
        )
        self.cache_redis_hits = Gauge(
            "aiserve_cache_redis_keyspace_hits",
            "Redis INFO stats keyspace_hits of the cache's server, as last read.",
            registry=r,
        )
        self.cache_redis_misses = Gauge(
            "aiserve_cache_redis_keyspace_misses",
            "Redis INFO stats keyspace_misses of the cache's server, as last read.",
            registry=r,
        )

    def watch_cache(
        self,
        held: Callable[[], tuple[int, int]],
        flights: Callable[[], int],
        server: Callable[[], Mapping[str, float]],
        semantic: Callable[[], int] = lambda: 0,
    ) -> None:
        """Read the cache's gauges at scrape time: (bytes, entries) held, flights, the
        Redis server's counters as the cache last read them, the semantic index's bytes."""
        self.cache_bytes.set_function(lambda: float(held()[0]))
        self.cache_semantic_bytes.set_function(lambda: float(semantic()))
        self.cache_entries.set_function(lambda: float(held()[1]))
        self.cache_flights.set_function(lambda: float(flights()))
        self.cache_redis_hits.set_function(lambda: server().get("keyspace_hits", 0.0))
        self.cache_redis_misses.set_function(lambda: server().get("keyspace_misses", 0.0))

    def watch_turns(self, now: Callable[[], tuple[int, int, int]]) -> None:
        """Read the worker's queue of chat requests starting at scrape time: (bound now,
        starting, waiting)."""
        r = self.registry
        Gauge(
            "aiserve_starting_limit",
            "Chat requests the worker lets start at once now: between [deadline] "
            "min_starting and max_starting, moved by the run loop's load.",
            registry=r,
        ).set_function(functools.partial(_nth, now, 0))
        Gauge(
            "aiserve_starting",
            "Chat requests starting now (between their turn and their upstream call).",
            registry=r,
        ).set_function(functools.partial(_nth, now, 1))
        Gauge(
            "aiserve_starting_waiting",
            "Chat requests waiting for their turn (read, or left unread by the server).",
            registry=r,
        ).set_function(functools.partial(_nth, now, 2))

    def watch_sessions(self, held: Callable[[], tuple[int, int]]) -> None:
        """Read the memory session bus's (bytes, sessions) at scrape time."""
        self.session_bytes.set_function(lambda: float(held()[0]))
        self.sessions_held.set_function(lambda: float(held()[1]))

    def _add_sla_and_baseline(self, r: CollectorRegistry) -> None:
        """Per-model SLA histograms and the dynamic-baseline gauges (observability issue)."""
        self.request_duration = Histogram(
            "aiserve_request_duration_seconds",
            "Arrival to the last byte of successful requests, by route and model.",
            ["route", "model"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.model_ttft = Histogram(
            "aiserve_model_time_to_first_token_seconds",
            "Arrival to the first content byte, by route and model.",
            ["route", "model"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.model_tokens = Counter(
            "aiserve_model_tokens",
            "Tokens by route, model and direction (prompt, completion).",
            ["route", "model", "direction"],
            registry=r,
        )
        docs = {
            "baseline_coefficient": "Fitted P90 = a*RPS + b*avg_input_tokens + c, by term.",
            "baseline_predicted_p90_seconds": "P90 the fit predicts for the last window's load.",
            "baseline_observed_p90_seconds": "P90 observed in the last window.",
            "baseline_ratio": "Observed / predicted P90 in the last window.",
            "latency_anomaly": "1 when observed P90 exceeds the prediction by the set factor.",
            "cache_hit_ratio_change": "Relative change of the cache hit ratio in the last window.",
            "p99_change": "Relative change of P99 over the last window.",
            "cache_storm": "1 when hit ratio fell > 15 % and P99 rose > 300 % (cold start).",
        }
        self.baseline = {
            name: Gauge(
                f"aiserve_{name}",
                doc,
                ["route", "term"] if name == "baseline_coefficient" else ["route"],
                registry=r,
            )
            for name, doc in docs.items()
        }

    def publish_baseline(self, route: str, a: Assessment) -> None:
        """Set the baseline gauges of ``route`` from its newest assessment."""
        check_label(route)
        b = self.baseline
        w = a.window
        b["baseline_observed_p90_seconds"].labels(route).set(w.p90)
        if a.fit is not None:
            for term, value in (("a", a.fit.a), ("b", a.fit.b), ("c", a.fit.c)):
                b["baseline_coefficient"].labels(route, term).set(value)
        if a.predicted_p90 is not None:
            b["baseline_predicted_p90_seconds"].labels(route).set(a.predicted_p90)
        if a.ratio is not None:
            b["baseline_ratio"].labels(route).set(a.ratio)
        b["latency_anomaly"].labels(route).set(1.0 if a.anomaly else 0.0)
        if a.hit_ratio_change is not None:
            b["cache_hit_ratio_change"].labels(route).set(a.hit_ratio_change)
        if a.p99_change is not None:
            b["p99_change"].labels(route).set(a.p99_change)
        b["cache_storm"].labels(route).set(1.0 if a.storm else 0.0)

    def watch_deployments(self, states: Callable[[], Iterable[tuple[str, str, int]]]) -> None:
        """Export ``aiserve_upstream_deployment_state{group,deployment}`` from ``states()``.

        Read at scrape time (a collector, not a gauge set on every change): the
        state a scrape shows is the one a request would meet then, cool-downs
        that ended since the last request included.
        """
        self.registry.register(_DeploymentStates(states))

    def child(self, metric: M, *values: str) -> M:
        """``metric.labels(*values)`` after checking every value."""
        for v in values:
            check_label(v)
        return metric.labels(*values)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def names(self) -> Iterable[str]:
        """Every sample name this registry exposes (for dashboard/rule checks)."""
        for family in self.registry.collect():
            for sample in family.samples:
                yield sample.name


def _nth(now: Callable[[], tuple[int, ...]], i: int) -> float:
    return float(now()[i])


class _DeploymentStates(Collector):
    """The circuit state of every group's deployments: 0 healthy, 1 ejected, 2 probing."""

    def __init__(self, states: Callable[[], Iterable[tuple[str, str, int]]]) -> None:
        self._states = states

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "aiserve_upstream_deployment_state",
            "Deployment circuit per group: 0 healthy, 1 ejected, 2 probing (half-open).",
            labels=["group", "deployment"],
        )
        try:
            rows = list(self._states())
        except RuntimeError:  # rendered outside the app's Trio run (no clock): nothing to say
            rows = []
        for group, deployment, state in rows:
            family.add_metric([group, deployment], float(state))
        yield family
