"""aiserve-sim: the timing model and faults (pure), and the app on the virtual clock."""

from __future__ import annotations

import json
import random

import pytest
import trio
import trio.testing

from aiserve_trio.sim import SimApp, SimSettings, Timing, parse_fault, plan_reply
from aiserve_trio.sim.cli import build_parser, settings_from_args
from aiserve_trio.sim.model import Fault, FaultRates, FaultSpecError, choose_fault, token_text

from .asgi_client import Client

# --- the timing model ------------------------------------------------------------


def test_ttft_is_overhead_plus_prefill_per_prompt_token() -> None:
    t = Timing(prefill_overhead_ms=20, prefill_per_token_ms=0.5, itl_ms=10)
    plan = plan_reply(t, prompt_tokens=100, max_tokens=5, rng=random.Random(0))
    assert plan.ttft == pytest.approx(0.070)
    assert plan.gaps == pytest.approx([0.010] * 4)
    assert plan.tokens == 5
    assert plan.finish_reason == "length"
    assert plan.total == pytest.approx(0.110)


def test_length_is_drawn_when_max_tokens_is_absent() -> None:
    t = Timing(output_tokens_mean=12, output_tokens_std=0)
    plan = plan_reply(t, 0, None, random.Random(0))
    assert (plan.tokens, plan.finish_reason) == (12, "stop")


def test_noise_is_seeded_and_never_negative() -> None:
    t = Timing(prefill_overhead_ms=1, ttft_std_ms=50, itl_ms=1, itl_std_ms=50)
    a = plan_reply(t, 10, 50, random.Random(3))
    b = plan_reply(t, 10, 50, random.Random(3))
    assert a == b
    assert a.ttft >= 0
    assert min(a.gaps) >= 0
    assert len(set(a.gaps)) > 1  # the noise is there


@pytest.mark.parametrize(
    ("spec", "fault"),
    [
        ("429", Fault("status", status=429, retry_after=1.0)),
        ("429:2.5", Fault("status", status=429, retry_after=2.5)),
        ("503", Fault("status", status=503)),
        ("stall:4", Fault("stall", after=4)),
        ("drop:0", Fault("drop", after=0)),
        ("MALFORMED:2", Fault("malformed", after=2)),
    ],
)
def test_parse_fault(spec: str, fault: Fault) -> None:
    assert parse_fault(spec) == fault


@pytest.mark.parametrize("spec", ["404", "200", "stall:x", "drop:-1", "explode", "429:soon"])
def test_parse_fault_refuses(spec: str) -> None:
    with pytest.raises(FaultSpecError):
        parse_fault(spec)


def test_fault_times_limits_attempts_and_header_beats_config() -> None:
    s = SimSettings(fault=Fault("status", status=500))
    rng = random.Random(0)
    assert choose_fault(s, "503", 2, 1, rng) == Fault("status", status=503)
    assert choose_fault(s, "503", 2, 2, rng) == Fault("status", status=503)
    assert choose_fault(s, "503", 2, 3, rng) is None
    assert choose_fault(s, None, None, 1, rng) == Fault("status", status=500)


def test_fault_rates_draw_in_proportion() -> None:
    rates = FaultRates(rate_429=0.2, rate_drop=0.1)
    rng = random.Random(1)
    kinds = [f.kind if f else "none" for f in (rates.draw(rng) for _ in range(5000))]
    assert 0.17 < kinds.count("status") / 5000 < 0.23
    assert 0.08 < kinds.count("drop") / 5000 < 0.12


def test_cli_flags_become_settings() -> None:
    ns = build_parser().parse_args(["--itl-ms", "3", "--fault", "drop:2", "--rate-429", "0.5"])
    s = settings_from_args(ns)
    assert s.timing.itl_ms == 3
    assert s.fault == Fault("drop", after=2)
    assert s.rates.rate_429 == 0.5
    assert ns.bind == "127.0.0.1:8100"


# --- the app, in-process on the virtual clock --------------------------------------


def body(**extra: object) -> dict[str, object]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], **extra}


def sim(**timing: float) -> SimApp:
    t = Timing(prefill_overhead_ms=100, prefill_per_token_ms=0, itl_ms=10, **timing)
    return SimApp(SimSettings(timing=t, seed=1))


