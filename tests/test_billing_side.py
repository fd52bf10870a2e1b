"""A request's extra upstream calls are billed to it (issue 50's gaps, item 1): a group's
hedge that lost the race, and the earlier steps of a chain whose streaming step was cut.
The provider billed the bank for each; the audit row (its usage and cost), the ledger,
``/v1/usage`` and ``aiserve_spend_total`` hold them as one figure.

In-process app on the real clock (the audit writer is a thread), as ``test_billing``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import trio

from aiserve_trio.adapters.base import Delta, DeltaSink, InferenceRequest, Usage
from aiserve_trio.adapters.group import GroupAdapter, Member
from aiserve_trio.adapters.retry import Progress
from aiserve_trio.adapters.settings import GroupAdapterConfig, GroupDeployment
from aiserve_trio.config import parse_config
from aiserve_trio.runtime.asgi import App

from .authcfg import OFF
from .conftest import config_text
from .spendcfg import KEY_DAN, auth, running, spend_toml
from .test_billing import (
    APIS,
    WORDS,
    Charges,
    Scripted,
    audit_rows,
    check_one_figure,
    expected_prompt,
)


class Paced(Scripted):
    """:class:`Scripted` under its own name, waiting ``first`` seconds for its first word."""

    def __init__(self, name: str, first: float) -> None:
        super().__init__(Usage(prompt_tokens=77, completion_tokens=WORDS))
        self.name = name
        self.first = first
        self.cancelled = 0
        #: Each request it was sent, as it came (before its first word).
        self.asked: list[InferenceRequest] = []

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        self.asked.append(request)
        try:
            await trio.sleep(self.first)
            await super().attempt(request, send, progress)
        except trio.Cancelled:
            self.cancelled += 1
            raise


def app_with(tmp: Path, adapter: object, routes: str = "") -> App:
    audit = f'[audit]\npath = "{tmp / "audit.db"}"\nretention_days = 30\n'
    tenant = '[tenants.shop]\nbudget = 100.0\nbudget_period = "day"\n'
    toml = spend_toml(audit=audit, tenant=tenant).replace(
        'id = "dan"\n', 'id = "dan"\ntpm = 100000000\n', 1
    )
    text = config_text().replace(OFF, toml) + routes
    return App(parse_config(text, source="<test>"), adapters={"mock": adapter})  # type: ignore[dict-item]


def hedged(slow: Paced, fast: Paced) -> GroupAdapter:
    """A group over ``slow`` (tried first: the lower expected TTFT) and ``fast``, hedged
    at slow's 20 ms prior."""
    cfg = GroupAdapterConfig(
        models=["aiserve-mock"],
        deployments=[GroupDeployment(adapter=slow.name), GroupDeployment(adapter=fast.name)],
        balance="lowest_ttft",
        hedge=True,
    )
    members = [Member(slow, 0, 1.0, 0.02), Member(fast, 0, 1.0, 0.05)]
    return GroupAdapter("mock", cfg, members, rng=random.Random(1))


async def test_a_hedge_that_lost_the_race_is_billed_for_its_prompt(tmp_path: Path) -> None:
    slow, fast = Paced("slow", 5.0), Paced("fast", 0.0)
    app = app_with(tmp_path, hedged(slow, fast))
    charges = Charges(app)
    path, body = APIS["chat"]
    async with running(app) as client:
        r = await client.request("POST", path, json_body=body, headers=auth(KEY_DAN))
        assert r.status == 200
        assert r.headers["x-aiserve-deployment"] == "fast"
        row = await check_one_figure(app, client, tmp_path, charges)
    assert slow.cancelled == 1  # it lost before its first word
    assert slow.sent == 0
    # The winner's own usage, plus the loser's prompt as the gateway counts it.
    lost = await expected_prompt(slow.asked[0])
    assert lost > 0
    assert row["prompt_tokens"] == 77 + lost
    assert row["completion_tokens"] == WORDS
    assert row["usage_source"] == "counted"


