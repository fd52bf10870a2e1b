"""The dynamic P90 baseline: the fit, the windows, the anomaly and storm signals."""

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiserve_trio.observability.baseline import (
    BaselineMonitor,
    RouteBaseline,
    WindowStats,
    fit_p90,
    percentile,
    storm_signal,
)


def window(
    rps: float, tokens: float, p90: float, p99: float = 0.0, hit: float | None = None
) -> WindowStats:
    return WindowStats(
        start=0,
        end=300,
        count=100,
        rps=rps,
        avg_input_tokens=tokens,
        p50=p90 / 2,
        p90=p90,
        p99=p99 or p90 * 1.5,
        cache_hit_ratio=hit,
    )


def test_fit_recovers_known_coefficients_exactly():
    a, b, c = 0.0021, 0.00013, 0.045
    rng = random.Random(1)
    ws = []
    for _ in range(12):
        rps, tok = rng.uniform(5, 800), rng.uniform(50, 3000)
        ws.append(window(rps, tok, a * rps + b * tok + c))
    fit = fit_p90(ws)
    assert fit is not None
    assert fit.a == pytest.approx(a, rel=1e-9)
    assert fit.b == pytest.approx(b, rel=1e-9)
    assert fit.c == pytest.approx(c, rel=1e-9)


def test_fit_with_noise_is_close():
    a, b, c = 0.002, 0.0001, 0.05
    rng = random.Random(7)
    ws = []
    for _ in range(200):
        rps, tok = rng.uniform(5, 800), rng.uniform(50, 3000)
        ws.append(window(rps, tok, a * rps + b * tok + c + rng.gauss(0, 0.002)))
    fit = fit_p90(ws)
    assert fit is not None
    assert fit.a == pytest.approx(a, rel=0.02)
    assert fit.b == pytest.approx(b, rel=0.05)
    assert fit.c == pytest.approx(c, abs=0.002)


def test_a_constant_feature_gets_no_coefficient():
    ws = [window(rps, 500, 0.01 * rps + 0.2) for rps in (10, 20, 30, 40)]
    fit = fit_p90(ws)
    assert fit is not None
    assert fit.a == pytest.approx(0.01)
    assert fit.b == 0.0
    assert fit.predict(50, 500) == pytest.approx(0.7)


def test_identical_windows_fit_the_mean():
    fit = fit_p90([window(10, 100, 0.3)] * 3)
    assert fit is not None
    assert (fit.a, fit.b) == (0.0, 0.0)
    assert fit.c == pytest.approx(0.3)


def test_too_few_windows_fit_nothing():
    assert fit_p90([window(1, 1, 1)]) is None


@given(
    st.lists(
        st.tuples(st.floats(0, 1e4), st.floats(0, 1e5), st.floats(0, 100)), min_size=2, max_size=30
    )
)
def test_fit_is_always_finite(points):
    fit = fit_p90([window(r, t, p) for r, t, p in points])
    assert fit is not None
    for v in (fit.a, fit.b, fit.c):
        assert v == v  # not NaN
        assert abs(v) != float("inf")


def test_percentile_is_nearest_rank():
    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 90) == 90.0
    assert percentile(values, 99) == 99.0
    assert percentile([], 90) == 0.0


def test_windows_roll_on_time_and_flag_an_anomaly():
    rb = RouteBaseline(0.0, window_s=300, history=12, anomaly_factor=1.5)
    rng = random.Random(3)
    now = 0.0
    # Normal windows: latency grows with load (p90 ~ 0.1 + 0.001 * rps).
    for rps in (10, 20, 40, 80, 100, 60):
        for _ in range(rps * 3):
            base = 0.1 + 0.001 * rps
            rb.record(base * rng.uniform(0.5, 1.0), input_tokens=200)
        assert rb.roll(now + 299) is None  # not due yet
        now += 300
        a = rb.roll(now)
        assert a is not None
        assert not a.anomaly
    # Same load as before, but three times slower: an anomaly.
    for _ in range(60 * 3):
        rb.record(3 * (0.1 + 0.06) * rng.uniform(0.9, 1.0), input_tokens=200)
    now += 300
    a = rb.roll(now)
    assert a is not None
    assert a.window.rps == pytest.approx(60 * 3 / 300)
    assert a.ratio is not None
    assert a.ratio > 1.5
    assert a.anomaly


def test_storm_needs_both_hit_ratio_drop_and_p99_jump():
    prev = window(10, 100, 0.1, p99=0.2, hit=0.9)
    assert storm_signal(prev, window(10, 100, 0.1, p99=1.0, hit=0.5))[2]
    assert not storm_signal(prev, window(10, 100, 0.1, p99=1.0, hit=0.85))[2]  # hit -5.6 %
    assert not storm_signal(prev, window(10, 100, 0.1, p99=0.7, hit=0.5))[2]  # p99 +250 %
    hit, p99, _ = storm_signal(prev, window(10, 100, 0.1, p99=1.0, hit=0.45))
    assert hit == pytest.approx(-0.5)
    assert p99 == pytest.approx(4.0)
    assert storm_signal(None, prev) == (None, None, False)


def test_monitor_rolls_every_route():
    m = BaselineMonitor(["chat", "advice"], 0.0, window_s=60, history=5, anomaly_factor=2.0)
    m.record("chat", 0.2, 100)
    m.record("unknown_route", 0.2, 100)  # ignored
    out = m.roll(60.0)
    assert set(out) == {"chat"}  # advice had no requests
    assert out["chat"].window.count == 1
    assert m.next_roll == 120.0
