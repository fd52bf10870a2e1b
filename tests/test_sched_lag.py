"""The scheduler-lag probe sees the event loop kept busy by a blocking call."""

import time

import pytest
import trio
from prometheus_client import CollectorRegistry, generate_latest

from aiserve_trio.observability.sched import LAG_BUCKETS, SchedulerLag


async def test_blocking_call_shows_up_as_lag():
    probe = SchedulerLag(interval=0.01)
    async with trio.open_nursery() as n:
        await n.start(probe.run)
        await trio.sleep(0.05)  # a few on-time samples
        time.sleep(0.06)  # noqa: ASYNC251 - blocking the loop is what the probe must see
        await trio.sleep(0.03)
        n.cancel_scope.cancel()
    assert probe.samples >= 3
    worst = max(i for i, count in enumerate(probe.counts) if count)
    # the probe was due during the 60 ms block and ran at least ~50 ms late
    assert LAG_BUCKETS[worst] >= 0.04
    # and otherwise close to on time (epoll wakes with about millisecond precision)
    prompt = sum(c for b, c in zip(LAG_BUCKETS, probe.counts, strict=False) if b <= 0.01)
    assert prompt >= probe.samples - 2


async def test_no_lag_on_an_idle_loop(autojump_clock):
    probe = SchedulerLag(interval=0.05)
    async with trio.open_nursery() as n:
        await n.start(probe.run)
        await trio.sleep(1.0)
        n.cancel_scope.cancel()
    assert probe.samples == 19 or probe.samples == 20
    assert probe.total == 0.0


def test_histogram_is_exported_cumulatively():
    probe = SchedulerLag()
    for lag in (5e-6, 5e-6, 1e-3, 10.0):
        probe.observe(lag)
    reg = CollectorRegistry()
    reg.register(probe)
    text = generate_latest(reg).decode()
    assert 'trio_scheduler_lag_seconds_bucket{le="1e-05"} 2.0' in text
    assert 'trio_scheduler_lag_seconds_bucket{le="+Inf"} 4.0' in text
    assert "trio_scheduler_lag_seconds_count 4.0" in text
    assert probe.total == pytest.approx(10.00101)


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval"):
        SchedulerLag(interval=0)
