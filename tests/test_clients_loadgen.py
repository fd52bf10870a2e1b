"""The bench's load generator (a client of its own) and the arithmetic its report rests on."""

from __future__ import annotations

import math
from typing import Any

import h11
import pytest
import trio
from bench.loadgen import Sample, Target, closed_loop, open_loop, percentile, summarize
from bench.stats import added, bucket_quantile, diff_buckets, first_over, parse_stage_buckets

# --- pure arithmetic -------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "q", "want"),
    [
        ([], 50, None),
        ([7.0], 99, 7.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.0),
        ([1.0, 2.0, 3.0, 4.0], 75, 3.0),
        ([4.0, 1.0, 3.0, 2.0], 100, 4.0),
        (list(map(float, range(1, 101))), 99, 99.0),
    ],
)
def test_percentile_is_nearest_rank(values, q, want):
    assert percentile(values, q) == want


def test_added_is_per_percentile_difference():
    direct = [1.0] * 99 + [2.0]
    system = [1.5] * 99 + [10.0]
    assert added(system, direct, (50.0, 100.0)) == [0.5, 8.0]
    assert added([], direct, (50.0,)) == [None]


PAGE_BEFORE = """\
# TYPE pipeline_stage_latency_seconds histogram
pipeline_stage_latency_seconds_bucket{le="0.001",stage="parse"} 10.0
pipeline_stage_latency_seconds_bucket{le="0.01",stage="parse"} 10.0
pipeline_stage_latency_seconds_bucket{le="+Inf",stage="parse"} 10.0
pipeline_stage_latency_seconds_count{stage="parse"} 10.0
other_bucket{le="1",stage="parse"} 99.0
"""
PAGE_AFTER = """\
pipeline_stage_latency_seconds_bucket{le="0.001",stage="parse"} 60.0
pipeline_stage_latency_seconds_bucket{le="0.01",stage="parse"} 110.0
pipeline_stage_latency_seconds_bucket{le="+Inf",stage="parse"} 110.0
pipeline_stage_latency_seconds_bucket{le="0.001",stage="sse"} 0.0
pipeline_stage_latency_seconds_bucket{le="+Inf",stage="sse"} 4.0
"""


def test_stage_buckets_diff_between_scrapes():
    before = parse_stage_buckets(PAGE_BEFORE)
    assert before == {"parse": [(0.001, 10.0), (0.01, 10.0), (math.inf, 10.0)]}
    delta = diff_buckets(parse_stage_buckets(PAGE_AFTER), before)
    assert delta["parse"] == [(0.001, 50.0), (0.01, 100.0), (math.inf, 100.0)]
    assert delta["sse"] == [(0.001, 0.0), (math.inf, 4.0)]


def test_bucket_quantile_interpolates_inside_the_bucket():
    rows = [(0.001, 50.0), (0.01, 100.0), (math.inf, 100.0)]
    assert bucket_quantile(rows, 0.5) == pytest.approx(0.001)
    # rank 99 of 100 lies 49/50 of the way through the (1 ms, 10 ms] bucket
    assert bucket_quantile(rows, 0.99) == pytest.approx(0.001 + 0.009 * 49 / 50)
    assert bucket_quantile([(0.001, 0.0), (math.inf, 4.0)], 0.99) == 0.001
    assert bucket_quantile([(0.001, 0.0), (math.inf, 0.0)], 0.99) is None


def test_first_over_finds_the_lowest_concurrency_past_the_limit():
    assert first_over({64: 9.0, 1: 0.1, 16: 6.0}, 5.0) == 16
    assert first_over({1: 0.1, 16: None}, 5.0) is None


def test_summarize_counts_errors_apart_from_timings():
    samples = [
        Sample(start=0, ttft=0.001, total=0.002, gaps=[0.0005], status=200),
        Sample(start=0, ttft=0.003, total=0.004, gaps=[], status=200),
        Sample(start=0, status=502, error="HTTP 502"),
    ]
    s = summarize(samples, span=2.0)
    assert (s["requests"], s["ok"], s["rps"]) == (3, 2, 1.0)
    assert s["errors"] == {"HTTP 502": 1}
    assert s["ttft_ms"]["p50"] == pytest.approx(1.0)
    assert s["total_ms"]["p99"] == pytest.approx(4.0)
    assert s["gap_ms"]["max"] == pytest.approx(0.5)


