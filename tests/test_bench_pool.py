"""``python -m bench.pool``: the rounds of several ``bench.ab`` runs of one pair of
revisions, paired within each run and pooled, apart for runs served together."""

import json
from pathlib import Path

import pytest
from bench.pool import find, main
from bench.stats import paired_changes


def run(tmp: Path, name: str, base: list[tuple[float, float]], other: list[tuple[float, float]],
        *, together: bool = False, off: str = "HEAD+bench/configs/audit-off.toml",
        on: str = "HEAD+bench/configs/audit-on.toml") -> Path:
    def pts(xs: list[tuple[float, float]]) -> list[dict[str, float]]:
        return [{"rps": r, "cpu_us": c} for r, c in xs]

    path = tmp / f"{name}.json"
    path.write_text(json.dumps({off: {"json-c16": pts(base)}, on: {"json-c16": pts(other)}}))
    path.with_suffix(".md").write_text(
        ("All 2 revisions served at once, ...\n" if together else "One hypercorn Trio worker ...\n")
        + f"| 1111111 ({off}) | ... |\n| 2222222 ({on}) | ... |\n")
    return path


def test_a_revision_is_named_whole_or_by_a_unique_ending() -> None:
    names = ["HEAD+bench/configs/audit-off.toml", "HEAD+bench/configs/audit-on.toml",
             "exp+bench/configs/audit-on.toml"]
    assert find(names, ["audit-off.toml"]) == "HEAD+bench/configs/audit-off.toml"
    assert find(names, ["HEAD+bench/configs/audit-on.toml"]) == "HEAD+bench/configs/audit-on.toml"
    assert find(names, ["audit-on.toml"]) is None  # two end with it
    # Another run named the same build by its commit: the first name that matches.
    assert find(["abc1234+bench/configs/audit-on.toml"],
                ["HEAD+bench/configs/audit-on.toml", "abc1234+bench/configs/audit-on.toml"]
                ) == "abc1234+bench/configs/audit-on.toml"


def test_each_round_is_paired_within_its_run() -> None:
    rps, cpu = paired_changes([{"rps": 1000, "cpu_us": 600}, {"rps": 500, "cpu_us": 1200}],
                              [{"rps": 970, "cpu_us": 618}, {"rps": 490, "cpu_us": 1212}])
    assert [round(x, 6) for x in rps] == [-3.0, -2.0]
    assert [round(x, 6) for x in cpu] == [3.0, 1.0]


def test_runs_are_pooled_and_together_runs_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = run(tmp_path, "a", [(1000, 600)] * 3, [(960, 624)] * 3)  # -4 %, +4 %
    b = run(tmp_path, "b", [(800, 700)] * 3, [(784, 714)] * 3)  # -2 %, +2 %
    c = run(tmp_path, "c", [(300, 900)] * 2, [(297, 918)] * 2, together=True)
    d = run(tmp_path, "d", [(300, 900)], [(297, 918)], on="HEAD+other.toml")
    assert main([str(p) for p in (a, b, c, d)] + ["--base", "audit-off.toml",
                                                  "--other", "audit-on.toml"]) == 0
    out = capsys.readouterr().out
    assert f"{a} (interleaved, 2222222 against 1111111): 3 rounds: -4.00 % req/s" in out
    assert "pooled, interleaved: 6 rounds: -3.00 % req/s" in out
    assert "+3.00 % CPU/req" in out
    assert "pooled, together: 2 rounds: -1.00 % req/s" in out
    assert f"{d}: left out" in out
