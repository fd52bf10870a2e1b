"""Trio scheduler lag: how late tasks run after becoming runnable.

The Python counterpart of Go's scheduler latency: when the event loop is
saturated (CPU-bound work, a blocking call, too many runnable tasks), a task
that is ready waits longer before it runs, and every stream's inter-token gap
grows with it. A :class:`trio.abc.Instrument` sees both moments:
``task_scheduled`` (runnable) and ``before_task_step`` (running).

Cost matters here, since the hooks run on every task step. The probe samples
one scheduling event in ``sample_every`` and counts into plain Python lists;
Prometheus reads them only when scraped (a custom collector), so the hot path
takes no lock and allocates nothing.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator

import trio
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

#: Upper bounds in seconds: 10 us x 2^k, 16 buckets (10 us .. ~0.33 s).
LAG_BUCKETS = tuple(1e-5 * 2**k for k in range(16))


class SchedulerLag(trio.abc.Instrument, Collector):
    """Instrument + collector for ``trio_scheduler_lag_seconds``."""

    def __init__(self, sample_every: int = 8) -> None:
        if sample_every < 1:
            raise ValueError("`sample_every` must be at least 1")
        self.sample_every = sample_every
        self._tick = 0
        self._pending: dict[trio.lowlevel.Task, float] = {}
        self.counts = [0] * (len(LAG_BUCKETS) + 1)
        self.total = 0.0
        self.samples = 0

    # --- trio.abc.Instrument -----------------------------------------------------

    def task_scheduled(self, task: trio.lowlevel.Task) -> None:
        self._tick += 1
        if self._tick % self.sample_every == 0:
            self._pending[task] = time.perf_counter()

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._pending:
            t0 = self._pending.pop(task, None)
            if t0 is not None:
                self.observe(time.perf_counter() - t0)

    def task_exited(self, task: trio.lowlevel.Task) -> None:
        self._pending.pop(task, None)

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
