"""A replay's report and the comparison with a baseline (pure).

:func:`summarize` turns the :class:`~.timing.Result` s into a :class:`Report`:
P50/P90/P99 of TTFT, total time and inter-chunk gaps (milliseconds, over the
requests that succeeded; nearest rank, as the benchmarks' load generator counts) and the error
rate, overall and per label group (``intent=sql``; a flag label by its name,
``has_tools``; ``unlabelled`` for records with no label). A request counts in
every group of its labels. :func:`markdown` renders it.

:func:`compare` is the deployment gate: it lists every figure of the groups both
reports have and fails when a P99 (TTFT or total) grew by more than
``max_regression`` (0.2: 20 %) or the error rate rose by more than
``max_error_increase`` (absolute) -- errors that end fast would otherwise make
a P99 look better. A label group is gated only when both reports have at least
``min_requests`` of its requests: a P99 of a handful is noise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from ..record.settings import FLAG
from .timing import Result

QUANTILES = (50, 90, 99)
OVERALL = "overall"
UNLABELLED = "unlabelled"


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) by nearest rank, or None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


class Quantiles(msgspec.Struct, kw_only=True):
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, values_ms: Sequence[float]) -> Quantiles:
        p50, p90, p99 = (percentile(values_ms, q) for q in QUANTILES)
        return cls(p50=_round(p50), p90=_round(p90), p99=_round(p99))


class Group(msgspec.Struct, kw_only=True):
    """The figures of one group of requests (all, or those with one label)."""

    requests: int
    errors: int
    error_rate: float
    ttft_ms: Quantiles
    total_ms: Quantiles
    gap_ms: Quantiles
    #: How often each error happened.
    error_kinds: dict[str, int] = msgspec.field(default_factory=dict)
    #: The group's share of the requests replayed, and of the recording (mix check).
    share: float = 0.0
    recorded_share: float = 0.0


class Meta(msgspec.Struct, kw_only=True):
    command: str = ""
    target: str = ""
    recordings: list[str] = msgspec.field(default_factory=list)
    records: int = 0
    mode: str = ""
    weights: str = ""
    seed: int | None = None
    started: str = ""
    duration_s: float = 0.0
    throughput_rps: float = 0.0


class Report(msgspec.Struct, kw_only=True):
    meta: Meta
    overall: Group
    labels: dict[str, Group] = msgspec.field(default_factory=dict)


def group_names(labels: Mapping[str, str]) -> list[str]:
    """The report groups a request with these labels counts in."""
    if not labels:
        return [UNLABELLED]
    return sorted(k if v == FLAG else f"{k}={v}" for k, v in labels.items())


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _group(results: Sequence[Result]) -> Group:
    ok = [r for r in results if r.ok]
    kinds: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            kinds[r.error] = kinds.get(r.error, 0) + 1
    errors = len(results) - len(ok)
    return Group(
        requests=len(results),
        errors=errors,
        error_rate=round(errors / len(results), 6) if results else 0.0,
        ttft_ms=Quantiles.of([r.ttft * 1000 for r in ok if r.ttft is not None]),
        total_ms=Quantiles.of([r.total * 1000 for r in ok if r.total is not None]),
        gap_ms=Quantiles.of([g * 1000 for r in ok for g in r.gaps]),
        error_kinds=dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
    )


def summarize(
    results: Sequence[Result], record_labels: Sequence[Mapping[str, str]], meta: Meta
) -> Report:
    """The report of a replay.

    Args:
        results: every request sent.
        record_labels: the labels of each record of the recording (by index).
        meta: what ran; its ``throughput_rps`` is computed here from ``duration_s``.
    """
    by_group: dict[str, list[Result]] = {}
    for r in results:
        for name in group_names(record_labels[r.record]):
            by_group.setdefault(name, []).append(r)
    recorded: dict[str, int] = {}
    for labels in record_labels:
        for name in group_names(labels):
            recorded[name] = recorded.get(name, 0) + 1
    groups = {}
    for name in sorted(set(by_group) | set(recorded)):
        g = _group(by_group.get(name, []))
        g.share = round(g.requests / len(results), 6) if results else 0.0
        g.recorded_share = round(recorded.get(name, 0) / len(record_labels), 6)
        groups[name] = g
    overall = _group(results)
    overall.share = overall.recorded_share = 1.0
    rps = len(results) / meta.duration_s if meta.duration_s > 0 else 0.0
    meta = msgspec.structs.replace(meta, throughput_rps=round(rps, 3))
    return Report(meta=meta, overall=overall, labels=groups)


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def markdown(report: Report) -> str:
    """The report as Markdown: what ran, then one row per group."""
    m = report.meta
    lines = [
        "# Replay report",
        "",
        f"- target: `{m.target}`",
        f"- recording: {', '.join(f'`{r}`' for r in m.recordings)} ({m.records} records)",
        f"- pacing: {m.mode}; weights: "
        + (f"{m.weights} (seed {m.seed})" if m.weights else "none"),
        f"- started {m.started}, {m.duration_s:.1f} s, {report.overall.requests} requests, "
        f"{m.throughput_rps:.1f} req/s",
    ]
    if m.command:
        lines += ["", "```sh", m.command, "```"]
    lines += [
        "",
        "| group | requests | share (recorded) | errors | TTFT p50 / p90 / p99 ms "
        "| total p50 / p90 / p99 ms | gap p99 ms |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for name, g in [(OVERALL, report.overall), *report.labels.items()]:
        t, tot = g.ttft_ms, g.total_ms
        lines.append(
            f"| {name} | {g.requests} | {g.share:.1%} ({g.recorded_share:.1%}) "
            f"| {g.errors} ({g.error_rate:.1%}) "
            f"| {_fmt(t.p50)} / {_fmt(t.p90)} / {_fmt(t.p99)} "
            f"| {_fmt(tot.p50)} / {_fmt(tot.p90)} / {_fmt(tot.p99)} | {_fmt(g.gap_ms.p99)} |"
        )
    kinds = report.overall.error_kinds
    if kinds:
        lines += ["", "Errors: " + ", ".join(f"`{k}` {n}" for k, n in kinds.items())]
    return "\n".join(lines) + "\n"


# --- the gate ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    group: str
    metric: str
    baseline: float | None
    current: float | None
    #: Relative for times (0.25: 25 % slower), absolute for the error rate.
    change: float | None
    gated: bool
    failed: bool


@dataclass(slots=True)
class Comparison:
    rows: list[Row] = field(default_factory=list)
    #: Groups only one of the two reports has.
    unmatched: list[str] = field(default_factory=list)

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if r.failed]

    @property
    def passed(self) -> bool:
        return not self.failures


def compare(
    current: Report,
    baseline: Report,
    *,
    max_regression: float = 0.2,
    max_error_increase: float = 0.01,
    min_requests: int = 20,
) -> Comparison:
    """Every figure of the groups both reports have; see the module docstring for the gate."""
    out = Comparison()
    pairs: list[tuple[str, Group, Group]] = [(OVERALL, current.overall, baseline.overall)]
    for name in sorted(set(current.labels) | set(baseline.labels)):
        cur, base = current.labels.get(name), baseline.labels.get(name)
        if cur is None or base is None or not cur.requests or not base.requests:
            out.unmatched.append(name)
            continue
        pairs.append((name, cur, base))
    for name, cur, base in pairs:
        gated = name == OVERALL or min(cur.requests, base.requests) >= min_requests
        for metric in ("ttft_ms", "total_ms"):
            for q in QUANTILES:
                b = getattr(getattr(base, metric), f"p{q}")
                c = getattr(getattr(cur, metric), f"p{q}")
                change = (c - b) / b if b and c is not None else None
                is_gated = gated and q == 99
                failed = is_gated and change is not None and change > max_regression
                out.rows.append(Row(name, f"{metric} p{q}", b, c, change, is_gated, failed))
        change = cur.error_rate - base.error_rate
        failed = gated and change > max_error_increase
        out.rows.append(
            Row(name, "error_rate", base.error_rate, cur.error_rate, change, gated, failed)
        )
    return out


def render_comparison(c: Comparison, *, max_regression: float, max_error_increase: float) -> str:
    """The differences as a text table, then PASS or FAIL with the reasons."""
    head = f"{'group':<24} {'metric':<14} {'baseline':>10} {'current':>10} {'change':>9}"
    lines = [head, "-" * len(head)]
    for r in c.rows:
        if r.metric == "error_rate":
            b, cur = f"{(r.baseline or 0):.2%}", f"{(r.current or 0):.2%}"
            ch = "" if r.change is None else f"{r.change * 100:+.2f}pt"
        else:
            b, cur = _fmt(r.baseline), _fmt(r.current)
            ch = "" if r.change is None else f"{r.change:+.1%}"
        mark = "  FAIL" if r.failed else ("  gate" if r.gated else "")
        lines.append(f"{r.group:<24} {r.metric:<14} {b:>10} {cur:>10} {ch:>9}{mark}")
    if c.unmatched:
        lines.append(f"not compared (in one report only): {', '.join(c.unmatched)}")
    if c.passed:
        lines.append(
            f"PASS: no P99 grew by more than {max_regression:.0%}, no error rate rose "
            f"by more than {max_error_increase * 100:.2f} points"
        )
    else:
        reasons = "; ".join(
            f"{r.group} {r.metric} {_fmt(r.baseline)} -> {_fmt(r.current)}"
            if r.metric != "error_rate"
            else f"{r.group} error rate {(r.baseline or 0):.2%} -> {(r.current or 0):.2%}"
            for r in c.failures
        )
        lines.append(f"FAIL: {reasons}")
    return "\n".join(lines) + "\n"


report_encoder = msgspec.json.Encoder()
report_decoder = msgspec.json.Decoder(Report)
