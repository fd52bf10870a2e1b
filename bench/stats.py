"""Pure helpers for the bench report: added latency, Prometheus histogram diffs.

No I/O here, so the arithmetic the report rests on is unit-tested
(tests/test_clients_loadgen.py).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping, Sequence

from .loadgen import percentile

_BUCKET = re.compile(
    r'^pipeline_stage_latency_seconds_bucket\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)$'
)
_LABEL = re.compile(r'(\w+)="([^"]*)"')

#: stage -> list of (upper bound in seconds, cumulative count), sorted by bound.
Buckets = dict[str, list[tuple[float, float]]]


def parse_stage_buckets(text: str, metric: str = "pipeline_stage_latency_seconds") -> Buckets:
    """The cumulative buckets of ``metric`` per ``stage`` label in a Prometheus text page."""
    pattern = _BUCKET if metric == "pipeline_stage_latency_seconds" else re.compile(
        rf"^{re.escape(metric)}_bucket\{{(?P<labels>[^}}]*)\}}\s+(?P<value>\S+)$"
    )
    out: Buckets = {}
    for line in text.splitlines():
        m = pattern.match(line)
        if m is None:
            continue
        labels = dict(_LABEL.findall(m["labels"]))
        le = labels.get("le")
        stage = labels.get("stage", "")
        if le is None:
            continue
        bound = math.inf if le == "+Inf" else float(le)
        out.setdefault(stage, []).append((bound, float(m["value"])))
    for rows in out.values():
        rows.sort()
    return out


def diff_buckets(after: Buckets, before: Buckets) -> Buckets:
    """Per-bucket counts observed between two scrapes (``after - before``)."""
    out: Buckets = {}
    for stage, rows in after.items():
        prev = dict(before.get(stage, []))
        out[stage] = [(le, n - prev.get(le, 0.0)) for le, n in rows]
    return out


def bucket_quantile(rows: Sequence[tuple[float, float]], q: float) -> float | None:
    """The ``q`` quantile (0..1) of cumulative buckets, interpolated linearly inside a bucket.

    Like Prometheus' ``histogram_quantile``: the answer is only as fine as the
    buckets; above the last finite bound it is that bound. None for no samples.
    """
    if not rows or rows[-1][1] <= 0:
        return None
    total = rows[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for le, count in rows:
        if count >= rank:
            if math.isinf(le):
                return lower
            inside = count - below
            frac = (rank - below) / inside if inside > 0 else 1.0
            return lower + (le - lower) * frac
        lower, below = le, count
    return lower


def added(system: Sequence[float], direct: Sequence[float], qs: Sequence[float]) -> list[float | None]:
    """Per percentile ``q`` in ``qs`` (0..100): system's value minus direct's."""
    out: list[float | None] = []
    for q in qs:
        a, b = percentile(system, q), percentile(direct, q)
        out.append(None if a is None or b is None else a - b)
    return out


def first_over(
    points: Mapping[int, float | None], limit: float
) -> int | None:
    """The lowest concurrency whose value exceeds ``limit`` (None: never)."""
    for c in sorted(points):
        v = points[c]
        if v is not None and v > limit:
            return c
    return None


def paired_changes(
    base: Sequence[Mapping[str, float]], other: Sequence[Mapping[str, float]]
) -> tuple[list[float], list[float]]:
    """Round by round (``bench.ab``'s points of one round paired): ``other``'s change of
    req/s and of CPU per request against ``base``'s, in percent."""
    pairs = list(zip(base, other, strict=True))
    rps = [(o["rps"] / b["rps"] - 1) * 100 for b, o in pairs]
    cpu = [(o["cpu_us"] / b["cpu_us"] - 1) * 100 for b, o in pairs]
    return rps, cpu


def mean_interval(
    values: Sequence[float], *, level: float = 0.95, resamples: int = 4000, seed: int = 0
) -> tuple[float, float, float]:
    """The mean of ``values`` and a ``level`` bootstrap interval around it: (mean, low, high).

    The paired differences of ``bench.ab``'s rounds: resampling the rounds with
    replacement ``resamples`` times (seeded, so a report reads the same twice), the
    interval holds the middle ``level`` of the resampled means. Where the median and
    the smallest and largest round say how a run spread, this says how far the mean
    itself could be off with this many rounds: whether a 3 % effect is told from a 4 % one.
    """
    if not values:
        raise ValueError("no values")
    n = len(values)
    mean = sum(values) / n
    if n == 1:
        return mean, mean, mean
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(resamples))
    tail = (1 - level) / 2
    return mean, means[int(tail * (resamples - 1))], means[int((1 - tail) * (resamples - 1))]
