"""The per-request pipeline on Trio's virtual clock: streaming, budgets, expiry, disconnects."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing

from aiserve_trio.adapters.base import Adapter, Delta, DeltaSink, InferenceRequest
from aiserve_trio.adapters.mock import MockAdapter
from aiserve_trio.adapters.retry import Progress
from aiserve_trio.config import MockAdapterConfig
from aiserve_trio.core.errors import UpstreamProtocolError
from aiserve_trio.runtime.asgi import App
from aiserve_trio.sessions.bus import Session, SessionBus

from .asgi_client import Client, chat_body
from .conftest import make_config
from .fakes import RecordingAdapter, SlowBus

WORDS_100 = " ".join(f"w{i}" for i in range(100))  # 10 ms + 99 x 5 ms = 505 ms to stream


def recording_app(
    extra: str = "", bus: SessionBus | None = None, **mock: str
) -> tuple[App, RecordingAdapter]:
    cfg = make_config(extra, **mock)
    mock_cfg = cfg.adapters["mock"]
    assert isinstance(mock_cfg, MockAdapterConfig)
    rec = RecordingAdapter(MockAdapter("mock", mock_cfg))
    return App(cfg, adapters={"mock": rec}, bus=bus), rec


def error_of(event: str) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(event)["error"]
    return error


# --- the happy paths ------------------------------------------------------------


async def test_stream_is_openai_chunks_ending_in_done(client, autojump_clock):
    r = await client.chat(chat_body("echo: one  two\nthree", stream=True))
    assert r.status == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-request-id"].startswith("chatcmpl-")
    events = r.events()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert {c["id"] for c in chunks} == {r.headers["x-request-id"]}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "stop"}
    assert r.text() == "one  two\nthree"  # echo is verbatim, word by word
    assert len(chunks) == 1 + 3 + 1
    assert r.event_ids() == [str(i) for i in range(len(chunks))]


async def test_include_usage_adds_a_usage_chunk(client, autojump_clock):
    r = await client.chat(
        chat_body("echo: a b c", stream=True, stream_options={"include_usage": True})
    )
    last = json.loads(r.events()[-2])
    assert last["choices"] == []
    assert last["usage"]["completion_tokens"] == 3
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 3


async def test_non_streaming_is_one_chat_completion(client, autojump_clock):
    r = await client.chat(chat_body("echo: a b c"))
    assert r.status == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "a b c"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 3
    assert r.headers["content-length"] == str(len(r.body))


async def test_max_tokens_stops_with_length(client, autojump_clock):
    r = await client.chat(chat_body("echo: a b c d e", max_tokens=2))
    assert r.json()["choices"][0]["message"]["content"] == "a b"
    assert r.json()["choices"][0]["finish_reason"] == "length"


async def test_mock_rules_answer_about_the_gateway(client, autojump_clock):
    r = await client.chat(chat_body("what are you?"))
    assert "aiserve-trio" in r.json()["choices"][0]["message"]["content"]
    r = await client.chat(chat_body("something unmatched"))
    assert "echo:" in r.json()["choices"][0]["message"]["content"]


async def test_mock_paces_tokens_as_configured(autojump_clock):
    app, _ = recording_app(ttft_ms="100", inter_token_ms="30")
    t0 = trio.current_time()
    r = await Client(app).chat(chat_body("echo: a b c", stream=True))
    times = [t - t0 for t, _ in r.chunks]
    # head, then the role chunk with "a" in one write at the first token,
    # then one word every 30 ms
    assert times[0] == pytest.approx(0.100)
    assert b'"role":"assistant"' in r.chunks[0][1]
    assert b'"content":"a' in r.chunks[0][1]
    assert times[1] == pytest.approx(0.130)
    assert times[2] == pytest.approx(0.160)


async def test_stages_run_concurrently_with_small_buffers(autojump_clock):
    # A slow reader holds the upstream back instead of letting deltas pile up.
    app, rec = recording_app()
    body = chat_body("echo: " + WORDS_100, stream=True)
    async with Client(app).open(
        "POST", "/v1/chat/completions", json_body=body, send_delay=0.1
    ) as ex:
        await ex.wait_for_bytes(3)
        await trio.sleep(0.5)
        body_so_far = ex.response.body
        delivered = body_so_far.count(b'"content":"') - body_so_far.count(b'"content":""')
        produced = rec.produced
        ex.disconnect()
    assert rec.cancelled_at is not None
    # The mock has all 100 words ready within 0.5 s, but only what the client
    # took, plus the delta channel's one-item buffer and the delta in the sse
    # stage's hand, has left the adapter.
    assert delivered <= produced <= delivered + 2
    assert produced < 30


# --- deadlines and stage budgets -----------------------------------------------


async def test_reply_longer_than_the_timeout_ends_with_an_inference_error_event(autojump_clock):
    app, rec = recording_app()
    t0 = trio.current_time()
    # T = 300 - 100 (reserve) = 200 ms: context by 80 ms, inference by 150 ms.
    r = await Client(app).chat(
        chat_body("echo: " + WORDS_100, stream=True), headers={"X-Request-Timeout-Ms": "300"}
    )
    assert r.status == 200
    events = r.events()
    assert events[-1] == "[DONE]"
    err = error_of(events[-2])
    assert err == {
        "message": "the inference stage did not finish within its deadline budget",
        "type": "timeout",
        "param": "inference",
        "code": "stage_deadline_exceeded",
    }
    assert r.chunks[-1][0] - t0 == pytest.approx(0.150)
    assert rec.cancelled_at == pytest.approx(t0 + 0.150)
    assert 'finish_reason": "stop' not in r.body.decode()
    # what was delivered before the cut is there, in order
    assert r.text().startswith("w0 w1 w2")


async def test_inference_expiry_before_the_first_byte_is_a_504(autojump_clock):
    app, _ = recording_app(ttft_ms="500")
    t0 = trio.current_time()
    r = await Client(app).chat(
        chat_body("hi", stream=True), headers={"X-Request-Timeout-Ms": "300"}
    )
    assert r.status == 504
    assert r.json()["error"]["param"] == "inference"
    assert r.json()["error"]["code"] == "stage_deadline_exceeded"
    assert r.chunks[-1][0] - t0 == pytest.approx(0.150)


async def test_unused_context_time_rolls_over_to_inference(autojump_clock):
    # T = 1 s. The reply streams for 505 ms, more than the inference share
    # (350 ms) but within its cut point (750 ms): the fast context stage's
    # unused time was inherited.
    app, _ = recording_app()
    r = await Client(app).chat(
        chat_body("echo: " + WORDS_100, stream=True), headers={"X-Request-Timeout-Ms": "1100"}
    )
    assert r.events()[-2].find('"finish_reason":"stop"') > 0
    assert r.text() == WORDS_100


async def test_slow_context_leaves_inference_only_up_to_its_cut_point(autojump_clock):
    # The same reply after a 300 ms session load no longer fits: the cut
    # point (750 ms) is absolute.
    app, _ = recording_app(bus=SlowBus(0.3))
    t0 = trio.current_time()
    r = await Client(app).chat(
        chat_body("echo: " + WORDS_100, stream=True),
        headers={"X-Request-Timeout-Ms": "1100", "X-Session-Id": "s1"},
    )
    assert error_of(r.events()[-2])["param"] == "inference"
    assert r.chunks[-1][0] - t0 == pytest.approx(0.750)


class KeepsItsBudget(Adapter):
    """A backend that keeps the budget it was sent: a token, then it breaks off at the
    deadline -- and the gateway's loop, busy, sees the break before its own cut.

    ``early`` breaks off that much before the deadline instead: a real drop.
    """

    def __init__(self, clock: trio.testing.MockClock, early: float = 0.0) -> None:
        super().__init__("mock", ["aiserve-mock"])
        self.clock = clock
        self.early = early

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        await send.send(Delta(text="a"))
        await trio.sleep_until(request.deadline - max(self.early, 0.001))
        if not self.early:
            self.clock.jump(0.002)  # past the cut, with no checkpoint since
        raise UpstreamProtocolError("mock: the server closed the connection before the end")


@pytest.mark.parametrize("early", [0.0, 0.05])
async def test_a_backend_breaking_off_as_the_cut_passes_ends_as_the_deadline(
    autojump_clock, early
):
    # The backend is told the time left (x-request-timeout-ms) and stops when it is
    # gone. Whether the gateway's cut or the backend's end reaches the stage first, the
    # client is told the deadline ran out -- and a drop before the cut stays a drop.
    app = App(make_config(), adapters={"mock": KeepsItsBudget(autojump_clock, early)})
    t0 = trio.current_time()
    r = await Client(app).chat(
        chat_body("hi", stream=True), headers={"X-Request-Timeout-Ms": "1100"}
    )
    err = error_of(r.events()[-2])
    assert r.text() == "a"
    if early:
        assert err["code"] == "upstream_protocol_error"
        assert r.chunks[-1][0] - t0 == pytest.approx(0.750 - early)
    else:
        assert (err["type"], err["code"], err["param"]) == (
            "timeout",
            "stage_deadline_exceeded",
            "inference",
        )
        assert r.chunks[-1][0] - t0 == pytest.approx(0.751)
        text = app.metrics.render().decode()
        assert 'aiserve_stage_deadline_expiries_total{stage="inference"} 1.0' in text


async def test_context_expiry_fails_with_504_naming_the_stage(autojump_clock):
    app, rec = recording_app(bus=SlowBus(5.0))
    t0 = trio.current_time()
    r = await Client(app).chat(
        chat_body("hi", stream=True),
        headers={"X-Request-Timeout-Ms": "1100", "X-Session-Id": "s1"},
    )
    assert r.status == 504
    assert r.json()["error"]["param"] == "context"
    assert r.chunks[-1][0] - t0 == pytest.approx(0.400)
    assert rec.calls == 0


DEGRADE_ROUTE = """
[[routes]]
path = "/v1/degrade"
adapter = "mock"
default_model = "aiserve-mock"
on_context_timeout = "degrade"
"""


async def test_context_expiry_on_a_degrade_route_serves_without_context(autojump_clock):
    bus = SlowBus(5.0, Session(variables={"monthly_income": "9000"}))
    app, rec = recording_app(DEGRADE_ROUTE, bus=bus)
    t0 = trio.current_time()
    r = await Client(app).request(
        "POST",
        "/v1/degrade",
        json_body=chat_body("mortgage?", stream=True),
        headers={"X-Request-Timeout-Ms": "1100", "X-Session-Id": "s1"},
    )
    assert r.status == 200
    assert r.headers["x-aiserve-degraded"] == "context"
    assert r.events()[-1] == "[DONE]"
    assert "(not given yet)" in r.text()  # the session's variables were not used
    assert rec.requests[0].variables == {}
    # it went on at the context cut point, not later
    assert r.chunks[0][0] - t0 == pytest.approx(0.400 + 0.010)


async def test_session_context_reaches_the_model_when_in_time(autojump_clock):
    bus = SlowBus(0.01, Session(variables={"monthly_income": "9000", "loan_term": "20 years"}))
    app, rec = recording_app(bus=bus)
    r = await Client(app).chat(chat_body("mortgage?"), headers={"X-Session-Id": "s1"})
    assert "9000" in r.json()["choices"][0]["message"]["content"]
    assert "x-aiserve-degraded" not in r.headers
    system = rec.requests[0].messages[0]
    assert system.role == "system"
    assert "monthly_income: 9000" in system.text()


async def test_slow_body_expires_in_the_parse_stage(autojump_clock):
    app, rec = recording_app()
    body = json.dumps(chat_body("hi")).encode()
    t0 = trio.current_time()
    r = await Client(app).request(
        "POST",
        "/v1/chat/completions",
        body=[body[:10], body[10:]],
        headers={"content-type": "application/json", "X-Request-Timeout-Ms": "1100"},
        body_delay=10.0,
    )
    assert r.status == 504
    assert r.json()["error"]["param"] == "parse"
    assert r.chunks[-1][0] - t0 == pytest.approx(0.400)
    assert rec.calls == 0


async def test_too_little_time_for_inference_fails_fast_without_calling_upstream(autojump_clock):
    app, rec = recording_app()
    t0 = trio.current_time()
    # T = 60 ms: the inference cut is at 45 ms, less than min_inference_ms (50 ms).
    r = await Client(app).chat(chat_body("hi"), headers={"X-Request-Timeout-Ms": "160"})
    assert r.status == 504
    err = r.json()["error"]
    assert err["param"] == "inference"
    assert "less than the 50 ms" in err["message"]
    assert rec.calls == 0
    assert r.chunks[-1][0] - t0 == pytest.approx(0.0)


async def test_a_client_that_stops_reading_is_cut_at_the_deadline(autojump_clock):
    app, _ = recording_app()
    t0 = trio.current_time()
    async with Client(app).open(
        "POST",
        "/v1/chat/completions",
        json_body=chat_body("echo: a b", stream=True),
        headers={"X-Request-Timeout-Ms": "300"},
        stall_after=1,  # takes the role chunk with "a", then never reads "b"
    ) as ex:
        await ex.done.wait()
        ended = trio.current_time() - t0
    # sse cut at 200 ms. If the stalled write held "b" alone, the final error
    # event gets the 100 ms reserve, then the gateway gives up; if "b" came with
    # the finish, that stalled write was the last one and nothing follows it.
    assert ended in (pytest.approx(0.200), pytest.approx(0.300))
    text = app.metrics.render().decode()
    assert 'aiserve_stage_deadline_expiries_total{stage="sse"} 1.0' in text


# --- disconnects --------------------------------------------------------------


async def test_disconnect_mid_stream_cancels_the_inference_task_at_once(autojump_clock):
    app, rec = recording_app(inter_token_ms="50")
    async with Client(app).open(
        "POST", "/v1/chat/completions", json_body=chat_body("echo: " + WORDS_100, stream=True)
    ) as ex:
        await ex.wait_for_bytes(4)
        gone_at = trio.current_time()
        ex.disconnect()
        await ex.done.wait()
        assert trio.current_time() == pytest.approx(gone_at)
    assert rec.cancelled_at == pytest.approx(gone_at)
    assert not rec.finished
    text = app.metrics.render().decode()
    for stage in ("parse", "context", "inference", "sse"):
        assert f'task_count_by_stage{{stage="{stage}"}} 0.0' in text
    assert 'aiserve_client_disconnects_total{stage="sse"} 1.0' in text
    assert 'status="client_closed"' in text


async def test_disconnect_while_waiting_for_the_first_token(autojump_clock):
    app, rec = recording_app(ttft_ms="5000")
    async with Client(app).open(
        "POST", "/v1/chat/completions", json_body=chat_body("hi", stream=True)
    ) as ex:
        await trio.sleep(1.0)
        gone_at = trio.current_time()
        ex.disconnect()
        await ex.done.wait()
    assert rec.cancelled_at == pytest.approx(gone_at)
    assert ex.response.status == 0  # nothing was sent to a client that left


# --- the other endpoints and metrics -------------------------------------------


async def test_models_health_ready_and_metrics(app, client, autojump_clock):
    r = await client.request("GET", "/v1/models")
    assert r.json()["object"] == "list"
    assert [m["id"] for m in r.json()["data"]] == ["aiserve-mock"]
    assert (await client.request("GET", "/healthz")).status == 200
    not_ready = await client.request("GET", "/readyz")
    assert not_ready.status == 503
    assert not_ready.json()["error"]["code"] == "not_ready"
    async with trio.open_nursery() as nursery:
        await app.startup(nursery)
        assert (await client.request("GET", "/readyz")).status == 200
        await client.chat(chat_body("echo: a", stream=True))
        m = await client.request("GET", "/metrics")
        text = m.body.decode()
        assert m.headers["content-type"].startswith("text/plain")
        buckets = [
            line
            for line in text.splitlines()
            if line.startswith("pipeline_stage_latency_seconds_bucket{le=") and 'stage="sse"' in line
        ]
        assert len(buckets) == 17  # 16 exponential buckets from 1 ms, and +Inf
        assert 'le="0.001"' in buckets[0]
        assert 'le="32.768"' in buckets[15]
        assert (
            'aiserve_requests_total{channel="api",model="aiserve_mock",route="chat",status="ok"} 1.0'
            in text
        )
        assert "aiserve_time_to_first_token_seconds_count" in text
        await app.shutdown()
        nursery.cancel_scope.cancel()


async def test_channel_label_comes_from_the_header(client, app, autojump_clock):
    await client.chat(chat_body("echo: a"), headers={"X-Channel": "wechat"})
    assert 'channel="wechat"' in app.metrics.render().decode()


def expiries(app: App) -> dict[str, float]:
    counts: dict[str, float] = {}
    for line in app.metrics.render().decode().splitlines():
        if line.startswith("aiserve_stage_deadline_expiries_total{"):
            stage = line.split('stage="', 1)[1].split('"', 1)[0]
            counts[stage] = float(line.rsplit(" ", 1)[1])
    return counts


async def test_every_deadline_answer_is_counted_under_its_stage(autojump_clock):
    # Each kind of stage_deadline_exceeded answer once: a context expiry, the refusal
    # to start an upstream call with too little left, an inference expiry mid-stream,
    # and a slow body expiring in parse. Each is one count, under the stage it names.
    app, _ = recording_app(bus=SlowBus(5.0))
    client = Client(app)
    answers = []
    r = await client.chat(chat_body("hi"), headers={"X-Request-Timeout-Ms": "1100", "X-Session-Id": "s1"})
    answers.append(r.json()["error"])
    r = await client.chat(chat_body("hi"), headers={"X-Request-Timeout-Ms": "160"})
    answers.append(r.json()["error"])
    slow, _ = recording_app()
    r = await Client(slow).chat(chat_body("echo: " + WORDS_100, stream=True), headers={"X-Request-Timeout-Ms": "300"})
    answers.append(error_of(r.events()[-2]))
    body = json.dumps(chat_body("hi")).encode()
    r = await Client(slow).request(
        "POST",
        "/v1/chat/completions",
        body=[body[:10], body[10:]],
        headers={"content-type": "application/json", "X-Request-Timeout-Ms": "1100"},
        body_delay=10.0,
    )
    answers.append(r.json()["error"])
    assert [a["code"] for a in answers] == ["stage_deadline_exceeded"] * 4
    assert [a["param"] for a in answers] == ["context", "inference", "inference", "parse"]
    assert expiries(app) == {"context": 1.0, "inference": 1.0}
    assert expiries(slow) == {"inference": 1.0, "parse": 1.0}
