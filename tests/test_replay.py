"""aiserve-replay: the schedule, the weighted draw, measuring a stream, the report and the gate
(pure, no sockets); the runner on Trio's virtual clock with a fake target; the CLI over
httpx2's mock transport."""

from __future__ import annotations

import io
import json
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import msgspec
import pytest
import trio
import trio.testing

from aiserve_trio.record.schema import NO_BODY, Record, encoder
from aiserve_trio.replay.cli import main
from aiserve_trio.replay.client import request_headers, request_url
from aiserve_trio.replay.recording import parse_lines, read_recording
from aiserve_trio.replay.runner import Progress, run
from aiserve_trio.replay.schedule import Slot, fixed_rate, in_order, plan, recorded, unpaced
from aiserve_trio.replay.stats import (
    Meta,
    Report,
    compare,
    markdown,
    percentile,
    render_comparison,
    report_decoder,
    summarize,
)
from aiserve_trio.replay.timing import Result, StreamTimer
from aiserve_trio.replay.weights import WeightedSampler, parse_weights, weight_of

# --- the schedule ---------------------------------------------------------------------


def take(it: Iterator[Any], n: int) -> list[Any]:
    return [next(it) for _ in range(n)]


def test_recorded_timing_starts_at_zero_and_divides_by_speed() -> None:
    times = [100.0, 100.5, 101.0, 104.0]
    assert take(recorded(times), 4) == [0.0, 0.5, 1.0, 4.0]
    assert take(recorded(times, speed=2.0), 4) == [0.0, 0.25, 0.5, 2.0]


def test_recorded_timing_loops_one_mean_gap_after_its_end() -> None:
    # Span 4 s over 3 gaps: the second pass starts at 4 + 4/3.
    got = take(recorded([0.0, 1.0, 2.0, 4.0]), 6)
    assert got[4:] == pytest.approx([4 + 4 / 3, 4 + 4 / 3 + 1.0])
    assert take(recorded([5.0]), 3) == [0.0, 1.0, 2.0]


def test_fixed_rate_and_unpaced() -> None:
    assert take(fixed_rate(4.0), 3) == [0.0, 0.25, 0.5]
    assert take(unpaced(), 2) == [None, None]
    with pytest.raises(ValueError, match="positive"):
        fixed_rate(0)
    with pytest.raises(ValueError, match="positive"):
        recorded([1.0], speed=-1)


def test_plan_stops_at_max_requests_or_duration() -> None:
    slots = list(plan(fixed_rate(10.0), in_order(3), max_requests=5))
    assert [(s.n, s.record) for s in slots] == [(0, 0), (1, 1), (2, 2), (3, 0), (4, 1)]
    slots = list(plan(fixed_rate(10.0), in_order(3), duration=0.35))
    assert [s.at for s in slots] == pytest.approx([0.0, 0.1, 0.2, 0.3])
    # Unpaced slots carry no time, so duration is the runner's to apply.
    assert len(take(plan(unpaced(), in_order(2), duration=0.1), 10)) == 10


# --- weights --------------------------------------------------------------------------


def test_weights_parse_and_multiply() -> None:
    w = parse_weights("intent=sql:3.2, complexity=high:2.8,has_tools:4.0")
    assert [str(x) for x in w] == ["intent=sql:3.2", "complexity=high:2.8", "has_tools:4"]
    assert weight_of({}, w) == 1.0
    assert weight_of({"intent": "card"}, w) == 1.0
    assert weight_of({"intent": "sql"}, w) == 3.2
    assert weight_of({"has_tools": "true"}, w) == 4.0
    assert weight_of({"intent": "sql", "has_tools": "true"}, w) == pytest.approx(12.8)
    assert weight_of({"intent": "sql", "complexity": "high", "has_tools": "true"}, w) == (
        pytest.approx(3.2 * 2.8 * 4.0)
    )


@pytest.mark.parametrize("spec", ["intent", "intent=sql", "intent=sql:x", "Intent:2", "a:-1", "a:inf"])
def test_bad_weights_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match=spec.split(":")[0]):
        parse_weights(spec)


