"""Prometheus metrics, one registry per app.

Label values must match ``^[a-z][a-z0-9_]*$``. Values the config fixes (stage
and route names) are checked and refused if they do not; values derived from
requests (model, channel) go through :func:`label_value`, which folds them into
that alphabet, and are bounded by the caller (only configured models reach here;
unknown channels are ``other``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from http import HTTPStatus
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

M = TypeVar("M", bound=MetricWrapperBase)

LABEL_RE = re.compile(r"^[a-z][a-z0-9_]*$")
STAGES = ("parse", "context", "inference", "sse")
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
            "Stage cancel scopes that reached their cut point.",
            ["stage"],
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
        self.upstream_errors = Counter(
            "aiserve_upstream_errors",
            "Upstream failures by adapter and error code.",
            ["adapter", "code"],
            registry=r,
        )
        self.upstream_retries = Counter(
            "aiserve_upstream_retries",
            "Upstream attempts retried before the first token.",
            ["adapter"],
            registry=r,
        )
        self.policy_actions = Counter(
            "policy_actions",
            "Actions taken by policies (redacted, blocked, flagged, rewritten).",
            ["policy", "action"],
            registry=r,
        )
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
        for stage in STAGES:
            self.task_count.labels(stage)
            self.stage_latency.labels(stage)

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
