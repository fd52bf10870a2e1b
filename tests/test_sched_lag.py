"""The scheduler-lag probe sees a task kept waiting by a blocking neighbour."""

import time

import pytest
import trio
from prometheus_client import CollectorRegistry, generate_latest

from aiserve_trio.observability.sched import LAG_BUCKETS, SchedulerLag


async def test_blocking_call_shows_up_as_lag():
    probe = SchedulerLag(sample_every=1)
    trio.lowlevel.add_instrument(probe)
    try:
        woke = trio.Event()

        async def waiter() -> None:
            await trio.lowlevel.checkpoint()
            woke.set()

        async with trio.open_nursery() as n:
            n.start_soon(waiter)
            await trio.lowlevel.checkpoint()  # the waiter is now runnable...
            time.sleep(0.03)  # noqa: ASYNC251 - blocking the loop is the point
        assert woke.is_set()
    finally:
        trio.lowlevel.remove_instrument(probe)
    assert probe.samples > 0
    assert max(i for i, n in enumerate(probe.counts) if n) >= next(
        i for i, b in enumerate(LAG_BUCKETS) if b >= 0.03
    )


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


def test_sampling_rate_must_be_positive():
    with pytest.raises(ValueError, match="sample_every"):
        SchedulerLag(sample_every=0)