def test_weights_change_the_class_mix_by_their_factors() -> None:
    # 400 records, four classes of equal size; 100,000 draws with a fixed seed (the
    # unweighted class then gets ~4,800: about 1.5 % of noise on each ratio).
    classes = [{}, {"intent": "sql"}, {"has_tools": "true"}, {"intent": "sql", "has_tools": "true"}]
    labels = [classes[i % 4] for i in range(400)]
    weights = parse_weights("intent=sql:3.2,has_tools:4.0")
    sampler = WeightedSampler(labels, weights, random.Random(7))
    drawn = Counter(i % 4 for i in (sampler.draw() for _ in range(100_000)))
    # Each class's share over the unweighted class's share is its weight.
    base = drawn[0]
    assert drawn[1] / base == pytest.approx(3.2, rel=0.05)
    assert drawn[2] / base == pytest.approx(4.0, rel=0.05)
    assert drawn[3] / base == pytest.approx(12.8, rel=0.05)
    # And with no weights, the mix is the recording's.
    flat = WeightedSampler(labels, [], random.Random(7))
    even = Counter(i % 4 for i in (flat.draw() for _ in range(40_000)))
    assert max(even.values()) / min(even.values()) == pytest.approx(1.0, abs=0.06)


def test_a_zero_weight_excludes_a_class_and_all_zero_is_refused() -> None:
    labels = [{"intent": "sql"}, {}]
    sampler = WeightedSampler(labels, parse_weights("intent=sql:0"), random.Random(1))
    assert {sampler.draw() for _ in range(200)} == {1}
    with pytest.raises(ValueError, match="no record"):
        WeightedSampler([{"intent": "sql"}], parse_weights("intent=sql:0"), random.Random(1))


# --- measuring one response -----------------------------------------------------------


def sse(*events: dict[str, Any] | str) -> bytes:
    return b"".join(
        b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    )


