"""Policies through the app, in-process on the virtual clock."""

# ruff: noqa: RUF001

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import trio

from aiserve_trio.adapters.base import DeltaSink, InferenceRequest
from aiserve_trio.adapters.mock import MockAdapter
from aiserve_trio.adapters.retry import Progress
from aiserve_trio.config import MockAdapterConfig, load_config
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client, chat_body

ADVICE = "/v1/financial-advice"
ROUTES = f"""
[[routes]]
path = "{ADVICE}"
name = "advice"
adapter = "mock"
default_model = "aiserve-mock"
policies = ["anti-fraud-v2", "gdpr-redact", "no-rate-figures", "channel-shaping"]

# Output-only redaction, so that the model's reply (the echo) carries the number.
[[routes]]
path = "/v1/out"
adapter = "mock"
default_model = "aiserve-mock"
policies = ["reply-redact"]

[policies.reply-redact]
kind = "gdpr-redact"
input = false
"""
BANK = Path(__file__).resolve().parent.parent / "configs" / "examples" / "bank.toml"


class CountingMock(MockAdapter):
    """The mock model, counting the inference calls it gets and what it was sent.

    It counts tries (``stream`` is the base's, and final); the mock never retries,
    so that is one per call.
    """

    def __init__(self) -> None:
        super().__init__("mock", MockAdapterConfig(ttft_ms=10, inter_token_ms=5))
        self.calls: list[InferenceRequest] = []

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        self.calls.append(request)
        await super().attempt(request, send, progress)


async def post(app: App, text: str, path: str = ADVICE, **headers: str) -> tuple[int, str, dict]:  # type: ignore[type-arg]
    resp = await Client(app).request(
        "POST", path, json_body=chat_body(text, stream=True), headers=headers
    )
    if resp.status != 200:
        return resp.status, "", resp.json()
    return resp.status, resp.text(), {}


def actions(app: App) -> dict[tuple[str, str], float]:
    out = {}
    for fam in app.metrics.registry.collect():
        if fam.name == "policy_actions":
            for s in fam.samples:
                if s.name == "policy_actions_total":
                    out[(s.labels["policy"], s.labels["action"])] = s.value
    return out


async def test_card_split_over_tokens_arrives_redacted(
    make_app: Callable[..., App], autojump_clock: trio.abc.Clock
) -> None:
    mock = CountingMock()
    app = make_app(ROUTES, adapters={"mock": mock})
    # The mock streams word by word: the number arrives in four deltas.
    status, text, _ = await post(app, "echo: your card 4111 1111 1111 1111 is active", "/v1/out")
    assert status == 200
    assert "4111" in mock.calls[0].messages[-1].text()  # input left alone on this route
    assert text == "your card [CARD] is active"
    assert actions(app) == {("reply_redact", "redacted"): 1.0}
    # With input redaction on, the prompt that reaches the model has no number either.
    _, text, _ = await post(app, "echo: card 4111 1111 1111 1111")
    assert "4111" not in mock.calls[1].messages[-1].text()
    assert text == "card [CARD]"
    assert actions(app)[("gdpr_redact", "redacted")] == 1


async def test_fraud_blocked_403_without_backend_call(
    make_app: Callable[..., App], autojump_clock: trio.abc.Clock
) -> None:
    mock = CountingMock()
    app = make_app(ROUTES, adapters={"mock": mock})
    status, _, body = await post(
        app, "I'm from the bank security team, tell me your verification code immediately"
    )
    assert status == 403
    assert body["error"]["type"] == "policy_violation"
    assert body["error"]["code"] == "anti-fraud-v2"
    assert mock.calls == []
    assert actions(app) == {("anti_fraud_v2", "blocked"): 1.0}


async def test_flagged_request_is_served(
    make_app: Callable[..., App], autojump_clock: trio.abc.Clock
) -> None:
    mock = CountingMock()
    app = make_app(ROUTES, adapters={"mock": mock})
    status, text, _ = await post(app, "echo: What is an OTP?")
    assert (status, text) == (200, "What is an OTP?")
    assert len(mock.calls) == 1
    assert actions(app)[("anti_fraud_v2", "flagged")] == 1


async def test_rate_figure_rewritten_on_regulated_route_only(
    make_app: Callable[..., App], autojump_clock: trio.abc.Clock
) -> None:
    app = make_app(ROUTES)
    _, text, _ = await post(app, "echo: The rate is 3.85% or 年利率4.2% today.")
    assert text == "The rate is [rate available from your adviser] or 年利率以银行公布为准 today."
    _, plain, _ = await post(app, "echo: The rate is 3.85% today.", path="/v1/chat/completions")
    assert plain == "The rate is 3.85% today."
    assert actions(app)[("no_rate_figures", "rewritten")] == 2


async def test_ivr_gets_plain_sentences(
    make_app: Callable[..., App], autojump_clock: trio.abc.Clock
) -> None:
    app = make_app(ROUTES)
    resp = await Client(app).request(
        "POST",
        ADVICE,
        json_body=chat_body(
            "echo: **Good news!** Visit https://bank.example.com/loans 😀 today. Ask us anything.",
            stream=True,
        ),
        headers={"x-channel": "ivr"},
    )
    chunks = [
        c["choices"][0]["delta"].get("content")
        for e in resp.events()
        if e != "[DONE]" and (c := json.loads(e))["choices"]
    ]
    said = [c for c in chunks if c]
    assert "".join(said) == "Good news! Visit the link in our app today. Ask us anything."
    # Every chunk is whole sentences (upstream filters may hand over two at once).
    assert len(said) >= 2
    assert all(c.endswith((". ", "! ", ".")) for c in said)


async def test_bank_example_runs_on_the_mock(autojump_clock: trio.abc.Clock) -> None:
    app = App(load_config(BANK))
    key = "Bearer aik_demo_hEn8rpOr9Rcn00wlo27yMqWGG6cqnbVQ"  # bank.toml's demo key (auth on)
    msg = "echo: mail me at jane@example.com about the 3.85 per cent rate"
    _, text, _ = await post(app, msg, authorization=key)
    assert text == "mail me at [EMAIL] about the [rate available from your adviser] rate"
    status, _, _ = await post(app, "转账到安全账户，警察说你涉嫌洗钱，立即操作", authorization=key)
    assert status == 403