async def test_streams_on_schedule(autojump_clock: trio.testing.MockClock) -> None:
    app = sim()
    t0 = trio.current_time()
    r = await Client(app).chat(
        body(stream=True, max_tokens=4, stream_options={"include_usage": True})
    )
    assert r.status == 200
    assert r.headers["content-type"] == "text/event-stream"
    events = r.events()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == (
        "".join(token_text(i) for i in range(4))
    )
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    times = [t - t0 for t, _ in r.chunks]
    assert times[0] == pytest.approx(0.100)  # TTFT
    assert times[3] == pytest.approx(0.130)  # 3 inter-token gaps later
    assert app.stats.completed == 1
    assert app.stats.open_streams == 0


async def test_json_reply_with_usage(autojump_clock: trio.testing.MockClock) -> None:
    t0 = trio.current_time()
    r = await Client(sim()).chat(body(max_tokens=3))
    assert trio.current_time() - t0 == pytest.approx(0.120)
    obj = r.json()
    assert obj["choices"][0]["message"]["content"] == "the quick brown"
    assert obj["usage"]["completion_tokens"] == 3
    assert obj["usage"]["prompt_tokens"] > 0


async def test_429_header_with_retry_after(autojump_clock: trio.testing.MockClock) -> None:
    app = sim()
    r = await Client(app).chat(body(), headers={"x-sim-fault": "429:3"})
    assert r.status == 429
    assert r.headers["retry-after"] == "3"
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert app.stats.faults == {"429": 1}


async def test_fault_times_counts_attempts_by_request_id(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = sim()
    hdrs = {"x-sim-fault": "503", "x-sim-fault-times": "2", "x-request-id": "r1"}
    statuses = [(await Client(app).chat(body(max_tokens=1), headers=hdrs)).status for _ in range(3)]
    assert statuses == [503, 503, 200]
    assert app._attempts["r1"] == 3


async def test_malformed_chunk_then_the_rest(autojump_clock: trio.testing.MockClock) -> None:
    r = await Client(sim()).chat(
        body(stream=True, max_tokens=3), headers={"x-sim-fault": "malformed:1"}
    )
    events = r.events()
    with pytest.raises(json.JSONDecodeError):
        json.loads(events[1])
    assert events[-1] == "[DONE]"


async def test_drop_leaves_the_body_unfinished(autojump_clock: trio.testing.MockClock) -> None:
    r = await Client(sim()).chat(body(stream=True, max_tokens=9), headers={"x-sim-fault": "drop:2"})
    assert not r.complete
    assert len(r.events()) == 2


async def test_stall_holds_until_the_client_leaves(autojump_clock: trio.testing.MockClock) -> None:
    app = sim()
    client = Client(app)
    async with client.open(
        "POST",
        "/v1/chat/completions",
        json_body=body(stream=True, max_tokens=9),
        headers={"x-sim-fault": "stall:2"},
    ) as ex:
        await ex.wait_for_bytes(2)
        await trio.sleep(60)  # virtual: nothing more comes
        assert len(ex.response.chunks) == 2
        assert app.stats.open_streams == 1
        ex.disconnect()
        await ex.done.wait()
    assert app.stats.cancelled == 1
    assert app.stats.open_streams == 0
    assert app.stats.completed == 0


async def test_upstream_budget_header_bounds_the_reply(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = sim()
    t0 = trio.current_time()
    r = await Client(app).chat(
        body(stream=True, max_tokens=100), headers={"x-request-timeout-ms": "250"}
    )
    assert trio.current_time() - t0 == pytest.approx(0.250)
    assert "[DONE]" not in r.events()
    assert app.stats.expired == 1
    assert app.stats.last_timeout_ms == 250


async def test_stats_and_reset(autojump_clock: trio.testing.MockClock) -> None:
    app = sim()
    client = Client(app)
    await client.chat(body(max_tokens=1))
    stats = (await client.request("GET", "/sim/stats")).json()
    assert stats["requests"] == 1
    assert stats["completed"] == 1
    assert (await client.request("POST", "/sim/reset")).status == 200
    assert (await client.request("GET", "/sim/stats")).json()["requests"] == 0


async def test_bad_json_is_400(autojump_clock: trio.testing.MockClock) -> None:
    r = await Client(sim()).request("POST", "/v1/chat/completions", body=b"{nope")
    assert r.status == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