def delta(**d: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": d}]}


def test_ttft_and_gaps_from_chunks_that_carry_tokens() -> None:
    t = StreamTimer(0, 0, scheduled=10.0, stream=True)
    t.head(200)
    t.feed(sse(delta(role="assistant")), 10.05)  # no token yet
    t.feed(b": ping\n\n", 10.06)  # a heartbeat
    t.feed(sse(delta(content="He")), 10.10)
    # An event split across reads counts when it is whole.
    t.feed(sse(delta(content="llo"))[:9], 10.12)
    t.feed(sse(delta(content="llo"))[9:] + sse(delta(content="!")), 10.15)  # one chunk, one gap
    t.feed(sse(delta(tool_calls=[{"index": 0, "id": "c"}])), 10.30)
    t.feed(sse(delta(), "[DONE]"), 10.31)
    r = t.finish(10.32)
    assert r.error is None
    assert r.ttft == pytest.approx(0.10)
    assert r.gaps == pytest.approx([0.05, 0.15])
    assert r.total == pytest.approx(0.32)


def test_reasoning_counts_as_a_token_and_crlf_events_parse() -> None:
    t = StreamTimer(0, 0, scheduled=0.0, stream=True)
    t.head(200)
    t.feed(b'data: {"choices":[{"delta":{"reasoning_content":"hm"}}]}\r\n\r\ndata: [DONE]\r\n\r\n', 0.2)
    r = t.finish(0.3)
    assert r.ttft == pytest.approx(0.2)
    assert r.error is None


@pytest.mark.parametrize(
    ("status", "body", "stream", "error"),
    [
        (200, sse(delta(content="a")), True, "truncated"),
        (200, sse(delta(content="a"), {"error": {"code": "stage_deadline_exceeded"}}, "[DONE]"), True, "stage_deadline_exceeded"),
        (200, b"data: {nope\n\n", True, "malformed_event"),
        (503, b'{"error":{"code":"overloaded"}}', True, "http_503"),
        (200, b'{"choices":[{"message":{"content":"hi"}}]}', False, None),
        (200, b'{"error":{"code":"x"}}', False, "x"),
        (200, b"<html>", False, "malformed_body"),
    ],
)
def test_errors(status: int, body: bytes, stream: bool, error: str | None) -> None:
    t = StreamTimer(0, 0, scheduled=0.0, stream=stream)
    t.head(status)
    t.feed(body, 0.1)
    assert t.finish(0.2).error == error


def test_a_non_streamed_reply_has_a_total_but_no_first_token() -> None:
    t = StreamTimer(0, 0, scheduled=1.0, stream=False)
    t.head(200)
    t.feed(b'{"choices":[{"message":', 1.4)
    t.feed(b'{"content":"hi"}}]}', 1.5)
    r = t.finish(1.6)
    assert r.error is None
    assert r.ttft is None
    assert r.total == pytest.approx(0.6)
    assert r.gaps == []


def test_fail_keeps_the_first_error() -> None:
    t = StreamTimer(0, 0, scheduled=0.0, stream=True)
    r = t.fail("timeout", 5.0)
    assert (r.error, r.total, r.status) == ("timeout", 5.0, 0)


# --- report and gate --------------------------------------------------------------------


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([3.0, 1.0], 99) == 3.0
    assert percentile([], 50) is None


def results_of(ttfts_ms: list[float], records: list[int], errors: dict[int, str] | None = None) -> list[Result]:
    errors = errors or {}
    return [
        Result(
            n=i,
            record=rec,
            scheduled=0.0,
            status=200,
            ttft=t / 1000,
            total=t * 10 / 1000,
            gaps=[0.02],
            error=errors.get(i),
        )
        for i, (t, rec) in enumerate(zip(ttfts_ms, records, strict=True))
    ]


LABELS = [{}, {"intent": "sql"}, {"has_tools": "true", "intent": "sql"}]


def report_of(ttfts_ms: list[float], errors: dict[int, str] | None = None) -> Report:
    records = [i % 3 for i in range(len(ttfts_ms))]
    return summarize(results_of(ttfts_ms, records, errors), LABELS, Meta(duration_s=10.0))


def test_the_report_groups_by_label_with_shares() -> None:
    rep = report_of([100.0] * 30, errors={0: "http_503", 3: "http_503", 1: "timeout"})
    assert rep.overall.requests == 30
    assert rep.overall.errors == 3
    assert rep.overall.error_kinds == {"http_503": 2, "timeout": 1}
    assert rep.meta.throughput_rps == 3.0
    assert set(rep.labels) == {"unlabelled", "intent=sql", "has_tools"}
    sql = rep.labels["intent=sql"]
    assert sql.requests == 20  # records 1 and 2 both carry intent=sql
    assert sql.share == pytest.approx(20 / 30)
    assert sql.recorded_share == pytest.approx(2 / 3)
    assert rep.labels["unlabelled"].errors == 2
    assert rep.overall.ttft_ms.p99 == 100.0
    assert rep.overall.total_ms.p50 == 1000.0
    assert rep.overall.gap_ms.p99 == 20.0
    md = markdown(rep)
    assert "| intent=sql | 20 | 66.7% (66.7%) | 1 (5.0%) |" in md
    # The JSON form is what --compare reads back.
    assert report_decoder.decode(msgspec.json.encode(rep)) == rep


def test_compare_fails_on_a_regressed_p99_and_passes_otherwise() -> None:
    baseline = report_of([100.0] * 60)
    slower = report_of([100.0] * 59 + [125.0])  # P99 +25 %
    within = report_of([100.0] * 59 + [115.0])  # P99 +15 %
    failed = compare(slower, baseline, max_regression=0.2)
    assert not failed.passed
    assert {(r.group, r.metric) for r in failed.failures} >= {("overall", "ttft_ms p99"), ("overall", "total_ms p99")}
    text = render_comparison(failed, max_regression=0.2, max_error_increase=0.01)
    assert "FAIL: overall ttft_ms p99 100.0 -> 125.0" in text
    assert compare(within, baseline, max_regression=0.2).passed
    assert not compare(within, baseline, max_regression=0.1).passed
    assert compare(report_of([80.0] * 60), baseline).passed  # faster is fine


def test_compare_gates_the_error_rate_and_small_groups_only_overall() -> None:
    baseline = report_of([100.0] * 60)
    assert not compare(report_of([100.0] * 60, errors={0: "http_503"}), baseline).passed
    # 40 requests are labelled intent=sql and 20 has_tools, all of them slower.
    slow_sql = report_of([100.0 if i % 3 == 0 else 200.0 for i in range(60)])
    strict = compare(slow_sql, baseline, min_requests=20)
    assert {r.group for r in strict.failures} == {"overall", "intent=sql", "has_tools"}
    some = compare(slow_sql, baseline, min_requests=21)
    assert {r.group for r in some.failures} == {"overall", "intent=sql"}
    assert {r.group for r in compare(slow_sql, baseline, min_requests=41).failures} == {"overall"}


# --- recordings -------------------------------------------------------------------------


def line(started: float, offset: float, content: str = "hi", *, body: bool = True, labels: dict[str, str] | None = None) -> bytes:
    raw = msgspec.Raw(json.dumps({"model": "m", "messages": [{"role": "user", "content": content}], "stream": True}).encode())
    rec = Record(started=started, offset=offset, route="/v1/chat/completions", body=raw if body else NO_BODY, labels=labels or {})
    return encoder.encode(rec) + b"\n"


def test_recordings_merge_on_one_time_line_and_skip_what_cannot_be_replayed(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_bytes(line(1000.0, 5.0, "a5") + line(1000.0, 1.0, "a1") + b"garbage\n")
    (tmp_path / "b.jsonl").write_bytes(line(1002.0, 0.5, "b2.5") + line(1002.0, 9.0, "x", body=False))
    (tmp_path / "notes.txt").write_text("not a recording")
    rec = read_recording([tmp_path])
    assert [json.loads(bytes(r.body))["messages"][0]["content"] for r in rec.records] == ["a1", "b2.5", "a5"]
    assert rec.times() == [1001.0, 1002.5, 1005.0]
    assert (rec.no_body, rec.malformed) == (1, 1)
    assert parse_lines([b"\n"]).records == []
    with pytest.raises(FileNotFoundError):
        read_recording([tmp_path / "missing"])


def test_requests_go_to_the_route_with_the_recorded_headers_only() -> None:
    rec = Record(
        started=0, offset=0, route="/v1/chat/completions", body=msgspec.Raw(b"{}"),
        headers={"x-channel": "app", "x-session-id": "ab12", "x-request-timeout-ms": "800", "cookie": "c=1"},
    )
    assert request_url("http://h:1", rec.route) == "http://h:1/v1/chat/completions"
    assert request_url("http://h:1/", rec.route) == "http://h:1/v1/chat/completions"
    assert request_url("http://h:1/v1/other", rec.route) == "http://h:1/v1/other"
    headers = dict(request_headers(rec, "aik_x", "run7", sessions=True))
    assert headers["authorization"] == "Bearer aik_x"
    assert headers["x-aiserve-replay"] == "run7"  # a recording target leaves it out
    assert headers["x-channel"] == "app"
    assert headers["x-request-timeout-ms"] == "800"
    assert "cookie" not in headers
    assert "authorization" not in dict(request_headers(rec, None, "run7"))
    assert "x-session-id" in headers
    assert "x-session-id" not in dict(request_headers(rec, None, "run7"))


def test_the_checked_in_sample_is_what_its_script_makes_and_spans_the_classes() -> None:
    from bench.make_sample_recording import COUNT, OUT, RATE, SEED, as_lines, generate

    from aiserve_trio.record.labels import LabelRules
    from aiserve_trio.record.settings import default_rules

    assert OUT.read_bytes() == as_lines(generate(COUNT, RATE, SEED))
    rec = read_recording([OUT])
    assert 300 <= len(rec.records) <= COUNT
    rules = LabelRules(default_rules(), ["intent"])
    assert all(r.labels == rules.labels(json.loads(bytes(r.body))) for r in rec.records)
    groups = Counter(g for r in rec.records for g in (r.labels or {"unlabelled": "true"}))
    assert min(groups.values()) >= 40, groups


# --- the runner on the virtual clock -----------------------------------------------------


class FakeTarget:
    """Answers every request with a stream: first token after ``ttft``, then ``tokens - 1``
    more ``itl`` apart; notes when each request was sent."""

    def __init__(self, ttft: float = 0.2, itl: float = 0.05, tokens: int = 4, hang: set[int] | None = None) -> None:
        self.ttft, self.itl, self.tokens = ttft, itl, tokens
        self.sent: dict[int, float] = {}
        self.hang = hang or set()
        self.origin = 0.0

    async def __call__(self, slot: Slot, timer: StreamTimer) -> None:
        self.sent[slot.n] = trio.current_time() - self.origin
        if slot.record in self.hang:
            await trio.sleep_forever()
        timer.head(200)
        await trio.sleep(self.ttft)
        for i in range(self.tokens):
            if i:
                await trio.sleep(self.itl)
            timer.feed(sse(delta(content="x")), trio.current_time())
        timer.feed(sse("[DONE]"), trio.current_time())


async def test_replay_keeps_the_recorded_relative_timing(autojump_clock: trio.testing.MockClock) -> None:
    arrivals = [1_000.0, 1_000.4, 1_000.45, 1_003.0, 1_003.0, 1_010.25]
    target = FakeTarget()
    target.origin = trio.current_time()
    slots = plan(recorded(arrivals, speed=2.0), in_order(len(arrivals)), max_requests=len(arrivals))
    results = await run(slots, target, streams=lambda _r: True)
    expected = [(t - arrivals[0]) / 2.0 for t in arrivals]
    sent = [target.sent[n] for n in range(len(arrivals))]
    # Open loop: each request goes out at its time, however long the others take.
    assert sent == pytest.approx(expected, abs=1e-3)
    assert all(r.ok for r in results)
    assert [r.ttft for r in results] == pytest.approx([0.2] * 6, abs=1e-3)
    assert [g for r in results for g in r.gaps] == pytest.approx([0.05] * 18, abs=1e-3)
    assert [r.total for r in results] == pytest.approx([0.35] * 6, abs=1e-3)


async def test_a_fixed_rate_does_not_wait_for_slow_answers(autojump_clock: trio.testing.MockClock) -> None:
    target = FakeTarget(ttft=3.0)
    target.origin = trio.current_time()
    await run(plan(fixed_rate(10.0), in_order(2), max_requests=20), target, streams=lambda _r: True)
    assert [target.sent[n] for n in range(20)] == pytest.approx([n / 10 for n in range(20)], abs=1e-3)


async def test_concurrency_sends_back_to_back_until_the_duration(autojump_clock: trio.testing.MockClock) -> None:
    target = FakeTarget(ttft=0.5, tokens=1)  # each request takes 0.5 s
    target.origin = trio.current_time()
    results = await run(plan(unpaced(), in_order(3)), target, streams=lambda _r: True, concurrency=2, duration=2.0)
    # Two workers, 0.5 s per request, 2 s: four rounds of two.
    assert len(results) == 8
    assert sorted(target.sent.values()) == pytest.approx([0, 0, 0.5, 0.5, 1.0, 1.0, 1.5, 1.5], abs=1e-3)


async def test_the_timeout_is_the_runners_and_counts_from_the_scheduled_start(
    autojump_clock: trio.testing.MockClock,
) -> None:
    target = FakeTarget(hang={1})
    slots = plan(fixed_rate(1.0), in_order(2), max_requests=4)
    results = await run(slots, target, streams=lambda _r: True, request_timeout=2.5)
    assert [r.error for r in results] == [None, "timeout", None, "timeout"]
    assert results[1].total == pytest.approx(2.5, abs=1e-3)


async def test_beyond_max_inflight_slots_are_errors_not_delays(autojump_clock: trio.testing.MockClock) -> None:
    target = FakeTarget(hang={0})
    progress = Progress()
    slots = plan(fixed_rate(10.0), in_order(1), max_requests=5)
    results = await run(slots, target, streams=lambda _r: True, max_inflight=2, request_timeout=10, progress=progress)
    assert [r.error for r in results] == ["timeout", "timeout", "inflight_cap", "inflight_cap", "inflight_cap"]
    assert progress.errors == 5
    assert progress.errors_by_kind == {"timeout": 2, "inflight_cap": 3}


def test_the_progress_line() -> None:
    p = Progress()
    p.start(100.0)
    for i in range(30):
        p.add(Result(n=i, record=0, scheduled=0, error="http_503" if i < 2 else None))
    p.inflight = 4
    assert p.line(102.0, total=50) == (
        "replay 30/50 done,   15.0 req/s, 2 errors (most: http_503 2), 4 in flight, 00:02"
    )
    assert "   0.0 req/s" in p.line(103.0)


# --- the command line --------------------------------------------------------------------


def write_recording(path: Path, n: int = 12) -> Path:
    labels: list[dict[str, str]] = [{}, {"intent": "sql"}, {"has_tools": "true"}]
    path.write_bytes(b"".join(line(1000.0, i * 0.01, f"q{i}", labels=labels[i % 3]) for i in range(n)))
    return path


class SseTransport:
    """httpx2 mock transport handler: a short stream per request; notes what it got."""

    def __init__(self) -> None:
        self.requests: list[httpx2.Request] = []

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(request)
        body = sse(delta(content="a"), delta(content="b"), "[DONE]")
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=body)


def cli(args: list[str], transport: SseTransport) -> tuple[int, str]:
    out = io.StringIO()
    code = main([*args, "--quiet"], stdout=out, transport=httpx2.MockTransport(transport))
    return code, out.getvalue()


def test_the_cli_replays_reports_and_sends_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = write_recording(tmp_path / "r.jsonl")
    monkeypatch.setenv("REPLAY_KEY", "aik_test_secret")
    target = SseTransport()
    code, out = cli([str(rec), "--target", "http://gw", "--rate", "500", "--api-key-env", "REPLAY_KEY", "--warmup", "3", "--report", str(tmp_path / "rep")], target)
    assert code == 0
    # Three warm-up requests, then the twelve the report counts.
    assert len(target.requests) == 3 + 12
    assert [json.loads(r.content)["messages"][0]["content"] for r in target.requests[:4]] == ["q0", "q1", "q2", "q0"]
    first = target.requests[3]
    assert str(first.url) == "http://gw/v1/chat/completions"
    assert first.headers["authorization"] == "Bearer aik_test_secret"
    assert json.loads(first.content)["messages"][0]["content"] == "q0"
    report = report_decoder.decode((tmp_path / "rep.json").read_bytes())
    assert report.overall.requests == 12
    assert report.overall.errors == 0
    assert set(report.labels) == {"unlabelled", "intent=sql", "has_tools"}
    assert report.meta.command.startswith("aiserve-replay ")
    assert "| overall | 12 |" in (tmp_path / "rep.md").read_text()
    assert "| overall | 12 |" in out


def test_the_cli_gate_exit_status(tmp_path: Path) -> None:
    rec = write_recording(tmp_path / "r.jsonl", n=30)
    args = [str(rec), "--target", "http://gw", "--concurrency", "4", "--report", str(tmp_path / "now")]
    code, _ = cli(args, SseTransport())
    assert code == 0
    now = report_decoder.decode((tmp_path / "now.json").read_bytes())

    def baseline(name: str, p99_ms: float) -> str:
        # Absolute P99s, not a multiple of this run's: one slow request in this run
        # (a busy machine) must not make the next run look faster than the "fast" one.
        b = msgspec.structs.replace(now)
        b.overall = msgspec.structs.replace(
            now.overall,
            ttft_ms=msgspec.structs.replace(now.overall.ttft_ms, p99=p99_ms),
            total_ms=msgspec.structs.replace(now.overall.total_ms, p99=p99_ms),
        )
        path = tmp_path / name
        path.write_bytes(msgspec.json.encode(b))
        return str(path)

    # Against a baseline of a microsecond, any real P99 is a regression: exit 1.
    code, out = cli([*args, "--compare", baseline("fast.json", 0.001)], SseTransport())
    assert code == 1
    assert "FAIL: overall ttft_ms p99" in out
    # Against a baseline of 1,000 s: exit 0.
    code, out = cli([*args, "--compare", baseline("slow.json", 1e6)], SseTransport())
    assert code == 0
    assert "PASS" in out


def test_session_ids_are_sent_only_when_asked(tmp_path: Path) -> None:
    raw = msgspec.Raw(b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}')
    rec = Record(started=0, offset=0, route="/v1/chat/completions", body=raw, headers={"x-session-id": "ab12", "x-channel": "app"})
    path = tmp_path / "r.jsonl"
    path.write_bytes(encoder.encode(rec) + b"\n")
    for extra, expected in (([], None), (["--sessions"], "ab12")):
        target = SseTransport()
        code, _ = cli([str(path), "--target", "http://gw", "--report", str(tmp_path / "x"), *extra], target)
        assert code == 0
        (request,) = target.requests
        assert request.headers.get("x-session-id") == expected
        assert request.headers["x-channel"] == "app"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--weights", "intent"], "--weights"),
        (["--api-key-env", "SURELY_UNSET_VARIABLE_X"], "SURELY_UNSET_VARIABLE_X"),
        (["--compare", "/nonexistent.json"], "--compare"),
        (["--weights", "intent=sql:0,unlabelled:0", "--max-requests", "2"], None),
    ],
)
def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str | None) -> None:
    rec = tmp_path / "r.jsonl"
    rec.write_bytes(line(0, 0, labels={"intent": "sql"}))
    code, _ = cli([str(rec), "--target", "http://gw", "--report", str(tmp_path / "x"), *extra], SseTransport())
    assert code == 2
    assert (message or "no record") in capsys.readouterr().err


