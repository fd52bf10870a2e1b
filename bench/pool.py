"""The rounds of several ``bench.ab`` runs pooled: one revision against another, all runs.

    .venv/bin/python -m bench.pool --base audit-off.toml --other audit-on.toml \\
        bench/results/2026-12-02/ab-audit-*.json

One run of 12 rounds leaves a 3 % effect uncertain on a noisy machine; the runs made
since the code last changed hold several times as many rounds of the same pair. Each
run's rounds are paired within the run (a revision's point against the base's of the
same round, as ``bench.ab`` does), then the paired differences of every run are
pooled and given a mean with a 95 % bootstrap interval (``stats.mean_interval``).
Runs served together (``--together``: CPU per request is the figure) and interleaved
(req/s is) are pooled apart; which a run was is read from its markdown report.

``--base`` and ``--other`` name a revision as ``bench.ab`` was given it
(``HEAD+bench/configs/audit-on.toml``) or by a unique ending of that name
(``audit-on.toml``); either may be given again, for runs that named the same build
otherwise (the first that matches is taken). A run without both is left out, and
said so; each run's line says which commits were compared, to be checked against
the history of what is measured.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from .stats import mean_interval, paired_changes


def find(names: Iterable[str], wanted: Sequence[str]) -> str | None:
    """The revision of ``names`` that is the first of ``wanted`` or the only one ending
    with it."""
    names = list(names)
    for w in wanted:
        if w in names:
            return w
        hits = [n for n in names if n.endswith(w)]
        if len(hits) == 1:
            return hits[0]
    return None


def commit(report: str, name: str) -> str:
    """The commit a run's markdown report gives for revision ``name`` ("?" if none)."""
    m = re.search(rf"^\| (\w+) \({re.escape(name)}\) \|", report, re.M)
    return m[1] if m else "?"


def summary(rps: Sequence[float], cpu: Sequence[float]) -> str:
    r, r_lo, r_hi = mean_interval(rps)
    c, c_lo, c_hi = mean_interval(cpu)
    return (f"{len(rps)} rounds: {r:+.2f} % req/s (95 % interval {r_lo:+.2f} to {r_hi:+.2f}), "
            f"{c:+.2f} % CPU/req ({c_lo:+.2f} to {c_hi:+.2f})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pool", description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="bench.ab JSON results")
    ap.add_argument("--base", required=True, action="append",
                    help="the revision compared against (again: another name of it)")
    ap.add_argument("--other", required=True, action="append",
                    help="the revision compared (again: another name of it)")
    ap.add_argument("--point", default="json-c16", help="mode and concurrency (json-c16)")
    ns = ap.parse_args(argv)
    pooled: dict[str, tuple[list[float], list[float]]] = {"interleaved": ([], []),
                                                           "together": ([], [])}
    for path in ns.runs:
        results = json.loads(path.read_text())
        base, other = find(results, ns.base), find(results, ns.other)
        if base is None or other is None or ns.point not in results[base]:
            print(f"{path}: left out (no single {' or '.join(ns.base)} and "
                  f"{' or '.join(ns.other)} at {ns.point})")
            continue
        md = path.with_suffix(".md")
        report = md.read_text() if md.exists() else ""
        mode = "together" if "served at once" in report else "interleaved"
        rps, cpu = paired_changes(results[base][ns.point], results[other][ns.point])
        print(f"{path} ({mode}, {commit(report, other)} against {commit(report, base)}): "
              f"{summary(rps, cpu)}")
        pooled[mode][0].extend(rps)
        pooled[mode][1].extend(cpu)
    for mode, (rps, cpu) in pooled.items():
        if rps:
            print(f"pooled, {mode}: {summary(rps, cpu)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
