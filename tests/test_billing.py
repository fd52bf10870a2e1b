"""Every token is paid for (issue 50, items 1 and 5): a request is billed for what it
consumed whatever ended it -- the client leaving, a reply cap, the upstream dropping --
and a backend's unbelievable usage is replaced by the gateway's own count.

Each test runs the gateway in-process (``asgi_client``) -- on the real clock, as the
audit tests do: ``/v1/usage`` waits for the audit writer's thread -- with a scripted
backend in place of the mock on the embedded default's chat, Messages and
Responses routes, priced, with the audit log in SQLite, a tenant budget and a token
rate; and checks that one figure reaches the audit row (``usage_source``), the ledger,
the tpm limiter, ``/v1/usage``, ``aiserve_spend_total`` and, where the client is still
there, its usage and ``X-Aiserve-Cost``.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from aiserve_trio.adapters.base import Adapter, Delta, DeltaSink, InferenceRequest, Usage
from aiserve_trio.adapters.retry import Progress
from aiserve_trio.adapters.tokens import count_prompt
from aiserve_trio.config import parse_config
from aiserve_trio.core.errors import UpstreamProtocolError
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client, Response
from .authcfg import OFF
from .conftest import config_text
from .spendcfg import KEY_DAN, auth, running, spend_toml

#: 3 and 15 per million (spendcfg.PRICES).
IN, OUT = 3.0 / 1e6, 15.0 / 1e6
WORDS = 100
PROMPT = "tell me a long story about " + "the sea and " * 20


class Scripted(Adapter):
    """A backend that writes ``WORDS`` words, one every 2 ms, then finishes with
    ``usage`` -- or breaks off after ``drop_after`` words (``gap``: seconds a word)."""

    def __init__(
        self, usage: Usage | None = None, drop_after: int | None = None, gap: float = 0.002
    ) -> None:
        super().__init__("mock", ["aiserve-mock"])
        self.gap = gap
        self.usage = usage
        self.drop_after = drop_after
        self.requests: list[InferenceRequest] = []
        self.sent = 0
        #: Set once ten words were sent.
        self.ten = trio.Event()

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        self.requests.append(request)
        for i in range(WORDS):
            if i == self.drop_after:
                raise UpstreamProtocolError("the upstream closed the connection")
            await trio.sleep(self.gap)
            await send.send(Delta(text=" sea"))  # one token: one event, one token
            self.sent += 1
            if self.sent == 10:
                self.ten.set()
        usage = self.usage or Usage(prompt_tokens=77, completion_tokens=WORDS)
        await send.send(Delta(finish_reason="stop", usage=usage))


def billing_app(tmp: Path, backend: Adapter, caps: str = "") -> App:
    """The embedded default, priced, audited in SQLite; dan (tenant shop) has a token
    rate and shop a budget, so the limiter and the ledger are charged."""
    audit = f'[audit]\npath = "{tmp / "audit.db"}"\nretention_days = 30\n'
    tenant = '[tenants.shop]\nbudget = 100.0\nbudget_period = "day"\n'
    toml = spend_toml(audit=audit, tenant=tenant).replace(
        'id = "dan"\n', 'id = "dan"\ntpm = 100000000\n', 1
    )
    text = config_text().replace(OFF, toml)
    if caps:  # the chat route's caps
        text = text.replace('name = "chat"\n', f'name = "chat"\n{caps}\n', 1)
    return App(parse_config(text, source="<test>"), adapters={"mock": backend})


#: (path, body) of a streamed request on each API, and how many deltas its first
#: events hold before the words begin.
APIS = {
    "chat": (
        "/v1/chat/completions",
        {"model": "aiserve-mock", "stream": True, "messages": [{"role": "user", "content": PROMPT}]},
    ),
    "messages": (
        "/v1/messages",
        {
            "model": "aiserve-mock",
            "stream": True,
            "max_tokens": 1000,
            "messages": [{"role": "user", "content": PROMPT}],
        },
    ),
    "responses": ("/v1/responses", {"model": "aiserve-mock", "stream": True, "input": PROMPT}),
}


class Charges:
    """What the gate charged the tpm limiter (tokens per call)."""

    def __init__(self, app: App) -> None:
        self.tokens: list[int] = []
        limiter = app.gate.limiter
        charge = limiter.charge

        async def spy(principal: Any, tokens: int) -> None:
            self.tokens.append(tokens)
            await charge(principal, tokens)

        limiter.charge = spy  # type: ignore[method-assign]


def audit_rows(tmp: Path) -> list[dict[str, Any]]:
    conn = sqlite3.connect(tmp / "audit.db")
    conn.row_factory = sqlite3.Row
    return [dict(r) for r in conn.execute("SELECT * FROM audit_requests ORDER BY ts")]


def spend_metric(app: App) -> float:
    """``aiserve_spend_total`` of dan's requests, every route."""
    return sum(
        s.value
        for family in app.metrics.registry.collect()
        for s in family.samples
        if s.name == "aiserve_spend_total" and s.labels.get("key") == "dan"
    )


