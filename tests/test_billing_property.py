"""The ledger's property (issue 50, item 7): whatever ends the requests, the spend the
ledger holds, the audit rows, ``/v1/usage`` and ``aiserve_spend_total`` are one figure,
and that figure is what the upstream reported -- exactly where it reported its usage
(a finished reply), within the local count's tolerance where it did not (the client
left after k deltas, the upstream dropped after k words, the token cap cut the reply,
the client's deadline passed) -- and, behind a hedged group, every call the upstream was
sent, a hedge's loser included.

Each seed draws a run of requests -- an ending, an API, streamed or not -- and sends them
one after another to the in-process app (real clock: the audit log's writer is a
thread), with an upstream that counts the prompt with the gateway's tokenizer and keeps
its own books of what it generated for each call.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from aiserve_trio.adapters.base import Adapter, Delta, DeltaSink, InferenceRequest, Usage
from aiserve_trio.adapters.group import GroupAdapter, Member
from aiserve_trio.adapters.retry import Progress
from aiserve_trio.adapters.settings import GroupAdapterConfig, GroupDeployment
from aiserve_trio.adapters.tokens import count_prompt
from aiserve_trio.core.errors import UpstreamProtocolError

from .spendcfg import KEY_DAN, auth, running
from .test_billing import (
    APIS,
    IN,
    OUT,
    Scripted,
    audit_rows,
    billing_app,
    ledger_spent,
    own_usage,
    spend_metric,
)

WORDS = 60
#: Completion tokens the gateway's count may differ from the upstream's books by, on a
#: reply cut before its end: the word in flight when the cut came.
TOLERANCE = 2


@dataclass
class Call:
    """The upstream's books for one call."""

    prompt: int
    generated: int = 0
    reported: bool = False


