"""The pipeline by itself (``pipeline.Pipeline.run``): one request's body in, the bytes
its client gets and its ``Outcome`` out -- no app, no gate, no request entry, no server;
the ASGI ``receive`` and ``send`` are two small functions. ``test_pipeline.py`` runs the
same pipeline behind the whole app."""

from __future__ import annotations

import json
from collections.abc import MutableMapping
from typing import Any

import trio
import trio.testing

from aiserve_trio.adapters.mock import MockAdapter
from aiserve_trio.config import MockAdapterConfig
from aiserve_trio.core.budgets import plan
from aiserve_trio.http.responder import Responder
from aiserve_trio.observability.tracing import NOOP_TRACE
from aiserve_trio.runtime.gateway import build_gateway
from aiserve_trio.stages.outcome import NullRequestHook, Outcome
from aiserve_trio.stages.pipeline import Pipeline
from aiserve_trio.stages.types import RequestInfo

from .conftest import make_config
from .fakes import RecordingAdapter


class Outcomes(NullRequestHook):
    def __init__(self) -> None:
        self.seen: list[Outcome] = []

    def request_complete(self, outcome: Outcome) -> None:
        self.seen.append(outcome)


async def serve(
    body: bytes,
) -> tuple[Outcome, list[MutableMapping[str, Any]], Outcomes, RecordingAdapter]:
    """``body`` through a pipeline of its own on the default chat route."""
    config = make_config()
    mock = config.adapters["mock"]
    assert isinstance(mock, MockAdapterConfig)
    adapter = RecordingAdapter(MockAdapter("mock", mock))
    route = build_gateway(config, adapters={"mock": adapter}).generations.current.routes[
        "/v1/chat/completions"
    ]
    hook = Outcomes()
    pipeline = Pipeline(config, None, hook=hook)
    now = trio.current_time()
    d = config.deadline
    info = RequestInfo(
        request_id="chatcmpl-alone",
        route=route,
        budget=plan(
            now, d.default_ms, reserve_ms=d.reserve_ms, min_inference_ms=d.min_inference_ms,
            context=config.budgets.context, inference=config.budgets.inference,
        ),
        created=0,
        channel="api",
        session_id=None,
        tenant="default",
        headers={},
        trace=NOOP_TRACE,
    )  # fmt: skip
    sent: list[MutableMapping[str, Any]] = []

    bodies = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if bodies:
            return bodies.pop()
        await trio.sleep_forever()  # the client stays: nothing more comes
        raise AssertionError("unreachable")

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    outcome = await pipeline.run(info, receive, Responder(send))
    return outcome, sent, hook, adapter


def events(sent: list[MutableMapping[str, Any]]) -> list[str]:
    raw = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]


async def test_a_streamed_request_runs_through_the_four_stages(
    autojump_clock: trio.testing.MockClock,
) -> None:
    body = {
        "model": "aiserve-mock",
        "stream": True,
        "messages": [{"role": "user", "content": "echo: a b c"}],
    }
    outcome, sent, hook, adapter = await serve(json.dumps(body).encode())
    assert sent[0]["type"] == "http.response.start"
    assert sent[0]["status"] == 200
    written = events(sent)
    assert written[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in written[:-1])
    assert text == "a b c"
    # The outcome is what the client got, and the hook is told it once.
    assert (outcome.status, outcome.delivered, outcome.finish_reason) == ("ok", "a b c", "stop")
    assert set(outcome.stages) == {"parse", "context", "inference", "sse"}
    assert outcome.client_writes == len(sent)  # every ASGI send, the head included
    assert hook.seen == [outcome]
    assert adapter.calls == 1


async def test_a_body_that_is_not_json_is_answered_before_any_upstream_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    outcome, sent, hook, adapter = await serve(b"{not json")
    assert sent[0]["status"] == 400
    error = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]
    assert error["code"] == "invalid_json"
    assert (outcome.status, outcome.error_stage) == ("bad_request", "parse")
    assert adapter.calls == 0
    assert hook.seen == [outcome]
