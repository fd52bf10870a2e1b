"""Trio scheduler lag: how late the event loop runs a task that is due.

The Python counterpart of Go's scheduler latency: when the event loop is
saturated (CPU-bound work, a blocking call, too many runnable tasks), a task
that is ready waits longer before it runs, and every stream's inter-token gap
grows with it.

The probe is one task that asks to be woken every ``interval`` seconds and
records how late it actually runs -- not a :class:`trio.abc.Instrument`, whose
hooks Trio calls on every step of every task (the cost is in
docs/architecture.md). Counts go into plain Python lists that Prometheus reads
only when scraped (a custom collector).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

import trio
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

#: Upper bounds in seconds: 10 us x 2^k, 16 buckets (10 us .. ~0.33 s).
LAG_BUCKETS = tuple(1e-5 * 2**k for k in range(16))


class SchedulerLag(Collector):
    """The probe task and the collector for ``trio_scheduler_lag_seconds``."""

    def __init__(self, interval: float = 0.05) -> None:
        if interval <= 0:
            raise ValueError("`interval` must be positive")
        self.interval = interval
        self.counts = [0] * (len(LAG_BUCKETS) + 1)
        self.total = 0.0
        self.samples = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Wake every ``interval`` and record the lateness; runs until cancelled."""
        task_status.started()
        due = trio.current_time() + self.interval
        while True:
            await trio.sleep_until(due)
            now = trio.current_time()
            self.observe(now - due)
            due = now + self.interval

    def observe(self, lag: float) -> None:
        self.counts[bisect.bisect_left(LAG_BUCKETS, lag)] += 1
        self.total += lag
        self.samples += 1

    # --- prometheus Collector ----------------------------------------------------

    def collect(self) -> Iterator[HistogramMetricFamily]:
        fam = HistogramMetricFamily(
            "trio_scheduler_lag_seconds",
            "Time from a Trio task becoming runnable to it running (sampled).",
        )
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for bound, n in zip(LAG_BUCKETS, self.counts, strict=False):
            cumulative += n
            buckets.append((repr(bound), float(cumulative)))
        buckets.append(("+Inf", float(cumulative + self.counts[-1])))
        fam.add_metric([], buckets, sum_value=self.total)
        yield fam

    def describe(self) -> Iterator[HistogramMetricFamily]:
        return iter(())
