"""Deployment health and balancing, on plain numbers (no clock, no sockets)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from aiserve_trio.adapters.balance import Candidate, order
from aiserve_trio.adapters.health import (
    MAX_SAMPLES,
    TRANSITIONS,
    Ejection,
    HealthPolicy,
    HealthWindow,
    Outliers,
    Signal,
    State,
    quantile,
)

POLICY = HealthPolicy(
    window=10.0,
    min_requests=4,
    max_error_rate=0.5,
    max_timeout_rate=0.5,
    consecutive_failures=3,
    base_ejection=5.0,
    max_ejection=12.0,
    max_ejected_percent=50.0,
)


# --- the window -------------------------------------------------------------------------


def test_window_rates_over_the_last_seconds_only() -> None:
    w = HealthWindow(10.0, prior_ttft=0.5)
    for t in (0.0, 1.0, 2.0):
        w.record(t, False, None)
    w.record(3.0, True, 0.1)
    w.record(4.0, False, 2.0, timeout=True)
    s = w.stats(4.0)
    assert (s.requests, s.errors, s.timeouts) == (5, 3, 1)
    assert s.error_rate == pytest.approx(0.6)
    assert s.timeout_rate == pytest.approx(0.2)
    # 10.5 s later the three errors at 0-2 s have left the window.
    s = w.stats(12.5)
    assert (s.requests, s.errors, s.timeouts) == (2, 0, 1)


def test_consecutive_failures_reset_on_success() -> None:
    w = HealthWindow(10.0, 0.5)
    w.record(0.0, False, None)
    w.record(0.1, False, None)
    assert w.stats(0.1).consecutive_failures == 2
    w.record(0.2, True, 0.05)
    assert w.stats(0.2).consecutive_failures == 0


def test_expected_ttft_starts_at_the_prior_and_follows_the_ewma() -> None:
    w = HealthWindow(10.0, prior_ttft=1.0, alpha=0.5)
    assert w.expected_ttft == 1.0
    w.record(0.0, True, 0.2)
    assert w.expected_ttft == pytest.approx(0.6)
    w.record(0.1, False, None)  # a fast failure says nothing about its TTFT
    assert w.expected_ttft == pytest.approx(0.6)
    w.record(0.2, False, 3.0, timeout=True)  # a timeout: at least what it waited
    assert w.expected_ttft == pytest.approx(1.8)


def test_expected_reply_follows_successful_replies_only() -> None:
    w = HealthWindow(10.0, prior_ttft=0.2, alpha=0.5)
    assert w.expected_reply == 0.2
    w.record(0.0, True, 0.05, duration=0.6)
    assert w.expected_reply == pytest.approx(0.4)
    w.record(0.1, False, 0.05, duration=5.0)  # a broken reply says nothing of a whole one
    assert w.expected_reply == pytest.approx(0.4)


def test_a_timeout_is_no_latency_sample() -> None:
    # Five cut-offs after 5 s each must not make 5 s the give-up point of the next try.
    w = HealthWindow(10.0, prior_ttft=0.1, alpha=0.5)
    for i in range(5):
        w.record(i * 0.1, True, 0.1)
    for i in range(5):
        w.record(1.0 + i * 0.1, False, 5.0, timeout=True)
    assert w.ttft_p95(2.0) == pytest.approx(0.1)
    assert w.stats(2.0).timeouts == 5
    assert w.expected_ttft > 4.0  # the average still learns the lower bound


def test_a_stall_is_a_timeout_after_a_real_first_token() -> None:
    o = Outliers(POLICY)
    o.add("d0", 0.1)
    o.add("d1", 0.1)
    assert o.record("d0", 0.0, False, 0.05, stalled=True) is State.HEALTHY
    assert o.record("d0", 0.1, False, 0.05, stalled=True) is State.HEALTHY
    assert o.record("d0", 0.2, False, 0.05, stalled=True) is State.EJECTED  # 3 in a row
    s = o.window("d0").stats(0.2)
    assert (s.requests, s.errors, s.timeouts, s.stalls) == (3, 0, 3, 3)
    assert s.ttft_p95 == pytest.approx(0.05)
    # Mixed with successes, stalls count in the timeout rate (3 of 5 > 50 %).
    o.add("d2", 0.1)
    for t, ok in ((0.0, True), (0.1, False), (0.2, True), (0.3, False)):
        o.record("d2", t, ok, 0.05, stalled=not ok)
    assert o.record("d2", 0.4, False, 0.05, stalled=True) is State.HEALTHY  # d0 is out (50 %)
    assert o.window("d2").stats(0.4).trips(POLICY) == "timeout rate 60% over 5 tries"


def test_a_probe_that_times_out_is_a_timeout() -> None:
    o = Outliers(POLICY)
    o.add("d0", 0.1)
    o.probed("d0", 0.0, False, timeout=True)
    o.probed("d0", 0.1, False)
    s = o.window("d0").stats(0.1)
    assert (s.timeouts, s.errors) == (1, 1)


def test_p95_of_the_window_or_the_prior() -> None:
    w = HealthWindow(10.0, prior_ttft=0.7)
    assert w.ttft_p95(0.0) == 0.7
    for i in range(100):
        w.record(0.0, True, (i + 1) / 1000)
    assert w.ttft_p95(0.0) == pytest.approx(0.095)
    assert quantile([], 0.95) is None
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0


def test_the_window_is_bounded_in_tries_too() -> None:
    w = HealthWindow(1e9, 0.5)
    for i in range(MAX_SAMPLES + 10):
        w.record(float(i), True, 0.1)
    assert w.stats(float(MAX_SAMPLES + 10)).requests == MAX_SAMPLES


@pytest.mark.parametrize(
    ("outcomes", "reason"),
    [
        ([True, True, True, True], None),
        ([False, True, False, True], None),  # 50 %: not over
        ([False, False, True, True, False], "error rate 60% over 5 tries"),
        ([False, False, False], "3 failures in a row"),  # before min_requests
        ([False, True, False], None),
    ],
)
def test_what_trips(outcomes: list[bool], reason: str | None) -> None:
    w = HealthWindow(10.0, 0.5)
    for i, ok in enumerate(outcomes):
        w.record(i * 0.1, ok, 0.1 if ok else None)
    assert w.stats(1.0).trips(POLICY) == reason


def test_timeouts_and_slow_first_tokens_trip() -> None:
    w = HealthWindow(10.0, 0.5)
    for i, to in enumerate([True, False, True, True]):
        w.record(i * 0.1, not to, 1.0 if to else 0.1, timeout=to)
    assert w.stats(1.0).trips(POLICY) == "timeout rate 75% over 4 tries"
    slow = HealthPolicy(min_requests=4, max_ttft_p95=0.5)
    w = HealthWindow(10.0, 0.5)
    for i in range(4):
        w.record(i * 0.1, True, 0.8)
    assert w.stats(1.0).trips(slow) == "P95 TTFT 800 ms over 500 ms"


# --- the circuit ------------------------------------------------------------------------


def test_the_transition_table() -> None:
    # The whole machine, as written: nothing else moves a circuit.
    assert TRANSITIONS == {
        (State.HEALTHY, Signal.TRIP): State.EJECTED,
        (State.EJECTED, Signal.COOLED): State.PROBING,
        (State.PROBING, Signal.PASS): State.HEALTHY,
        (State.PROBING, Signal.FAIL): State.EJECTED,
        (State.PROBING, Signal.TRIP): State.EJECTED,
    }
    e = Ejection()
    for signal in (Signal.PASS, Signal.FAIL, Signal.COOLED):
        assert e.fire(signal, 0.0, POLICY) is State.HEALTHY


def test_cool_down_grows_while_it_keeps_failing_and_is_capped() -> None:
    e = Ejection()
    assert e.fire(Signal.TRIP, 0.0, POLICY) is State.EJECTED
    assert e.until == 5.0  # base x 1
    assert e.poll(4.9, POLICY) is State.EJECTED
    assert e.poll(5.0, POLICY) is State.PROBING
    assert e.fire(Signal.FAIL, 5.0, POLICY) is State.EJECTED
    assert e.until == 15.0  # base x 2
    assert e.poll(15.0, POLICY) is State.PROBING
    assert e.fire(Signal.FAIL, 15.0, POLICY) is State.EJECTED
    assert e.until == 27.0  # base x 3 = 15, capped at 12
    assert e.poll(27.0, POLICY) is State.PROBING
    assert e.fire(Signal.PASS, 27.0, POLICY) is State.HEALTHY
    # Tripping again soon: the count goes on (4 x 5 = 20, capped at 12).
    e.fire(Signal.TRIP, 28.0, POLICY)
    assert (e.ejections, e.until) == (4, 40.0)


def test_staying_healthy_earns_ejections_back() -> None:
    e = Ejection()
    e.fire(Signal.TRIP, 0.0, POLICY)
    e.poll(5.0, POLICY)
    e.fire(Signal.FAIL, 5.0, POLICY)  # 2 ejections
    e.poll(15.0, POLICY)
    e.fire(Signal.PASS, 15.0, POLICY)
    # Healthy for 10.1 s = two base intervals: the next ejection is a first again.
    e.fire(Signal.TRIP, 25.1, POLICY)
    assert (e.ejections, e.until) == (1, 30.1)


# --- a group's deployments ----------------------------------------------------------------


def _group(n: int, policy: HealthPolicy = POLICY) -> Outliers:
    o = Outliers(policy)
    for i in range(n):
        o.add(f"d{i}", 0.5)
    return o


def _fail(o: Outliers, name: str, now: float, times: int = 3) -> State:
    state = State.HEALTHY
    for _ in range(times):
        state = o.record(name, now, False, None)
    return state


def test_at_most_max_ejected_percent_out_at_once() -> None:
    o = _group(4)  # 50 % of 4: two may be out
    assert _fail(o, "d0", 0.0) is State.EJECTED
    assert _fail(o, "d1", 0.0) is State.EJECTED
    assert _fail(o, "d2", 0.0) is State.HEALTHY  # a third would leave too few
    assert [o.available(f"d{i}", 0.1) for i in range(4)] == [False, False, True, True]
    # Once one is back, the next failure of d2 can eject it.
    assert o.state("d0", 5.0) is State.PROBING
    o.begin("d0", 5.0)
    assert o.record("d0", 5.0, True, 0.1) is State.HEALTHY
    assert o.record("d2", 5.1, False, None) is State.EJECTED


def test_at_least_one_may_go_even_when_the_share_rounds_to_zero() -> None:
    o = _group(2, HealthPolicy(consecutive_failures=1, max_ejected_percent=10.0))
    assert _fail(o, "d0", 0.0, 1) is State.EJECTED
    assert _fail(o, "d1", 0.0, 1) is State.HEALTHY
    none = _group(2, HealthPolicy(consecutive_failures=1, max_ejected_percent=0.0))
    assert _fail(none, "d0", 0.0, 1) is State.HEALTHY


def test_fallbacks_are_not_counted_against_the_share() -> None:
    o = _group(2)
    o.add("apology", 0.05, counted=False)
    assert _fail(o, "d0", 0.0) is State.EJECTED
    assert _fail(o, "apology", 0.0) is State.EJECTED


def test_probing_lets_one_trial_through_and_its_result_decides() -> None:
    o = _group(2)
    _fail(o, "d0", 0.0)
    assert not o.available("d0", 4.0)
    assert o.available("d0", 5.0)  # cool-down over: probing
    o.begin("d0", 5.0)
    assert not o.available("d0", 5.0)  # one trial at a time
    o.abandon("d0")  # the trial was cancelled: no verdict
    assert o.available("d0", 5.1)
    o.begin("d0", 5.1)
    assert o.record("d0", 5.2, False, None) is State.EJECTED
    assert o.window("d0").stats(5.2).requests == 4
    assert o.state("d0", 15.2) is State.PROBING
    o.begin("d0", 15.2)
    assert o.record("d0", 15.3, True, 0.1) is State.HEALTHY
    # Readmitted with a clean window: one failure does not eject it again.
    assert o.window("d0").stats(15.3).requests == 0
    assert o.record("d0", 15.4, False, None) is State.HEALTHY


def test_active_probe_results() -> None:
    o = _group(2)
    assert o.probed("d0", 0.0, True) is State.HEALTHY
    for t in (0.0, 0.1):
        assert o.probed("d0", t, False) is State.HEALTHY
    assert o.probed("d0", 0.2, False) is State.EJECTED  # 3 failed probes in a row
    assert o.probed("d0", 1.0, True) is State.EJECTED  # still cooling down
    assert o.probed("d0", 5.2, True) is State.HEALTHY  # cooled: the probe is the trial


# --- the balancer -----------------------------------------------------------------------


def test_least_outstanding_per_weight() -> None:
    rng = random.Random(1)
    cands = [Candidate("a", 1.0, 4, 0.1), Candidate("b", 2.0, 4, 0.9), Candidate("c", 1.0, 1, 0.5)]
    assert order(cands, "least_outstanding", rng) == ["c", "b", "a"]


def test_lowest_ttft() -> None:
    cands = [Candidate("a", 1.0, 0, 0.3), Candidate("b", 1.0, 9, 0.1)]
    assert order(cands, "lowest_ttft", random.Random(1)) == ["b", "a"]


def test_weighted_first_choice_follows_the_weights_and_ties_share() -> None:
    rng = random.Random(7)
    cands = [Candidate("a", 3.0, 0, 0.1), Candidate("b", 1.0, 0, 0.1)]
    firsts = Counter(order(cands, "weighted", rng)[0] for _ in range(4000))
    assert firsts["a"] / 4000 == pytest.approx(0.75, abs=0.03)


@pytest.mark.parametrize("balance", ["least_outstanding", "lowest_ttft"])
def test_tied_deployments_take_turns(balance) -> None:
    # A quiet group: requests one at a time find every deployment idle and alike.
    rng = random.Random(7)
    even = [Candidate("a", 1.0, 0, 0.1), Candidate("b", 1.0, 0, 0.1), Candidate("c", 1.0, 0, 0.1)]
    firsts = [order(even, balance, rng, turn)[0] for turn in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert order(even, balance, rng, 1) == ["b", "c", "a"]  # failover goes on in turn
    # A real difference still wins over the turn.
    busy = [Candidate("a", 1.0, 2, 0.3), Candidate("b", 1.0, 0, 0.1)]
    assert {order(busy, balance, rng, turn)[0] for turn in range(4)} == {"b"}
