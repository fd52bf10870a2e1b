"""Reserve before admission (issue 50, item 4): an admitted request holds its maximum cost
against its key's and tenant's budgets until it ends, so 30 streams opened at once on the
last 10 % of a budget do not each spend it (11.7x the budget before) -- the spend ends
below the budget plus one request's cost, plus, where a route's ``budget_reserve`` held
less than a request cost, that difference for each request admitted. On Trio's virtual
clock, with a backend that streams 100 words 10 ms apart and reports its usage."""

from __future__ import annotations

import time
from typing import Any

import pytest
import trio

from aiserve_trio.adapters.base import Adapter, Delta, DeltaSink, InferenceRequest, Usage
from aiserve_trio.adapters.retry import Progress
from aiserve_trio.config import parse_config
from aiserve_trio.runtime.asgi import App
from aiserve_trio.spend.budget import Reserve

from .asgi_client import chat_body
from .authcfg import OFF
from .conftest import config_text
from .spendcfg import KEY_CAROL, auth, running, spend_toml

IN, OUT = 3.0 / 1e6, 15.0 / 1e6  # spendcfg.PRICES, per token
WORDS = 100
PROMPT_TOKENS = 40
COST = PROMPT_TOKENS * IN + WORDS * OUT  # one stream: 0.00162 USD
BUDGET = 0.01


class Slow(Adapter):
    """100 words, one every 10 ms, then its own usage."""

    def __init__(self) -> None:
        super().__init__("mock", ["aiserve-mock"])
        self.calls = 0

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        self.calls += 1
        for i in range(WORDS):
            await trio.sleep(0.01)
            await send.send(Delta(text=f" w{i}"))
        usage = Usage(prompt_tokens=PROMPT_TOKENS, completion_tokens=WORDS)
        await send.send(Delta(finish_reason="stop", usage=usage))


def reserve_app(backend: Slow, reserve: float | None = None) -> App:
    text = config_text().replace(OFF, spend_toml(carol_budget=str(BUDGET)))
    if reserve is not None:  # the chat route's cap on what one request holds
        text = text.replace('name = "chat"\n', f'name = "chat"\nbudget_reserve = {reserve}\n', 1)
    return App(parse_config(text, source="<test>"), adapters={"mock": backend})


async def thirty_streams_at_90_percent(app: App) -> tuple[list[int], float]:
    """30 of carol's streams at once with 90 % of her budget spent: their statuses, and
    her spend once all ended."""
    statuses: list[int] = []
    async with running(app) as client:
        limits = app.gate.budgets.limits("carol", "shop")
        await app.gate.ledger.charge(limits, 0.9 * BUDGET, time.time())

        async def one(i: int) -> None:
            body = chat_body(f"story {i}", stream=True)
            r = await client.chat(body, headers=auth(KEY_CAROL))
            statuses.append(r.status)

        async with trio.open_nursery() as nursery:
            for i in range(30):
                nursery.start_soon(one, i)
        [spent] = await app.gate.ledger.spent(limits, time.time())
        assert app.gate.ledger.held(limits, time.time()) == [0.0]  # every hold let go
    return statuses, spent


async def test_thirty_streams_on_the_last_tenth_spend_at_most_one_more(
    autojump_clock: Any,
) -> None:
    backend = Slow()
    statuses, spent = await thirty_streams_at_90_percent(reserve_app(backend))
    # The first holds its maximum cost (far above what is left): the others are refused.
    assert statuses.count(200) == 1 == backend.calls
    assert statuses.count(429) == 29
    assert spent == pytest.approx(0.9 * BUDGET + COST)
    assert spent <= BUDGET + COST  # the stated bound: one request's cost


async def test_a_routes_budget_reserve_caps_the_hold_and_the_bound_says_so(
    autojump_clock: Any,
) -> None:
    # Each holds 0.0002 USD: five fit in the last 0.001, each costs 0.00162 -- the spend
    # passes the budget by one cost plus the difference for each request admitted.
    backend = Slow()
    statuses, spent = await thirty_streams_at_90_percent(reserve_app(backend, 0.0002))
    admitted = statuses.count(200)
    assert admitted == backend.calls == 5
    assert spent == pytest.approx(0.9 * BUDGET + admitted * COST)
    assert spent <= BUDGET + COST + admitted * (COST - 0.0002)


def test_a_hold_is_the_body_as_tokens_and_the_max_tokens_cap_at_the_dearest_rates() -> None:
    r = Reserve(prompt_rate=IN, completion_rate=OUT, max_tokens=1000, max_body_bytes=4096)
    assert r.amount(200) == pytest.approx(200 * IN + 1000 * OUT)
    assert r.amount(None) == pytest.approx(4096 * IN + 1000 * OUT)  # not declared
    assert r.amount(10**9) == r.amount(None)  # never more than a body can be
    capped = Reserve(IN, OUT, 1000, 4096, cap=0.001)
    assert capped.amount(200) == 0.001