def test_target_refuses_other_schemes():
    with pytest.raises(ValueError, match="url"):
        Target.from_url("https://127.0.0.1/x", b"{}")


# --- the client against a tiny in-process SSE server ----------------------------------

EVENTS = [b'data: {"choices":[{"delta":{"content":"w%d"}}]}\n\n' % i for i in range(3)]


ERROR_EVENTS = [EVENTS[0], b'data: {"error":{"message":"m","type":"timeout","code":"stage_deadline_exceeded"}}\n\n', b"data: [DONE]\n\n"]


async def sse_server(
    stream: trio.SocketStream, pace: float = 0.002, status: int = 200, events: list[bytes] = EVENTS
) -> None:
    """Answer every request on the connection with three paced SSE events."""
    conn = h11.Connection(h11.SERVER)
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(65536)
            if not data:
                return
            conn.receive_data(data)
            continue
        if isinstance(event, h11.ConnectionClosed):
            return
        if isinstance(event, h11.EndOfMessage):
            head = h11.Response(status_code=status, headers=[("content-type", "text/event-stream"), ("transfer-encoding", "chunked")])
            await stream.send_all(conn.send(head))
            for ev in events:
                await trio.sleep(pace)
                await stream.send_all(conn.send(h11.Data(data=ev)))
            await stream.send_all(conn.send(h11.EndOfMessage()))
            conn.start_next_cycle()


async def serve(nursery: trio.Nursery, **kw: Any) -> int:
    async def handler(stream: trio.SocketStream) -> None:
        await sse_server(stream, **kw)

    listeners = await nursery.start(trio.serve_tcp, handler, 0)
    return int(listeners[0].socket.getsockname()[1])


@pytest.mark.slow
async def test_closed_loop_measures_ttft_gaps_and_total():
    async with trio.open_nursery() as nursery:
        port = await serve(nursery, pace=0.005)
        target = Target.from_url(f"http://127.0.0.1:{port}/v1/chat/completions", b"{}")
        samples, span = await closed_loop(target, concurrency=2, duration=0.3, warmup=0.05)
        nursery.cancel_scope.cancel()
    assert samples
    assert span >= 0.3
    for s in samples:
        assert s.error is None
        assert s.status == 200
        assert s.ttft is not None
        assert s.ttft >= 0.004
        assert s.total is not None
        assert s.total >= 3 * 0.004
        assert len(s.gaps) == 2
        assert min(s.gaps) >= 0.003


@pytest.mark.slow
async def test_open_loop_times_from_the_schedule_and_reports_http_errors():
    async with trio.open_nursery() as nursery:
        port = await serve(nursery, pace=0.0, status=503)
        target = Target.from_url(f"http://127.0.0.1:{port}/x", b"{}")
        samples, _ = await open_loop(target, rate=50.0, duration=0.2)
        nursery.cancel_scope.cancel()
    assert len(samples) == 10
    assert [s.start for s in samples] == pytest.approx([i / 50.0 for i in range(10)])
    assert {s.error for s in samples} == {"HTTP 503"}


@pytest.mark.slow
async def test_a_stream_that_ends_in_an_error_event_is_an_error_not_a_success():
    async with trio.open_nursery() as nursery:
        port = await serve(nursery, pace=0.0, events=ERROR_EVENTS)
        target = Target.from_url(f"http://127.0.0.1:{port}/x", b"{}")
        samples, _ = await closed_loop(target, concurrency=1, duration=0.1, warmup=0.0)
        nursery.cancel_scope.cancel()
    assert samples
    assert {s.error for s in samples} == {"error event in the stream"}
    assert summarize(samples, 0.1)["ok"] == 0
