"""A dynamic latency baseline per route: is P90 normal *for this load*?

Every window (default 5 min) the successful requests of a route are
aggregated into a :class:`WindowStats` (RPS, mean prompt tokens, P50/P90/P99).
Over the recent windows a linear model is fitted by least squares::

    P90 = a * RPS + b * avg_input_tokens + c

and the newest window's observed P90 is compared with the model's prediction.
A ratio above ``anomaly_factor`` raises ``aiserve_latency_anomaly{route}``.

The same windows carry the cache-storm signal: when the cache hit ratio drops
by more than 15 % and P99 rises by more than 300 % from one window to the
next, a cold-start storm is flagged.

Everything here is pure (the caller passes the time), so it is tested with
synthetic windows and Trio's virtual clock.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

#: Requests kept per window for percentiles; beyond it, reservoir sampling.
RESERVOIR = 4096


@dataclass(frozen=True, slots=True)
class WindowStats:
    start: float
    end: float
    count: int
    rps: float
    avg_input_tokens: float
    p50: float
    p90: float
    p99: float
    #: Cache hits / lookups in the window; None when there were no lookups.
    cache_hit_ratio: float | None = None


@dataclass(frozen=True, slots=True)
class Fit:
    """``p90 = a * rps + b * avg_input_tokens + c``."""

    a: float
    b: float
    c: float

    def predict(self, rps: float, avg_input_tokens: float) -> float:
        return self.a * rps + self.b * avg_input_tokens + self.c


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (``q`` in [0, 100])."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def fit_p90(windows: Sequence[WindowStats]) -> Fit | None:
    """Least-squares fit of P90 on RPS and mean input tokens.

    Centring the features before solving keeps the normal equations well
    conditioned (RPS in the hundreds and tokens in the thousands would
    otherwise swamp the intercept). A feature that does not vary over the
    windows cannot be told apart from the intercept; its coefficient is 0.

    Returns None with fewer than two windows.
    """
    n = len(windows)
    if n < 2:
        return None
    xs1 = [w.rps for w in windows]
    xs2 = [w.avg_input_tokens for w in windows]
    ys = [w.p90 for w in windows]
    m1, m2, my = sum(xs1) / n, sum(xs2) / n, sum(ys) / n
    d1 = [x - m1 for x in xs1]
    d2 = [x - m2 for x in xs2]
    dy = [y - my for y in ys]
    s11 = sum(v * v for v in d1)
    s22 = sum(v * v for v in d2)
    s12 = sum(u * v for u, v in zip(d1, d2, strict=True))
    s1y = sum(u * v for u, v in zip(d1, dy, strict=True))
    s2y = sum(u * v for u, v in zip(d2, dy, strict=True))
    eps = 1e-12
    det = s11 * s22 - s12 * s12
    if s11 > eps and s22 > eps and det > 1e-9 * s11 * s22:
        a = (s1y * s22 - s2y * s12) / det
        b = (s2y * s11 - s1y * s12) / det
    elif s11 > eps and (s22 <= eps or s11 >= s22):
        # Tokens constant (or collinear with RPS): explain P90 by RPS alone.
        a, b = s1y / s11, 0.0
    elif s22 > eps:
        a, b = 0.0, s2y / s22
    else:
        a = b = 0.0
    return Fit(a=a, b=b, c=my - a * m1 - b * m2)


@dataclass(slots=True)
class _Window:
    start: float
    count: int = 0
    tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    cache_hits: int = 0
    cache_lookups: int = 0

    def add(self, latency: float, input_tokens: int, rng: random.Random) -> None:
        self.count += 1
        self.tokens += input_tokens
        if len(self.latencies) < RESERVOIR:
            self.latencies.append(latency)
        else:
            j = rng.randrange(self.count)
            if j < RESERVOIR:
                self.latencies[j] = latency

    def close(self, end: float) -> WindowStats:
        lat = sorted(self.latencies)
        span = max(end - self.start, 1e-9)
        ratio = self.cache_hits / self.cache_lookups if self.cache_lookups else None
        return WindowStats(
            start=self.start,
            end=end,
            count=self.count,
            rps=self.count / span,
            avg_input_tokens=self.tokens / self.count if self.count else 0.0,
            p50=percentile(lat, 50),
            p90=percentile(lat, 90),
            p99=percentile(lat, 99),
            cache_hit_ratio=ratio,
        )


@dataclass(frozen=True, slots=True)
class Assessment:
    """What the newest window says about a route."""

    window: WindowStats
    fit: Fit | None
    predicted_p90: float | None
    ratio: float | None
    anomaly: bool
    hit_ratio_change: float | None
    p99_change: float | None
    storm: bool


class RouteBaseline:
    """Windows and fit for one route."""

    def __init__(
        self,
        start: float,
        *,
        window_s: float,
        history: int,
        anomaly_factor: float,
        min_requests: int = 1,
        seed: int = 0,
    ) -> None:
        self.window_s = window_s
        self.anomaly_factor = anomaly_factor
        self.min_requests = min_requests
        self.windows: deque[WindowStats] = deque(maxlen=history)
        self._current = _Window(start)
        self._rng = random.Random(seed)
        self.last: Assessment | None = None

    def restart(self, now: float) -> None:
        """Drop the open window and start a new one at ``now``."""
        self._current = _Window(now)

    def record(self, latency: float, input_tokens: int) -> None:
        """A successful request (timeouts and errors are not part of the baseline)."""
        self._current.add(latency, input_tokens, self._rng)

    def record_cache(self, hit: bool) -> None:
        self._current.cache_lookups += 1
        self._current.cache_hits += int(hit)

    def roll(self, now: float) -> Assessment | None:
        """Close the current window if it is due; return the new assessment."""
        if now - self._current.start < self.window_s:
            return None
        stats = self._current.close(now)
        self._current = _Window(now)
        if stats.count < self.min_requests:
            return None
        previous = self.windows[-1] if self.windows else None
        fit = fit_p90(list(self.windows))  # fitted on the past, judged on the new window
        self.windows.append(stats)
        predicted = ratio = None
        anomaly = False
        if fit is not None:
            predicted = fit.predict(stats.rps, stats.avg_input_tokens)
            if predicted > 0:
                ratio = stats.p90 / predicted
                anomaly = ratio > self.anomaly_factor
        hit_change, p99_change, storm = storm_signal(previous, stats)
        self.last = Assessment(
            window=stats,
            fit=fit,
            predicted_p90=predicted,
            ratio=ratio,
            anomaly=anomaly,
            hit_ratio_change=hit_change,
            p99_change=p99_change,
            storm=storm,
        )
        return self.last


def storm_signal(
    previous: WindowStats | None, current: WindowStats
) -> tuple[float | None, float | None, bool]:
    """(hit ratio change, P99 change, storm?) between two windows, as fractions.

    A storm is a hit ratio down by more than 15 % *and* P99 up by more than 300 %.
    """
    if previous is None:
        return None, None, False
    hit_change = None
    if previous.cache_hit_ratio and current.cache_hit_ratio is not None:
        hit_change = (current.cache_hit_ratio - previous.cache_hit_ratio) / previous.cache_hit_ratio
    p99_change = (current.p99 - previous.p99) / previous.p99 if previous.p99 > 0 else None
    storm = (
        hit_change is not None
        and p99_change is not None
        and hit_change < -0.15
        and p99_change > 3.0
    )
    return hit_change, p99_change, storm


class BaselineMonitor:
    """Per-route baselines, rolled every window, published as gauges.

    ``publish`` receives each route's assessment; the app wires it to the
    Prometheus gauges (see :meth:`~aiserve_trio.observability.metrics.Metrics.publish_baseline`).
    """

    def __init__(
        self,
        routes: Sequence[str],
        start: float,
        *,
        window_s: float,
        history: int,
        anomaly_factor: float,
        min_requests: int = 1,
    ) -> None:
        self.window_s = window_s
        self._settings = (history, anomaly_factor, min_requests)
        self.routes = {r: self._baseline(start) for r in routes}
        self.next_roll = start + window_s

    def _baseline(self, start: float) -> RouteBaseline:
        history, anomaly_factor, min_requests = self._settings
        return RouteBaseline(
            start,
            window_s=self.window_s,
            history=history,
            anomaly_factor=anomaly_factor,
            min_requests=min_requests,
        )

    def track(self, routes: Sequence[str], now: float) -> None:
        """Follow these routes from now on (a reloaded config): the baselines of
        routes kept go on, a new route starts its first window at ``now``, a
        removed one is dropped."""
        self.routes = {r: self.routes.get(r) or self._baseline(now) for r in routes}

    def restart(self, now: float) -> None:
        """Begin the first window at ``now`` (the clock starts with the event loop)."""
        for rb in self.routes.values():
            rb.restart(now)
        self.next_roll = now + self.window_s

    def record(self, route: str, latency: float, input_tokens: int) -> None:
        rb = self.routes.get(route)
        if rb is not None:
            rb.record(latency, input_tokens)

    def record_cache(self, route: str, hit: bool) -> None:
        rb = self.routes.get(route)
        if rb is not None:
            rb.record_cache(hit)

    def roll(self, now: float) -> dict[str, Assessment]:
        """Close due windows; returns the routes that got a new assessment."""
        out: dict[str, Assessment] = {}
        for route, rb in self.routes.items():
            a = rb.roll(now)
            if a is not None:
                out[route] = a
        self.next_roll = now + self.window_s
        return out
