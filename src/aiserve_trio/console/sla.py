"""The console's live numbers, computed from the gateway's own Prometheus metrics (pure).

:func:`read` turns the metric families of one registry (``Metric`` objects from
``collect()``, in process: no scrape, no text parsing) into a :class:`Snapshot` of
plain numbers; :func:`since` subtracts an older snapshot, so a window's numbers are
those of the requests that finished in it; :func:`overview` makes the tables the
page shows:

- per route and model: requests, requests per second, P95 of the request duration
  and of the time to first token, the error rate, tokens per request;
- per stage: P99 of the time the stage worked, and its live tasks;
- open streams: chat requests in their sse stage.

Quantiles come from histogram buckets the way Prometheus' ``histogram_quantile``
computes them: linear inside the bucket the rank falls in, the highest finite
bound when it falls in ``+Inf``. The buckets double (1 ms .. 32.8 s), so a
quantile is good to within its bucket: read it as "between x/2 and x".

The error rate counts server errors (an HTTP status of 500 or more, before or after
the head of a stream: upstream failures, deadlines the gateway could not keep) among
all finished requests; a client's own mistakes (4xx) and clients that went away are not
the gateway failing its SLA.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

#: Family names read from the registry (``observability/metrics.py``).
DURATION = "aiserve_request_duration_seconds"
TTFT = "aiserve_model_time_to_first_token_seconds"
REQUESTS = "aiserve_requests"
TOKENS = "aiserve_model_tokens"
STAGE_LATENCY = "pipeline_stage_latency_seconds"
STAGE_TASKS = "task_count_by_stage"
FAMILIES = frozenset({DURATION, TTFT, REQUESTS, TOKENS, STAGE_LATENCY, STAGE_TASKS})


@dataclass(frozen=True, slots=True)
class Buckets:
    """One histogram's cumulative bucket counts, ``+Inf`` last."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]

    @property
    def count(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def minus(self, old: Buckets | None) -> Buckets:
        if old is None or old.bounds != self.bounds:
            return self
        counts = tuple(a - b for a, b in zip(self.counts, old.counts, strict=True))
        return Buckets(self.bounds, counts)


def quantile(q: float, h: Buckets) -> float | None:
    """The ``q``-quantile (0 < q < 1) of ``h``, in the bounds' unit; None with no samples."""
    total = h.count
    if total <= 0:
        return None
    rank = q * total
    below, lower = 0.0, 0.0
    for bound, cumulative in zip(h.bounds, h.counts, strict=True):
        if cumulative >= rank:
            if math.isinf(bound):
                return lower  # beyond the last finite bucket: its bound is all we know
            inside = cumulative - below
            if inside <= 0:
                return bound
            return lower + (bound - lower) * (rank - below) / inside
        below, lower = cumulative, bound
    return lower


def is_server_error(status: str) -> bool:
    """Whether the ``status`` label of ``aiserve_requests`` is a 5xx."""
    if status in ("ok", "client_closed"):
        return False
    if status.startswith("status_"):
        digits = status.removeprefix("status_")
        return digits.isdigit() and int(digits) >= 500
    try:
        return HTTPStatus[status.upper()].value >= 500
    except KeyError:
        return False


RouteModel = tuple[str, str]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The numbers the console reads, at one moment (``at``: seconds, any clock)."""

    at: float
    duration: dict[RouteModel, Buckets] = field(default_factory=dict)
    ttft: dict[RouteModel, Buckets] = field(default_factory=dict)
    #: Finished requests by (route, model) and status label (channels summed).
    requests: dict[RouteModel, dict[str, float]] = field(default_factory=dict)
    #: Tokens by (route, model) and direction (``prompt``, ``completion``).
    tokens: dict[RouteModel, dict[str, float]] = field(default_factory=dict)
    stages: dict[str, Buckets] = field(default_factory=dict)
    #: Live tasks per stage (a gauge: never subtracted).
    live: dict[str, float] = field(default_factory=dict)


def read(families: Iterable[Metric], at: float) -> Snapshot:
    """A snapshot of the families this module knows (others are ignored)."""
    snap = Snapshot(at)
    for family in families:
        name = family.name
        if name not in FAMILIES:
            continue
        if family.type == "histogram":
            by_rm = {DURATION: snap.duration, TTFT: snap.ttft}.get(name)
            for labels, buckets in _histograms(family):
                if by_rm is not None:
                    by_rm[(labels.get("route", ""), labels.get("model", ""))] = buckets
                else:
                    snap.stages[labels.get("stage", "")] = buckets
            continue
        for s in family.samples:
            lab = s.labels
            if name == REQUESTS and s.name.endswith("_total"):
                row = snap.requests.setdefault((lab["route"], lab["model"]), {})
                row[lab["status"]] = row.get(lab["status"], 0.0) + s.value
            elif name == TOKENS and s.name.endswith("_total"):
                row = snap.tokens.setdefault((lab["route"], lab["model"]), {})
                row[lab["direction"]] = row.get(lab["direction"], 0.0) + s.value
            elif name == STAGE_TASKS:
                snap.live[lab["stage"]] = s.value
    return snap


def _histograms(family: Metric) -> Iterable[tuple[dict[str, str], Buckets]]:
    rows: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
    for s in family.samples:
        if not s.name.endswith("_bucket"):
            continue
        labels = {k: v for k, v in s.labels.items() if k != "le"}
        rows.setdefault(tuple(sorted(labels.items())), []).append((float(s.labels["le"]), s.value))
    for key, points in rows.items():
        points.sort()
        yield dict(key), Buckets(tuple(b for b, _ in points), tuple(c for _, c in points))


def since(new: Snapshot, old: Snapshot) -> Snapshot:
    """What happened between ``old`` and ``new`` (live tasks: as of ``new``)."""

    def counts(a: dict[str, float], b: dict[str, float] | None) -> dict[str, float]:
        b = b or {}
        return {k: v - b.get(k, 0.0) for k, v in a.items()}

    return Snapshot(
        at=new.at,
        duration={k: h.minus(old.duration.get(k)) for k, h in new.duration.items()},
        ttft={k: h.minus(old.ttft.get(k)) for k, h in new.ttft.items()},
        requests={k: counts(v, old.requests.get(k)) for k, v in new.requests.items()},
        tokens={k: counts(v, old.tokens.get(k)) for k, v in new.tokens.items()},
        stages={k: h.minus(old.stages.get(k)) for k, h in new.stages.items()},
        live=dict(new.live),
    )


class ModelRow(msgspec.Struct, kw_only=True):
    route: str
    model: str
    requests: int
    #: Requests per second over the window (None for the totals since start).
    rps: float | None
    #: Seconds; None when no request of the row succeeded (or had a first token).
    p95_s: float | None
    ttft_p95_s: float | None
    errors: int
    error_rate: float | None
    tokens_per_request: float | None
    prompt_tokens_per_request: float | None
    completion_tokens_per_request: float | None


class StageRow(msgspec.Struct, kw_only=True):
    stage: str
    p99_s: float | None
    #: Stage runs the P99 was computed from.
    runs: int
    live: int


class Table(msgspec.Struct, kw_only=True):
    #: Seconds the numbers cover (None: since the worker started).
    window_s: float | None
    models: list[ModelRow]
    stages: list[StageRow]


def overview(
    snap: Snapshot,
    window_s: float | None,
    stages: Iterable[str],
    names: Mapping[str, str] | None = None,
) -> Table:
    """The console's tables from ``snap`` (a window's snapshot when ``window_s`` is set).

    ``names``: a model's name by its metric label (``aiserve_mock`` -> ``aiserve-mock``),
    so the table says what the rest of the gateway says.
    """
    names = names or {}
    keys = sorted(set(snap.requests) | set(snap.duration))
    models = []
    for key in keys:
        by_status = snap.requests.get(key, {})
        n = sum(by_status.values())
        errors = sum(v for s, v in by_status.items() if is_server_error(s))
        if n <= 0:
            continue  # none finished (in the window)
        toks = snap.tokens.get(key, {})
        prompt, completion = toks.get("prompt", 0.0), toks.get("completion", 0.0)
        dur, ttft = snap.duration.get(key), snap.ttft.get(key)
        models.append(
            ModelRow(
                route=key[0],
                model=names.get(key[1], key[1]),
                requests=round(n),
                rps=n / window_s if window_s else None,
                p95_s=quantile(0.95, dur) if dur is not None else None,
                ttft_p95_s=quantile(0.95, ttft) if ttft is not None else None,
                errors=round(errors),
                error_rate=errors / n if n > 0 else None,
                tokens_per_request=(prompt + completion) / n if n > 0 else None,
                prompt_tokens_per_request=prompt / n if n > 0 else None,
                completion_tokens_per_request=completion / n if n > 0 else None,
            )
        )
    stage_rows = []
    for stage in stages:
        h = snap.stages.get(stage)
        stage_rows.append(
            StageRow(
                stage=stage,
                p99_s=quantile(0.99, h) if h is not None else None,
                runs=round(h.count) if h is not None else 0,
                live=round(snap.live.get(stage, 0.0)),
            )
        )
    return Table(window_s=window_s, models=models, stages=stage_rows)


class Window:
    """Snapshots taken as the console polls; the window compares the newest with one
    about ``seconds`` older (or the oldest kept, while the worker is younger).

    At most one snapshot per ``step`` seconds is kept, so many pages polling often
    keep no more than ``seconds / step`` of them.
    """

    def __init__(self, seconds: float, step: float = 1.0) -> None:
        self.seconds = seconds
        self.step = step
        self._kept: deque[Snapshot] = deque()

    def __len__(self) -> int:
        return len(self._kept)

    def add(self, snap: Snapshot) -> Snapshot:
        """Offer ``snap``; return the snapshot the window starts at (``snap`` itself
        when it is the first: an empty window)."""
        kept = self._kept
        # Drop the oldest while the next one is already old enough.
        while len(kept) >= 2 and snap.at - kept[1].at >= self.seconds:
            kept.popleft()
        if not kept or snap.at - kept[-1].at >= self.step:
            kept.append(snap)
        return kept[0]