async def ledger_spent(app: App) -> float:
    limit = app.gate.budgets.tenants["shop"]
    (spent,) = await app.gate.ledger.spent([limit], time.time())
    return float(spent)


async def own_usage(client: Client) -> dict[str, Any]:
    r = await client.request("GET", "/v1/usage?group_by=key", headers=auth(KEY_DAN))
    assert r.status == 200, r.body
    return dict(r.json()["total"])


async def expected_prompt(request: InferenceRequest) -> int:
    return await count_prompt(request.messages, request.model, None)


async def check_one_figure(app: App, client: Client, tmp: Path, charges: Charges) -> dict[str, Any]:
    """The audit row of the one request made, once its figure is the same everywhere."""
    total = await own_usage(client)
    spent = await ledger_spent(app)
    (row,) = audit_rows(tmp)
    tokens = row["prompt_tokens"] + row["completion_tokens"]
    cost = row["prompt_tokens"] * IN + row["completion_tokens"] * OUT
    assert row["cost"] == pytest.approx(cost)
    assert (total["prompt_tokens"], total["completion_tokens"]) == (
        row["prompt_tokens"],
        row["completion_tokens"],
    )
    assert total["cost"] == pytest.approx(cost)
    assert spent == pytest.approx(cost)
    assert spend_metric(app) == pytest.approx(cost)
    assert charges.tokens == [tokens]
    return row


@pytest.mark.parametrize("api", list(APIS))
async def test_a_client_that_leaves_is_billed_for_the_words_it_was_sent_and_the_prompt(
    tmp_path: Path, api: str
) -> None:
    backend = Scripted()
    app = billing_app(tmp_path, backend)
    charges = Charges(app)
    path, body = APIS[api]
    async with running(app) as client:
        async with client.open("POST", path, json_body=body, headers=auth(KEY_DAN)) as ex:
            await ex.wait_for_bytes(12)  # the head's events, then a word a write
            ex.disconnect()
        row = await check_one_figure(app, client, tmp_path, charges)
    assert row["status"] == "client_closed"
    assert row["usage_source"] == "counted"
    assert row["prompt_tokens"] == await expected_prompt(backend.requests[0])
    # k-ish: the words the client was sent, give or take the one in flight; never the
    # 200 the backend would have written.
    assert 5 <= row["completion_tokens"] <= backend.sent <= 20


@pytest.mark.parametrize("api", list(APIS))
async def test_an_upstream_that_drops_mid_stream_is_billed_for_what_it_sent(
    tmp_path: Path, api: str
) -> None:
    backend = Scripted(drop_after=20)
    app = billing_app(tmp_path, backend)
    charges = Charges(app)
    path, body = APIS[api]
    async with running(app) as client:
        r = await client.request("POST", path, json_body=body, headers=auth(KEY_DAN))
        assert r.status == 200  # the stream had begun: it ends with the API's error event
        row = await check_one_figure(app, client, tmp_path, charges)
    assert row["status"] == "bad_gateway"
    assert row["usage_source"] == "counted"
    assert row["completion_tokens"] == 20
    assert row["prompt_tokens"] == await expected_prompt(backend.requests[0])


async def test_a_reply_cut_at_max_reply_bytes_is_billed_for_what_was_generated(
    tmp_path: Path,
) -> None:
    backend = Scripted()
    app = billing_app(tmp_path, backend, caps="max_reply_bytes = 100")
    charges = Charges(app)
    path, body = APIS["chat"]
    async with running(app) as client:
        r = await client.request("POST", path, json_body=body, headers=auth(KEY_DAN))
        assert r.status == 200
        assert "max_reply_bytes" in r.body.decode()
        row = await check_one_figure(app, client, tmp_path, charges)
    assert row["error_code"] == "max_reply_bytes"
    assert row["usage_source"] == "counted"
    # 4 bytes a word: about 25 words pass 100 bytes.
    assert 20 <= row["completion_tokens"] <= 30
    assert row["prompt_tokens"] == await expected_prompt(backend.requests[0])


