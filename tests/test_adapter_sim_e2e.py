"""The gateway against a real aiserve-sim process, over both upstream protocols.

Real sockets and real time (so kept short): the sim runs with 2 ms per token.
Each injected fault must give the client-visible result the docs promise:
retries before the first token (counted by the sim per request id), never
after it; a broken stream ends in an error event, never a clean finish.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import trio

from aiserve_trio.adapters.openai import OpenAIAdapter
from aiserve_trio.sim.model import token_text

from .sim_gateway import (
    PATH,
    chat,
    error_event,
    finish_reasons,
    gateway_app,
    post,
    retries,
    running,
    sim_reset,
    sim_stats,
    upstream_errors,
    wait_for_stat,
)
from .sim_process import run_sim

pytestmark = [
    pytest.mark.slow,
    # httpx2 nests async generators (AsyncResponseStream -> PoolByteStream) and closes only
    # the outer one when a stream is left early; Trio finalizes the inner one and warns.
    pytest.mark.filterwarnings("ignore:Async generator .httpcore2:ResourceWarning"),
]
KINDS = ["openai", "vllm_ws"]


@pytest.fixture(scope="module")
def sim_addr() -> Iterator[str]:
    with run_sim() as addr:
        yield addr


@pytest.fixture
async def sim(sim_addr: str) -> str:
    await sim_reset(sim_addr)
    return sim_addr


def expected(n: int) -> str:
    return "".join(token_text(i) for i in range(n))


@pytest.mark.parametrize("kind", KINDS)
async def test_streaming_through_the_gateway(sim: str, kind: str) -> None:
    app = gateway_app(kind, sim)
    async with running(app) as client:
        r = await post(
            client, chat(stream=True, max_tokens=5, stream_options={"include_usage": True})
        )
    assert r.status == 200
    assert r.text() == expected(5)
    assert finish_reasons(r) == ["length"]
    assert r.events()[-1] == "[DONE]"
    usage = json.loads(r.events()[-2])["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["prompt_tokens"] > 0
    stats = await sim_stats(sim)
    assert stats["completed"] == 1
    # The remaining budget went upstream and is below the inference budget (0.75 x 29.9 s).
    assert 0 < stats["last_timeout_ms"] <= 22_425


@pytest.mark.parametrize("kind", KINDS)
async def test_non_streaming_through_the_gateway(sim: str, kind: str) -> None:
    app = gateway_app(kind, sim)
    async with running(app) as client:
        r = await post(client, chat())
    assert r.status == 200
    body = r.json()
    assert body["choices"][0]["message"]["content"] == expected(8)  # the sim's default length
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("kind", KINDS)
async def test_retries_before_the_first_token(sim: str, kind: str) -> None:
    app = gateway_app(kind, sim, headers={"x-sim-fault": "503", "x-sim-fault-times": "2"})
    async with running(app) as client:
        r = await post(client, chat(stream=True, max_tokens=3))
    assert r.status == 200
    assert r.text() == expected(3)
    stats = await sim_stats(sim)
    assert stats["attempts"][r.headers["x-request-id"]] == 3
    assert stats["faults"] == {"503": 2}
    assert retries(app) == 2


@pytest.mark.parametrize("kind", KINDS)
async def test_429_retry_after_is_honoured(sim: str, kind: str) -> None:
    app = gateway_app(kind, sim, headers={"x-sim-fault": "429:0.3", "x-sim-fault-times": "1"})
    async with running(app) as client:
        t0 = trio.current_time()
        r = await post(client, chat(max_tokens=2))
        elapsed = trio.current_time() - t0
    assert r.status == 200
    assert elapsed >= 0.3  # backoff_max_ms is 50: only Retry-After explains the wait
    assert (await sim_stats(sim))["attempts"][r.headers["x-request-id"]] == 2


@pytest.mark.parametrize("kind", KINDS)
async def test_retries_exhausted_is_a_502_envelope(sim: str, kind: str) -> None:
    app = gateway_app(kind, sim, max_retries=1, headers={"x-sim-fault": "500"})
    async with running(app) as client:
        r = await post(client, chat(stream=True))
    assert r.status == 502
    err = r.json()["error"]
    assert err["type"] == "upstream_error"
    assert err["code"] == "upstream_status_error"
    assert "500" in err["message"]
    assert (await sim_stats(sim))["attempts"][r.headers["x-request-id"]] == 2
    assert upstream_errors(app, "upstream_status_error") == 1


@pytest.mark.parametrize("kind", KINDS)
async def test_drop_after_the_first_token_is_an_error_event_not_a_retry(
    sim: str, kind: str
) -> None:
    app = gateway_app(kind, sim, headers={"x-sim-fault": "drop:3"})
    async with running(app) as client:
        r = await post(client, chat(stream=True, max_tokens=10))
    assert r.status == 200
    assert r.text() == expected(3)
    assert finish_reasons(r) == []  # never a clean finish
    err = error_event(r)
    assert err is not None
    assert err["type"] == "upstream_error"
    assert r.events()[-1] == "[DONE]"
    assert (await sim_stats(sim))["attempts"][r.headers["x-request-id"]] == 1
    assert retries(app) == 0


@pytest.mark.parametrize("kind", KINDS)
async def test_malformed_chunk_is_a_protocol_error_event(sim: str, kind: str) -> None:
    app = gateway_app(kind, sim, headers={"x-sim-fault": "malformed:2"})
    async with running(app) as client:
        r = await post(client, chat(stream=True, max_tokens=10))
    assert r.text() == expected(2)
    err = error_event(r)
    assert err is not None
    assert err["code"] == "upstream_protocol_error"
    assert finish_reasons(r) == []


@pytest.mark.parametrize("kind", KINDS)
async def test_malformed_before_the_first_token_non_streaming_is_502(sim: str, kind: str) -> None:
    app = gateway_app(kind, sim, headers={"x-sim-fault": "malformed:0"})
    async with running(app) as client:
        r = await post(client, chat(max_tokens=4))
    assert r.status == 502
    assert r.json()["error"]["code"] == "upstream_protocol_error"


@pytest.mark.parametrize("kind", KINDS)
async def test_stall_ends_at_the_inference_deadline_and_the_sim_sees_it(
    sim: str, kind: str
) -> None:
    app = gateway_app(kind, sim, headers={"x-sim-fault": "stall:2"})
    async with running(app) as client:
        t0 = trio.current_time()
        r = await post(client, chat(stream=True, max_tokens=10), {"x-request-timeout-ms": "600"})
        elapsed = trio.current_time() - t0
    # inference cut point: (600 - 100 ms reserve) x 0.75 = 375 ms
    assert 0.35 < elapsed < 0.6
    assert r.text() == expected(2)
    err = error_event(r)
    assert err is not None
    assert err["type"] == "timeout"
    assert finish_reasons(r) == []
    # The sim stops either way: it sees the gateway close the stream, or its own copy
    # of the budget (X-Request-Timeout-Ms, the same cut point) runs out first.
    for _ in range(150):
        stats = await sim_stats(sim)
        if not stats["open_streams"]:
            break
        await trio.sleep(0.02)
    assert stats["cancelled"] + stats["expired"] == 1
    assert stats["open_streams"] == 0
    assert stats["last_timeout_ms"] <= 375


@pytest.mark.parametrize("kind", KINDS)
async def test_client_disconnect_reaches_the_sim(sim: str, kind: str) -> None:
    app = gateway_app(kind, sim)
    async with running(app) as client:
        async with client.open("POST", PATH, json_body=chat(stream=True, max_tokens=2000)) as ex:
            await ex.wait_for_bytes(3)
            assert (await sim_stats(sim))["open_streams"] == 1
            ex.disconnect()
        stats = await wait_for_stat(sim, "cancelled", 1, within=1.0)
    assert stats["cancelled"] == 1
    assert stats["open_streams"] == 0
    assert stats["completed"] == 0


@pytest.mark.parametrize("kind", KINDS)
async def test_long_history_is_trimmed_and_reported(sim: str, kind: str) -> None:
    app = gateway_app(kind, sim, context_window=300)
    history = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "tell me more " * 10}
        for i in range(12)
    ]
    body = {
        "model": "sim-model",
        "max_tokens": 20,
        "messages": [
            {"role": "system", "content": "be brief"},
            *history,
            {"role": "user", "content": "and?"},
        ],
    }
    async with running(app) as client:
        r = await post(client, body)
    assert r.status == 200
    trimmed = int(r.headers["x-aiserve-trimmed-messages"])
    assert 0 < trimmed <= 12
    assert r.json()["usage"]["prompt_tokens"] + 20 <= 300


@pytest.mark.parametrize("kind", KINDS)
async def test_history_that_cannot_fit_is_a_400(sim: str, kind: str) -> None:
    app = gateway_app(kind, sim, context_window=50)
    async with running(app) as client:
        r = await post(client, chat("word " * 100, max_tokens=10))
    assert r.status == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert (await sim_stats(sim))["requests"] == 0


@pytest.mark.parametrize("kind", KINDS)
async def test_unreachable_upstream_is_a_502_connect_error(kind: str) -> None:
    from .servers import free_port

    app = gateway_app(kind, f"127.0.0.1:{free_port()}", max_retries=1)
    async with running(app) as client:
        r = await post(client, chat())
    assert r.status == 502
    assert r.json()["error"]["code"] == "upstream_connect_error"
    assert retries(app) == 1


async def test_http2_upstream_multiplexes_streams_over_one_connection(sim: str) -> None:
    app = gateway_app("openai", sim, http2=True)
    adapter = app.adapters["up"]
    assert isinstance(adapter, OpenAIAdapter)
    results: list[str] = []
    async with running(app) as client:

        async def one() -> None:
            r = await post(client, chat(stream=True, max_tokens=200))
            assert r.status == 200
            results.append(r.text())

        seen: set[tuple[int, int]] = set()
        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(one)
            # While the eight stream (2 ms a token, 0.4 s each), they share one h2c
            # connection: looked at until all have ended (a busy machine is slow to start).
            while len(results) < 8:
                now = adapter.connections()
                assert now is not None
                seen.add(now)
                await trio.sleep(0.005)
    assert {opened for opened, _ in seen} <= {0, 1}  # never a second connection
    assert (1, 1) in seen
    assert results == [expected(200)] * 8
    assert (await sim_stats(sim))["completed"] == 8
