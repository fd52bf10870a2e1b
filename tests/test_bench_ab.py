"""``python -m bench.ab``'s round-by-round comparison: a revision's points against the
first revision's of the same round, so that drift of the machine cancels."""

from typing import Any, cast

import pytest
from bench.ab import by_name, paired
from bench.systems import Running, cpu_ticks, stolen_pct


def point(rps: float, cpu_us: float) -> dict[str, float]:
    return {"rps": rps, "cpu_us": cpu_us}


def test_each_round_is_compared_with_the_same_round_of_the_first_revision() -> None:
    # The machine slowed down after round 1; the other revision is 2 % slower in every round.
    base = [point(1000, 600), point(800, 750), point(900, 660)]
    other = [point(980, 612), point(784, 765), point(882, 672)]
    d = paired(base, other)
    assert round(d["rps_pct"], 6) == -2.0
    assert round(d["rps_pct_lo"], 6) == round(d["rps_pct_hi"], 6) == -2.0
    assert d["cpu_us"] == 12  # the median of 12, 15, 12
    assert d["cpu_us_lo"] == 12
    assert d["cpu_us_hi"] == 15


def test_the_median_and_the_spread_of_noisy_rounds() -> None:
    base = [point(1000, 600)] * 5
    other = [point(r, 600) for r in (950, 990, 1000, 1010, 1040)]
    d = paired(base, other)
    assert round(d["rps_pct"], 6) == 0.0
    assert round(d["rps_pct_lo"], 6) == -5.0
    assert round(d["rps_pct_hi"], 6) == 4.0


def test_cpu_per_request_is_also_compared_in_percent() -> None:
    # --together runs compare CPU per request: the gateways share one CPU, so req/s is
    # each one's share of it, and the CPU a request costs is what tells them apart.
    base = [point(400, 800), point(300, 1000), point(350, 900)]
    other = [point(380, 824), point(290, 1010), point(330, 945)]
    d = paired(base, other)
    assert round(d["cpu_pct"], 6) == 3.0  # +3 %, +1 %, +5 %: the median
    assert round(d["cpu_pct_lo"], 6) == 1.0
    assert round(d["cpu_pct_hi"], 6) == 5.0


def test_the_rounds_of_each_start_order_are_also_compared_apart() -> None:
    # --together reverses the start order every other round. A build dearer only when it
    # starts first shows a median that stands for neither order: the two apart say so.
    base = [point(500, 900)] * 6
    other = [point(500, 900 + d) for d in (2, 90, -4, 85, 0, 95)]
    d = paired(base, other)
    assert d["cpu_us_even"] == 0  # started after the first revision: 2, -4, 0
    assert d["cpu_us_odd"] == 90  # started before it: 90, 85, 95
    assert d["cpu_us"] == 43.5  # the overall median, between the two modes


def test_the_mean_change_comes_with_an_interval_that_narrows_with_more_rounds() -> None:
    # Rounds of +1 % and +5 % CPU alternate: the mean is +3 %, and with 4 rounds it could
    # as well be +1 % or +5 %; with 40 rounds the interval excludes both.
    base = [point(1000, 1000)] * 40
    other = [point(1000, 1010 if i % 2 else 1050) for i in range(40)]
    few = paired(base[:4], other[:4])
    many = paired(base, other)
    assert round(few["cpu_pct_mean"], 6) == round(many["cpu_pct_mean"], 6) == 3.0
    assert few["cpu_pct_mean_lo"] <= 1.5
    assert few["cpu_pct_mean_hi"] >= 4.5
    assert 2.0 < many["cpu_pct_mean_lo"] < 3.0 < many["cpu_pct_mean_hi"] < 4.0
    assert many["rps_mean"] == many["rps_mean_lo"] == many["rps_mean_hi"] == 0.0


# A /proc/stat at two moments: user nice system idle iowait irq softirq steal guest guest_nice.
_STAT_BEFORE = "cpu  1000 0 200 8000 0 0 0 100 50 0\ncpu0 500 0 100 4000 0 0 0 50 25 0\n"
_STAT_AFTER = "cpu  1600 0 300 8200 0 0 0 300 350 0\ncpu0 800 0 150 4100 0 0 0 150 175 0\n"


def test_a_report_says_how_much_of_the_machine_the_hypervisor_took() -> None:
    """A run on a VM whose neighbours stole CPU time is noisier than its rounds show;
    the report's header gives the stolen share, from the machine-wide ``cpu`` line
    (guest time is already inside user time, so it is not counted twice)."""
    before, after = cpu_ticks(_STAT_BEFORE), cpu_ticks(_STAT_AFTER)
    assert before == (100, 9300)
    # 200 of 1,100 ticks stolen between the two.
    assert round(stolen_pct(before, after), 1) == 18.2
    assert stolen_pct(before, before) == 0.0


def test_the_gateways_can_reach_the_upstream_by_a_host_name() -> None:
    # --upstream-host: the gateway resolves the name (in a thread, as a provider's name),
    # and reaches the same port over the same scheme.
    up = Running("upstream", ["node"], cast(Any, None), "https://127.0.0.1:40123")
    assert by_name(up, "localhost").base == "https://localhost:40123"
    assert by_name(up, None) is up
    assert up.base == "https://127.0.0.1:40123"  # the upstream itself is left as it was
    with pytest.raises(ValueError, match=r"127\.0\.0\.1"):
        by_name(Running("elsewhere", [], cast(Any, None), "http://10.0.0.5:80"), "localhost")
