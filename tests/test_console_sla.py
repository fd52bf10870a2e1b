"""The console's SLA and stage tables, from a real metrics registry, without sockets."""

from __future__ import annotations

import math

import pytest

from aiserve_trio.console import sla
from aiserve_trio.core.budgets import STAGES
from aiserve_trio.observability.metrics import STAGE_BUCKETS, Metrics


def snapshot(m: Metrics, at: float) -> sla.Snapshot:
    metrics = (m.request_duration, m.model_ttft, m.requests, m.model_tokens, m.stage_latency, m.task_count)
    return sla.read((f for metric in metrics for f in metric.collect()), at)


def finished(m: Metrics, route: str, model: str, seconds: float, *, status: str = "ok",
             prompt: int = 0, completion: int = 0, ttft: float | None = None) -> None:
    """What the observer records for one finished request."""
    m.requests.labels(route, model, "api", status).inc()
    if status == "ok":
        m.request_duration.labels(route, model).observe(seconds)
    if ttft is not None:
        m.model_ttft.labels(route, model).observe(ttft)
    m.model_tokens.labels(route, model, "prompt").inc(prompt)
    m.model_tokens.labels(route, model, "completion").inc(completion)


def buckets(counts: list[float], bounds: tuple[float, ...] = (0.1, 0.2, 0.4, math.inf)) -> sla.Buckets:
    return sla.Buckets(bounds, tuple(counts))


@pytest.mark.parametrize(
    ("q", "counts", "want"),
    [
        (0.5, [0, 10, 10, 10], 0.15),  # all in (0.1, 0.2]: the middle of it
        (0.95, [0, 10, 10, 10], 0.195),
        (0.5, [10, 10, 10, 10], 0.05),  # the first bucket starts at 0
        (0.9, [5, 5, 10, 10], 0.36),  # rank 9 of the 5 in (0.2, 0.4]
        (0.99, [0, 0, 0, 4], 0.4),  # beyond the last finite bound: that bound
        (0.95, [90, 95, 99, 100], 0.2),  # exactly at a bucket's top
    ],
)
def test_quantiles_interpolate_inside_the_bucket_like_prometheus(q: float, counts: list[float], want: float) -> None:
    got = sla.quantile(q, buckets(counts))
    assert got == pytest.approx(want)


def test_no_samples_no_quantile() -> None:
    assert sla.quantile(0.95, buckets([0, 0, 0, 0])) is None


def test_p95_of_real_observations_lands_in_their_bucket() -> None:
    m = Metrics()
    for _ in range(95):
        finished(m, "chat", "fast", 0.003)  # (2 ms, 4 ms]
    for _ in range(5):
        finished(m, "chat", "fast", 3.0)  # (2.048 s, 4.096 s]
    row = sla.overview(snapshot(m, 0.0), None, STAGES).models[0]
    assert row.p95_s is not None
    assert 0.002 < row.p95_s <= 0.004  # the 5 slow ones are above P95
    for _ in range(10):
        finished(m, "chat", "fast", 3.0)
    row = sla.overview(snapshot(m, 0.0), None, STAGES).models[0]
    assert row.p95_s is not None
    assert 2.048 < row.p95_s <= 4.096


def test_the_model_rows_error_rate_and_tokens_per_request() -> None:
    m = Metrics()
    for _ in range(6):
        finished(m, "chat", "gpt_4o", 0.1, prompt=10, completion=30, ttft=0.02)
    finished(m, "chat", "gpt_4o", 0.1, status="gateway_timeout")  # 504: counts
    finished(m, "chat", "gpt_4o", 0.1, status="bad_gateway")  # 502: counts
    finished(m, "chat", "gpt_4o", 0.1, status="bad_request")  # the client's mistake
    finished(m, "chat", "gpt_4o", 0.1, status="client_closed")  # the client left
    finished(m, "rag", "llama", 0.5, prompt=100, completion=0)
    table = sla.overview(snapshot(m, 0.0), None, STAGES)
    rows = {(r.route, r.model): r for r in table.models}
    chat = rows[("chat", "gpt_4o")]
    assert chat.requests == 10
    assert chat.errors == 2
    assert chat.error_rate == pytest.approx(0.2)
    assert chat.tokens_per_request == pytest.approx(240 / 10)
    assert chat.prompt_tokens_per_request == pytest.approx(6.0)
    assert chat.completion_tokens_per_request == pytest.approx(18.0)
    assert chat.ttft_p95_s is not None
    assert 0.016 < chat.ttft_p95_s <= 0.032
    assert chat.rps is None  # totals since start have no rate
    rag = rows[("rag", "llama")]
    assert (rag.requests, rag.errors, rag.error_rate) == (1, 0, 0.0)
    assert rag.ttft_p95_s is None


