import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiserve_trio.core.budgets import effective_timeout_ms, plan
from aiserve_trio.core.errors import BadRequest


def test_cut_points_are_cumulative_shares_of_deadline_minus_arrival():
    b = plan(100.0, 1100, reserve_ms=100, min_inference_ms=50, context=0.4, inference=0.35)
    assert b.deadline == pytest.approx(101.0)  # 1100 ms - 100 ms reserve
    assert b.context_end == pytest.approx(100.4)
    assert b.inference_end == pytest.approx(100.75)
    assert b.cut("parse") == b.cut("context") == b.context_end
    assert b.cut("sse") == b.deadline
    assert b.reserve == pytest.approx(0.1)
    assert b.min_inference == pytest.approx(0.05)


def test_unknown_stage_is_refused():
    b = plan(0.0, 1000, reserve_ms=100, min_inference_ms=50, context=0.4, inference=0.35)
    with pytest.raises(ValueError, match="unknown stage"):
        b.cut("cache")


@given(
    arrival=st.floats(0, 1e6),
    timeout=st.integers(101, 10**7),
    context=st.floats(0.01, 0.98),
    inference=st.floats(0.01, 0.98),
)
def test_cut_points_are_ordered_and_end_at_the_deadline(arrival, timeout, context, inference):
    if context + inference >= 0.999:
        inference = 0.999 - context
    b = plan(
        arrival, timeout, reserve_ms=100, min_inference_ms=0, context=context, inference=inference
    )
    assert b.arrival <= b.context_end <= b.inference_end <= b.deadline
    assert b.total == pytest.approx((timeout - 100) / 1000, rel=1e-9, abs=1e-6)


@pytest.mark.parametrize(
    ("header", "expected"),
    [(None, 30_000), ("5000", 5000), ("999999", 120_000), (" 250 ", 250)],
)
def test_effective_timeout_defaults_and_caps(header, expected):
    got = effective_timeout_ms(header, default_ms=30_000, max_ms=120_000, reserve_ms=100)
    assert got == expected


@pytest.mark.parametrize("header", ["abc", "-5", "1.5", "", "100", "50", "١٢٣", "9" * 20])
def test_bad_timeout_header_is_a_400_naming_the_header(header):
    with pytest.raises(BadRequest) as info:
        effective_timeout_ms(header, default_ms=30_000, max_ms=120_000, reserve_ms=100)
    assert info.value.param == "X-Request-Timeout-Ms"
    assert info.value.status == 400
