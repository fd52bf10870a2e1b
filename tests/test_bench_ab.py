"""``python -m bench.ab``'s round-by-round comparison: a revision's points against the
first revision's of the same round, so that drift of the machine cancels."""

from bench.ab import paired


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