@pytest.mark.parametrize(
    ("status", "server_error"),
    [("ok", False), ("client_closed", False), ("bad_request", False), ("too_many_requests", False),
     ("internal_server_error", True), ("gateway_timeout", True), ("service_unavailable", True),
     ("status_599", True), ("status_499", False), ("not_a_status", False)],
)
def test_server_errors_are_5xx_labels(status: str, server_error: bool) -> None:
    assert sla.is_server_error(status) is server_error


def test_stage_p99_and_live_tasks() -> None:
    m = Metrics()
    for _ in range(99):
        m.stage_latency.labels("inference").observe(0.05)
    m.stage_latency.labels("inference").observe(10.0)
    m.stage_latency.labels("parse").observe(0.0005)
    m.task_count.labels("sse").inc(3)
    table = sla.overview(snapshot(m, 0.0), None, STAGES)
    stages = {s.stage: s for s in table.stages}
    assert [s.stage for s in table.stages] == list(STAGES)
    p99 = stages["inference"].p99_s
    assert p99 is not None
    assert 0.032 < p99 <= 0.064
    assert stages["inference"].runs == 100
    assert stages["parse"].p99_s is not None
    assert stages["parse"].p99_s <= 0.001
    assert stages["context"].p99_s is None
    assert stages["sse"].live == 3


def test_a_window_counts_only_what_finished_in_it() -> None:
    m = Metrics()
    for _ in range(50):
        finished(m, "chat", "m", 5.0, status="gateway_timeout")
        finished(m, "chat", "m", 5.0)  # slow, but before the window
    m.stage_latency.labels("sse").observe(5.0)
    old = snapshot(m, 100.0)
    m.stage_latency.labels("sse").observe(0.001)
    for _ in range(20):
        finished(m, "chat", "m", 0.01, prompt=1, completion=4)
    new = snapshot(m, 160.0)
    row = sla.overview(sla.since(new, old), 60.0, STAGES).models[0]
    assert row.requests == 20
    assert row.errors == 0  # the 50 timeouts were before the window
    assert row.rps == pytest.approx(20 / 60)
    assert row.tokens_per_request == pytest.approx(5.0)
    assert row.p95_s is not None
    assert row.p95_s <= 0.016
    sse = sla.overview(sla.since(new, old), 60.0, STAGES).stages[-1]
    assert (sse.stage, sse.runs) == ("sse", 1)
    assert sse.p99_s is not None
    assert sse.p99_s <= 0.001
    total = sla.overview(new, None, STAGES).models[0]
    assert (total.requests, total.errors) == (120, 50)
    assert sla.overview(sla.since(new, new), 0.0, STAGES).models == []  # none in it: no row


def test_a_row_that_appeared_inside_the_window() -> None:
    m = Metrics()
    old = snapshot(m, 0.0)
    finished(m, "chat", "new", 0.2)
    row = sla.overview(sla.since(snapshot(m, 30.0), old), 30.0, STAGES).models[0]
    assert (row.model, row.requests) == ("new", 1)


def test_the_window_keeps_one_snapshot_per_step_and_starts_about_its_length_back() -> None:
    w = sla.Window(60.0, step=1.0)
    first = sla.Snapshot(at=0.0)
    assert w.add(first) is first  # the first poll: an empty window
    starts = [w.add(sla.Snapshot(at=t / 10)).at for t in range(1, 1000)]  # 10 polls a second
    assert starts[-1] == pytest.approx(39.0)  # now 99.9: the newest kept at least 60 s back
    assert len(w) <= 62  # not 1,000
    assert w.add(sla.Snapshot(at=200.0)).at == pytest.approx(99.0)  # after a pause: the last kept


def test_buckets_follow_the_registry() -> None:
    m = Metrics()
    finished(m, "chat", "m", 0.003)
    snap = snapshot(m, 0.0)
    h = snap.duration[("chat", "m")]
    assert h.bounds == (*STAGE_BUCKETS, math.inf)
    assert h.count == 1