def test_a_recording_with_nothing_to_replay_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = tmp_path / "r.jsonl"
    rec.write_bytes(line(0, 0, body=False))
    code, _ = cli([str(rec), "--target", "http://gw"], SseTransport())
    assert code == 2
    assert "1 without a body" in capsys.readouterr().err


# --- end to end: recorded through the app, replayed against hypercorn --------------------


@pytest.mark.slow
def test_traffic_recorded_by_the_app_replays_against_a_real_gateway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiserve_trio.config import parse_config
    from aiserve_trio.runtime.asgi import App

    from .asgi_client import Client
    from .authcfg import KEY_A, OFF, auth_toml, bearer
    from .conftest import config_text
    from .servers import hypercorn_gateway
    from .test_record_labels import TABLE

    gateway_toml = config_text(ttft_ms="5", inter_token_ms="2").replace(OFF, auth_toml())
    recordings = tmp_path / "recordings"
    bodies = [b for _, b, _ in TABLE if "messages" in b]

    async def record_traffic() -> None:
        toml = gateway_toml + f'\n[record]\nenabled = true\npath = "{recordings}"\n'
        app = App(parse_config(toml, source="<test>"))
        async with trio.open_nursery() as nursery:
            await app.startup(nursery)
            client = Client(app)
            for i, body in enumerate(bodies):
                headers = bearer(KEY_A, **{"x-channel": "app", "x-session-id": f"customer-{i % 3}"})
                r = await client.chat({**body, "stream": i % 2 == 0}, headers=headers)
                assert r.status == 200, r.body
                await trio.sleep(0.02)
            await app.shutdown()

    trio.run(record_traffic)
    recorded_text = "".join(f.read_text() for f in recordings.glob("*.jsonl"))
    assert KEY_A not in recorded_text
    assert "customer-" not in recorded_text

    config = tmp_path / "gateway.toml"
    config.write_text(gateway_toml)
    monkeypatch.setenv("AISERVE_API_KEY", KEY_A)
    with hypercorn_gateway(config) as (base, _):
        out = io.StringIO()
        code = main(
            [str(recordings), "--target", base, "--speed", "4", "--report", str(tmp_path / "baseline"), "--quiet"],
            stdout=out,
        )
        assert code == 0, out.getvalue()
        baseline = report_decoder.decode((tmp_path / "baseline.json").read_bytes())
        assert baseline.overall.requests == len(bodies)
        assert baseline.overall.errors == 0, baseline.overall.error_kinds
        assert baseline.overall.ttft_ms.p50 is not None
        assert baseline.overall.gap_ms.p99 is not None
        assert {"intent=sql", "complexity=high", "has_tools", "unlabelled"} <= set(baseline.labels)
        assert baseline.labels["intent=sql"].requests == sum(1 for _, b, lb in TABLE if "messages" in b and lb.get("intent") == "sql")

        code = main(
            [
                str(recordings), "--target", base, "--concurrency", "4", "--max-requests", "60",
                "--weights", "intent=sql:3.2,complexity=high:2.8,has_tools:4.0", "--seed", "3",
                "--report", str(tmp_path / "candidate"), "--compare", str(tmp_path / "baseline.json"),
                "--max-regression", "50", "--quiet",
            ],
            stdout=out,
        )
        assert code == 0, out.getvalue()
        candidate = report_decoder.decode((tmp_path / "candidate.json").read_bytes())
        assert candidate.overall.requests == 60
        assert candidate.overall.errors == 0, candidate.overall.error_kinds
        # The weights moved the mix towards the weighted classes.
        sql = candidate.labels["intent=sql"]
        assert sql.share > sql.recorded_share
        assert "PASS" in out.getvalue()

    # A key that the gateway does not know: every request fails, and says why.
    monkeypatch.setenv("AISERVE_API_KEY", "aik_nobody_" + "n" * 32)
    with hypercorn_gateway(config) as (base, _):
        code = main(
            [str(recordings), "--target", base, "--rate", "50", "--report", str(tmp_path / "refused"), "--quiet"],
            stdout=io.StringIO(),
        )
    refused = report_decoder.decode((tmp_path / "refused.json").read_bytes())
    assert code == 0
    assert refused.overall.error_kinds == {"http_401": len(bodies)}