def final_usage(r: Response) -> dict[str, Any]:
    events = [json.loads(e) for e in r.events() if e != "[DONE]"]
    usage = events[-1]["usage"]
    assert isinstance(usage, dict)
    return usage


async def test_a_backends_negative_usage_is_replaced_by_the_gateways_count(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = Scripted(usage=Usage(prompt_tokens=-120_000, completion_tokens=-5))
    app = billing_app(tmp_path, backend)
    charges = Charges(app)
    path, body = APIS["chat"]
    body = {**body, "stream_options": {"include_usage": True}}
    async with running(app) as client:
        r = await client.request("POST", path, json_body=body, headers=auth(KEY_DAN))
        assert r.status == 200
        row = await check_one_figure(app, client, tmp_path, charges)
        again = await client.request("POST", path, json_body=body, headers=auth(KEY_DAN))
        assert again.status == 200
    prompt = await expected_prompt(backend.requests[0])
    assert (row["prompt_tokens"], row["completion_tokens"]) == (prompt, WORDS)
    assert row["usage_source"] == "counted"
    assert row["status"] == "ok"
    # The client, still there, got the same figure.
    usage = final_usage(r)
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt, WORDS)
    cost = float(r.headers.get("x-aiserve-cost", usage["cost"]))
    assert cost == pytest.approx(row["cost"])
    assert cost > 0
    # Counted once per reply, logged once per route and reason.
    value = app.metrics.registry.get_sample_value(
        "aiserve_usage_distrusted_total", {"route": "chat", "reason": "negative"}
    )
    assert value == 2.0
    logged = [r for r in caplog.records if "reported a negative usage" in r.getMessage()]
    assert len(logged) == 1


async def test_a_backend_that_ignores_max_tokens_is_cut_and_billed_for_the_prompt_too(
    tmp_path: Path,
) -> None:
    # The scripted backend writes its 100 words whatever max_tokens says; the gateway
    # stops the reply at 5 (the token cap), and the prompt is billed as counted here
    # (it was prompt_tokens = 0).
    backend = Scripted()
    app = billing_app(tmp_path, backend)
    charges = Charges(app)
    path, body = APIS["chat"]
    body = {**body, "max_tokens": 5, "stream_options": {"include_usage": True}}
    async with running(app) as client:
        r = await client.request("POST", path, json_body=body, headers=auth(KEY_DAN))
        assert r.status == 200
        row = await check_one_figure(app, client, tmp_path, charges)
    prompt = await expected_prompt(backend.requests[0])
    assert prompt > 0
    assert (row["prompt_tokens"], row["completion_tokens"]) == (prompt, 5)
    assert row["usage_source"] == "counted"
    usage = final_usage(r)
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt, 5)
    assert usage["cost"] == pytest.approx(row["cost"])