async def test_without_a_hedge_only_the_reply_is_billed(tmp_path: Path) -> None:
    slow, fast = Paced("slow", 0.0), Paced("fast", 0.0)  # slow answers before its P95
    app = app_with(tmp_path, hedged(slow, fast))
    charges = Charges(app)
    path, body = APIS["chat"]
    async with running(app) as client:
        r = await client.request("POST", path, json_body=body, headers=auth(KEY_DAN))
        assert r.headers["x-aiserve-deployment"] == "slow"
        row = await check_one_figure(app, client, tmp_path, charges)
    assert fast.asked == []
    assert (row["prompt_tokens"], row["completion_tokens"]) == (77, WORDS)
    assert row["usage_source"] == "provider"


CHAIN = """
[[routes]]
path = "/v1/chain"
name = "chain"
adapter = "mock"

[[routes.steps]]
name = "draft"
kind = "generate"

[[routes.steps]]
name = "answer"
kind = "generate"
"""


async def chain_call(tmp: Path, leave: bool) -> tuple[Scripted, dict[str, Any]]:
    backend = Scripted()
    app = app_with(tmp, backend, CHAIN)
    charges = Charges(app)
    _, body = APIS["chat"]
    async with running(app) as client:
        if leave:
            async with client.open(
                "POST", "/v1/chain", json_body=body, headers=auth(KEY_DAN)
            ) as ex:
                await ex.wait_for_bytes(12)  # the streaming step's first words
                ex.disconnect()
        else:
            r = await client.request("POST", "/v1/chain", json_body=body, headers=auth(KEY_DAN))
            assert r.status == 200
        row = await check_one_figure(app, client, tmp, charges)
    assert len(backend.requests) == 2  # the draft, then the answer
    return backend, row


async def test_a_chain_whose_last_step_is_cut_is_billed_for_the_steps_before(
    tmp_path: Path,
) -> None:
    backend, row = await chain_call(tmp_path, leave=True)
    assert row["status"] == "client_closed"
    assert row["usage_source"] == "counted"
    # The draft step's whole call as its provider reported it, and the cut answer's
    # prompt counted here and the words it sent.
    answer = await expected_prompt(backend.requests[1])
    assert row["prompt_tokens"] == 77 + answer
    assert WORDS + 5 <= row["completion_tokens"] <= backend.sent <= WORDS + 20


async def test_a_finished_chain_bills_its_steps_once(tmp_path: Path) -> None:
    _, row = await chain_call(tmp_path, leave=False)
    # The final usage folds the draft's in: both calls, each once.
    assert (row["prompt_tokens"], row["completion_tokens"]) == (2 * 77, 2 * WORDS)
    assert row["usage_source"] == "provider"
    assert len(audit_rows(tmp_path)) == 1


class Phrases(Scripted):
    """Five tokens an event, and no usage at the end (a backend that never reports it)."""

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        self.requests.append(request)
        for _ in range(WORDS):
            await trio.sleep(self.gap)
            await send.send(Delta(text=" the sea and the sky"))  # 5 tokens, one event
            self.sent += 1
        await send.send(Delta(finish_reason="stop"))


async def test_a_cut_chains_step_without_usage_is_billed_for_its_texts_tokens(
    tmp_path: Path,
) -> None:
    backend = Phrases()
    app = app_with(tmp_path, backend, CHAIN)
    charges = Charges(app)
    _, body = APIS["chat"]
    async with running(app) as client:
        async with client.open("POST", "/v1/chain", json_body=body, headers=auth(KEY_DAN)) as ex:
            await ex.wait_for_bytes(12)
            ex.disconnect()
        row = await check_one_figure(app, client, tmp_path, charges)
    draft, answer = backend.requests
    assert row["prompt_tokens"] == await expected_prompt(draft) + await expected_prompt(answer)
    # The draft's 100 events of five tokens, then the cut answer's, five an event.
    assert row["completion_tokens"] % 5 == 0
    assert 5 * (WORDS + 5) <= row["completion_tokens"] <= 5 * backend.sent <= 5 * (WORDS + 20)