class Books(Scripted):
    """Writes ``WORDS`` words 4 ms apart and reports its usage at the end, or drops
    after the number of words its plan says; keeps a :class:`Call` per call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []
        #: The word the next call drops after (None: none); the requests go one by one.
        self.drop: int | None = None

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        call = Call(prompt=await count_prompt(request.messages, request.model, None))
        drop = self.drop
        self.calls.append(call)
        for i in range(WORDS):
            if i == drop:
                raise UpstreamProtocolError("the upstream closed the connection")
            await trio.sleep(0.004)
            await send.send(Delta(text=" sea"))  # one token: one event, one token
            call.generated += 1
        call.reported = True
        await send.send(
            Delta(
                finish_reason="stop",
                usage=Usage(prompt_tokens=call.prompt, completion_tokens=WORDS),
            )
        )


ENDINGS = ("finish", "leave", "drop", "cap", "deadline")


async def one(
    client: Any, books: Books | Shared, rng: random.Random, endings: tuple[str, ...] = ENDINGS
) -> str:
    """Send one request with a drawn ending; the ending."""
    ending = rng.choice(endings)
    if isinstance(books, Shared):
        books.hedge = ending == "hedge"
    api = "chat" if ending == "cap" else rng.choice(list(APIS))
    path, body = APIS[api]
    stream = ending in ("leave", "deadline") or rng.random() < 0.5
    body = {**body, "stream": stream}
    headers = auth(KEY_DAN)
    books.drop = rng.randrange(1, WORDS) if ending == "drop" else None
    if ending == "cap":  # a backend that ignores max_tokens: the gateway stops it
        body["max_tokens"] = rng.randrange(1, WORDS)
    if ending == "deadline":
        headers = {**headers, "x-request-timeout-ms": str(rng.randrange(200, 300))}
    if ending == "leave":
        async with client.open("POST", path, json_body=body, headers=headers) as ex:
            await ex.wait_for_bytes(rng.randrange(4, 30))
            ex.disconnect()
    else:
        await client.request("POST", path, json_body=body, headers=headers)
    return ending


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_ledger_rows_usage_and_metric_are_what_the_upstream_reported(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    books = Books()
    app = billing_app(tmp_path, books)
    async with running(app) as client:
        endings = [await one(client, books, rng) for _ in range(8)]
        total = await own_usage(client)
        spent = await ledger_spent(app)
    rows = sorted(audit_rows(tmp_path), key=lambda r: r["ts"])
    assert len(rows) == len(endings)
    # Each was answered: every deadline leaves the 50 ms an upstream call needs past
    # the 100 ms reserve.
    unanswered = [r for r in rows if r["usage_source"] is None]
    assert unanswered == []
    assert len(rows) == len(books.calls)
    # One figure everywhere: the rows' sum is the ledger, /v1/usage and the metric.
    cost = sum(r["cost"] for r in rows)
    assert cost > 0
    assert spent == pytest.approx(cost)
    assert total["cost"] == pytest.approx(cost)
    assert spend_metric(app) == pytest.approx(cost)
    assert total["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)
    assert total["completion_tokens"] == sum(r["completion_tokens"] for r in rows)
    # And it is what the upstream's books say.
    for row, call, ending in zip(rows, books.calls, endings, strict=True):
        what = (ending, row["usage_source"], row["prompt_tokens"], row["completion_tokens"])
        assert row["cost"] == pytest.approx(
            row["prompt_tokens"] * IN + row["completion_tokens"] * OUT
        ), what
        assert row["prompt_tokens"] == call.prompt, what
        if ending == "finish":
            assert call.reported, what
        if call.reported and row["usage_source"] == "provider":
            assert row["completion_tokens"] == WORDS, what
        else:
            assert row["usage_source"] == "counted", what
            assert abs(row["completion_tokens"] - call.generated) <= TOLERANCE, what


class Shared:
    """The books of two deployments of a group, by request: each call the upstream was
    sent (a hedge's loser too), with what it read and generated."""

    def __init__(self) -> None:
        self.calls: dict[str, list[Call]] = {}
        self.drop: int | None = None
        #: The next request's first call waits past the hedge before its first word.
        self.hedge = False


class Desk(Adapter):
    """One deployment writing into :class:`Shared` books, as :class:`Books` does."""

    def __init__(self, name: str, books: Shared) -> None:
        super().__init__(name, ["aiserve-mock"])
        self.books = books

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        calls = self.books.calls.setdefault(request.request_id, [])
        call = Call(prompt=await count_prompt(request.messages, request.model, None))
        first = not calls
        calls.append(call)
        if first and self.books.hedge:
            await trio.sleep(1.0)  # the group hedges at 20-50 ms; the other one wins
        drop = self.books.drop
        for i in range(WORDS):
            if i == drop:
                raise UpstreamProtocolError("the upstream closed the connection")
            await trio.sleep(0.004)
            await send.send(Delta(text=" sea"))
            call.generated += 1
        call.reported = True
        await send.send(
            Delta(
                finish_reason="stop",
                usage=Usage(prompt_tokens=call.prompt, completion_tokens=WORDS),
            )
        )


@pytest.mark.parametrize("seed", [4, 5])
async def test_with_hedges_the_ledger_is_every_call_the_upstream_was_sent(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    books = Shared()
    desks = [Desk("a", books), Desk("b", books)]
    cfg = GroupAdapterConfig(
        models=["aiserve-mock"],
        deployments=[GroupDeployment(adapter=d.name) for d in desks],
        balance="lowest_ttft",
        hedge=True,
    )
    group = GroupAdapter(
        "mock", cfg, [Member(desks[0], 0, 1.0, 0.02), Member(desks[1], 0, 1.0, 0.05)]
    )
    app = billing_app(tmp_path, group)
    endings = (*ENDINGS, "hedge", "hedge")
    async with running(app) as client:
        drawn = [await one(client, books, rng, endings) for _ in range(8)]
        total = await own_usage(client)
        spent = await ledger_spent(app)
    assert "hedge" in drawn
    rows = audit_rows(tmp_path)
    assert len(rows) == len(drawn) == len(books.calls)
    cost = sum(r["cost"] for r in rows)
    assert spent == pytest.approx(cost)
    assert total["cost"] == pytest.approx(cost)
    assert spend_metric(app) == pytest.approx(cost)
    hedged = 0
    for row in rows:
        calls = books.calls[row["request_id"]]
        hedged += len(calls) > 1
        what = (row["status"], row["usage_source"], len(calls))
        assert row["cost"] == pytest.approx(
            row["prompt_tokens"] * IN + row["completion_tokens"] * OUT
        ), what
        # Every call's prompt: the reply's as reported or counted, a loser's counted.
        assert row["prompt_tokens"] == sum(c.prompt for c in calls), what
        generated = sum(c.generated for c in calls)
        if row["usage_source"] == "provider":
            assert len(calls) == 1, what
            assert row["completion_tokens"] == WORDS, what
        else:
            assert abs(row["completion_tokens"] - generated) <= TOLERANCE, what
    assert hedged >= drawn.count("hedge")