@pytest.mark.parametrize("api", ["messages", "responses"])
async def test_negative_usage_on_a_whole_messages_or_responses_reply_is_counted_here(
    tmp_path: Path, api: str
) -> None:
    backend = Scripted(usage=Usage(prompt_tokens=-120_000, completion_tokens=-5))
    app = billing_app(tmp_path, backend)
    charges = Charges(app)
    path, body = APIS[api]
    async with running(app) as client:
        r = await client.request(
            "POST", path, json_body={**body, "stream": False}, headers=auth(KEY_DAN)
        )
        assert r.status == 200, r.body
        row = await check_one_figure(app, client, tmp_path, charges)
    prompt = await expected_prompt(backend.requests[0])
    assert (row["prompt_tokens"], row["completion_tokens"]) == (prompt, WORDS)
    assert row["usage_source"] == "counted"
    # The client's own API's usage, and the header, say the same.
    usage = r.json()["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (prompt, WORDS)
    assert float(r.headers["x-aiserve-cost"]) == pytest.approx(row["cost"])


async def test_a_client_that_leaves_a_whole_reply_before_it_is_written_is_billed_too(
    tmp_path: Path,
) -> None:
    backend = Scripted(gap=0.005)
    app = billing_app(tmp_path, backend)
    charges = Charges(app)
    path, body = APIS["chat"]
    async with running(app) as client:
        async with client.open(
            "POST", path, json_body={**body, "stream": False}, headers=auth(KEY_DAN)
        ) as ex:
            await backend.ten.wait()
            ex.disconnect()
        row = await check_one_figure(app, client, tmp_path, charges)
    assert not ex.response.status  # nothing was written
    assert row["status"] == "client_closed"
    assert row["usage_source"] == "counted"
    assert 10 <= row["completion_tokens"] <= backend.sent < WORDS
    assert row["prompt_tokens"] == await expected_prompt(backend.requests[0])


async def test_a_backends_own_believable_usage_is_billed_as_it_sent_it(
    tmp_path: Path,
) -> None:
    backend = Scripted(usage=Usage(prompt_tokens=77, completion_tokens=WORDS))
    app = billing_app(tmp_path, backend)
    charges = Charges(app)
    path, body = APIS["chat"]
    async with running(app) as client:
        r = await client.request("POST", path, json_body=body, headers=auth(KEY_DAN))
        assert r.status == 200
        row = await check_one_figure(app, client, tmp_path, charges)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (77, WORDS)
    assert row["usage_source"] == "provider"


def tokens_metric(app: App, direction: str) -> float:
    value = app.metrics.registry.get_sample_value(
        "aiserve_tokens_total", {"route": "chat", "direction": direction}
    )
    return value or 0.0


async def test_the_clients_own_deadline_bills_what_came_before_it(
    autojump_clock: Any, tmp_path: Path
) -> None:
    # On the virtual clock (no audit log: its writer's thread would see time jump): a
    # 100-word reply at a word every 10 ms, and a client that gives the request 500 ms.
    backend = Scripted(gap=0.01)
    app = App(
        parse_config(
            config_text().replace(
                OFF,
                spend_toml(tenant='[tenants.shop]\nbudget = 100.0\nbudget_period = "day"\n')
                .replace('id = "dan"\n', 'id = "dan"\ntpm = 100000000\n', 1),
            ),
            source="<test>",
        ),
        adapters={"mock": backend},
    )
    charges = Charges(app)
    path, body = APIS["chat"]
    headers = {**auth(KEY_DAN), "x-request-timeout-ms": "500"}
    async with running(app) as client:
        r = await client.request("POST", path, json_body=body, headers=headers)
        spent = await ledger_spent(app)
    assert r.status == 200  # the stream had begun: it ends with the deadline's error event
    assert b'"code":"stage_deadline_exceeded"' in r.body
    prompt = await expected_prompt(backend.requests[0])
    completion = tokens_metric(app, "completion")
    # What came before the deadline (the words the client got), not the whole reply.
    assert completion == len(r.text().split()) > 10
    assert tokens_metric(app, "prompt") == prompt
    cost = prompt * IN + completion * OUT
    assert spent == pytest.approx(cost)
    assert spend_metric(app) == pytest.approx(cost)
    assert charges.tokens == [prompt + completion]


class Phrases(Scripted):
    """A backend that sends five tokens in each event, as Anthropic's, Gemini's and
    Bedrock's text deltas do, and never its usage (the client leaves first)."""

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        self.requests.append(request)
        for _ in range(WORDS):
            await trio.sleep(self.gap)
            await send.send(Delta(text=" the sea and the sky"))  # 5 tokens, one event
            self.sent += 1


@pytest.mark.parametrize("api", list(APIS))
async def test_a_cut_reply_of_several_tokens_an_event_is_billed_for_its_tokens(
    tmp_path: Path, api: str
) -> None:
    backend = Phrases()
    app = billing_app(tmp_path, backend)
    charges = Charges(app)
    path, body = APIS[api]
    async with running(app) as client:
        async with client.open("POST", path, json_body=body, headers=auth(KEY_DAN)) as ex:
            await ex.wait_for_bytes(12)
            ex.disconnect()
        row = await check_one_figure(app, client, tmp_path, charges)
    assert row["usage_source"] == "counted"
    # The delivered text's tokens as the gateway counts prompts: five an event, not one.
    events = row["completion_tokens"] / 5
    assert events == int(events)
    assert 5 <= events <= backend.sent <= 20
