"""The prompt count a request is billed with when the provider's never came
(``stages/billing.py`` ``local_prompt``), directly: the count fitting made if any, else
the tokenizer's, made even when the request is being cancelled (a client that left is
billed too), and the UTF-8 bound when the tokenizer fails or takes too long."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from aiserve_trio.adapters.base import InferenceRequest
from aiserve_trio.adapters.tokens import REPLY_PRIMING, count_prompt, message_bound
from aiserve_trio.core.messages import Message
from aiserve_trio.runtime.gateway import build_gateway
from aiserve_trio.stages import billing
from aiserve_trio.stages.types import Route

from .conftest import make_config

MESSAGES = [
    Message(role="system", content="Be brief."),
    Message(role="user", content="héllo wörld"),
]
BOUND = REPLY_PRIMING + sum(message_bound(m) for m in MESSAGES)


def route() -> Route:
    return build_gateway(make_config()).generations.current.routes["/v1/chat/completions"]


def request(prompt_tokens: int | None = None) -> InferenceRequest:
    return InferenceRequest(
        request_id="r", model="aiserve-mock", messages=MESSAGES, deadline=0.0,
        prompt_tokens=prompt_tokens,
    )  # fmt: skip


async def test_the_count_fitting_made_is_used_as_it_is() -> None:
    assert await billing.local_prompt(request(prompt_tokens=41), route()) == 41


async def test_the_tokenizer_counts_even_while_the_request_is_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exact = await count_prompt(MESSAGES, "aiserve-mock", None)
    assert exact < BOUND  # the bound is not the count

    async def loading(*args: Any) -> int:
        await trio.lowlevel.checkpoint()  # as a first count does: its table loads in a thread
        return await count_prompt(*args)

    monkeypatch.setattr(billing, "count_prompt", loading)
    counted = None
    with trio.CancelScope() as scope:
        scope.cancel()  # the client left: the request ends, and is billed
        counted = await billing.local_prompt(request(), route())
    assert counted == exact


async def test_a_failing_tokenizer_bills_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(*args: object) -> int:
        raise RuntimeError("no table")

    monkeypatch.setattr(billing, "count_prompt", broken)
    assert await billing.local_prompt(request(), route()) == BOUND


async def test_a_tokenizer_past_its_time_bills_the_bound(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    async def stuck(*args: object) -> int:
        await trio.sleep(billing.COUNT_TIMEOUT_S * 2)
        return 1

    monkeypatch.setattr(billing, "count_prompt", stuck)
    start = trio.current_time()
    assert await billing.local_prompt(request(), route()) == BOUND
    assert trio.current_time() - start == pytest.approx(billing.COUNT_TIMEOUT_S)
