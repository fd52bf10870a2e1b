"""Chat requests start in the order they arrived, a bounded number at a time
(``[deadline] max_starting``, ``http/turns.py``), on the virtual clock: a request waits
for its turn once its body is in, gives it back as its upstream call starts, is never
overtaken, and waits at most until its queue budget (503, shed) or its context cut."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest
import trio
import trio.testing

from aiserve_trio.adapters.mock import MockAdapter
from aiserve_trio.config import Config, MockAdapterConfig, parse_config
from aiserve_trio.http.turns import Turns
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client, chat_body
from .conftest import config_text
from .fakes import RecordingAdapter


def turns_config(deadline: str = "", **mock: str) -> Config:
    text = config_text(**mock)
    text = re.sub(r"(?m)^(min_inference_ms = .*)$", lambda m: m.group(1) + "\n" + deadline, text)
    return parse_config(text, source="<test>")


def turns_app(deadline: str = "", **mock: str) -> App:
    return App(turns_config(deadline, **mock))


async def test_turns_are_taken_in_arrival_order_without_overtaking() -> None:
    turns = Turns(limit=1)
    first = await turns.take(math.inf)
    assert first is not None
    assert turns.active == 1
    got: list[int] = []

    async def wait(i: int) -> None:
        turn = await turns.take(math.inf)
        assert turn is not None
        got.append(i)
        await trio.lowlevel.checkpoint()
        turn.release()

    async with trio.open_nursery() as nursery:
        for i in range(5):
            nursery.start_soon(wait, i)
            await trio.testing.wait_all_tasks_blocked()
        assert turns.waiting == 5
        first.release()
        # A newcomer just after the release does not take the freed turn: it queues.
        late = await turns.take(trio.current_time())
        assert late is None
    assert got == [0, 1, 2, 3, 4]
    assert (turns.active, turns.waiting) == (0, 0)


async def test_a_turn_waited_for_past_its_bound_is_not_taken(autojump_clock: Any) -> None:
    turns = Turns(limit=1)
    held = await turns.take(math.inf)
    assert held is not None
    assert await turns.take(trio.current_time() + 2) is None
    assert trio.current_time() == pytest.approx(2.0)
    assert (turns.active, turns.waiting) == (1, 0)
    held.release()
    assert turns.active == 0


async def test_no_limit_means_no_queue() -> None:
    turns = Turns(limit=0)
    taken = [await turns.take(0.0) for _ in range(100)]
    assert all(t is not None for t in taken)


async def test_requests_wait_for_their_turn_and_are_served_in_arrival_order(
    autojump_clock: Any,
) -> None:
    cfg = turns_config("max_starting = 1")
    mock_cfg = cfg.adapters["mock"]
    assert isinstance(mock_cfg, MockAdapterConfig)
    rec = RecordingAdapter(MockAdapter("mock", mock_cfg))
    app = App(cfg, adapters={"mock": rec})
    turns = app.gateway.entry.turns
    client = Client(app)
    # Someone else's turn: every request must wait for it.
    blocker = await turns.take(math.inf)
    assert blocker is not None
    done: list[int] = []

    async def one(i: int) -> None:
        resp = await client.chat(chat_body(f"echo: {i}"))
        assert resp.status == 200
        done.append(i)

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(one, i)
            await trio.testing.wait_all_tasks_blocked()
        turns.limit = 1
        assert turns.waiting == 4  # their bodies read, each parked before its parse
        assert done == []
        blocker.release()
    assert sorted(done) == [0, 1, 2, 3]
    # Their upstream calls started in the order the requests arrived.
    asked = [r.messages[-1].content for r in rec.requests]
    assert asked == [f"echo: {i}" for i in range(4)]
    assert (turns.active, turns.waiting) == (0, 0)


async def test_a_turn_is_given_back_when_the_upstream_call_starts(autojump_clock: Any) -> None:
    """A stream waiting on a slow backend holds no turn: a second request starts at once."""
    app = turns_app("max_starting = 1", ttft_ms="5000")
    client = Client(app)
    turns = app.gateway.entry.turns
    async with client.open("POST", "/v1/chat/completions", json_body=chat_body(stream=True)):
        await trio.testing.wait_all_tasks_blocked()
        assert turns.active == 0  # the first stream waits on its backend, turn given back
        start = trio.current_time()
        async with client.open(
            "POST", "/v1/chat/completions", json_body=chat_body(stream=True)
        ) as second:
            await trio.testing.wait_all_tasks_blocked()
            assert turns.waiting == 0
            await second.done.wait()
        assert second.response.status == 200
        assert trio.current_time() - start == pytest.approx(5.0, abs=0.5)


async def test_a_request_past_its_queue_budget_waiting_for_its_turn_is_shed(
    autojump_clock: Any,
) -> None:
    app = turns_app("max_starting = 1\nqueue_share = 0.1")
    turns = app.gateway.entry.turns
    turns.limit = 1
    blocker = await turns.take(math.inf)
    assert blocker is not None
    start = trio.current_time()
    resp = await Client(app).chat(chat_body(), headers={"x-request-timeout-ms": "10100"})
    # At its queue budget (10 % of its 10 s), not at its deadline: 503, Retry-After, counted.
    assert trio.current_time() - start == pytest.approx(1.0, abs=0.01)
    assert resp.status == 503
    assert resp.headers["retry-after"] == "1"
    assert json.loads(resp.body)["error"]["code"] == "shed"
    assert 'aiserve_shed_total{reason="queue"} 1.0' in app.metrics.render().decode()
    assert (turns.active, turns.waiting) == (1, 0)
    blocker.release()


async def test_without_shedding_the_wait_ends_at_the_context_cut(autojump_clock: Any) -> None:
    app = turns_app("max_starting = 1")
    turns = app.gateway.entry.turns
    turns.limit = 1
    blocker = await turns.take(math.inf)
    assert blocker is not None
    start = trio.current_time()
    resp = await Client(app).chat(chat_body(), headers={"x-request-timeout-ms": "10100"})
    assert resp.status == 504
    assert json.loads(resp.body)["error"]["param"] == "parse"
    assert trio.current_time() - start == pytest.approx(4.0, abs=0.01)  # 40 % of 10 s
    blocker.release()
