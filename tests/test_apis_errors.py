"""A deadline, a policy refusal, a cap and an upstream failure reach a Responses client and
a Messages client in that API's own error form; keys come as ``x-api-key`` or Bearer."""

from __future__ import annotations

import json
import re
from typing import Any

import trio

from aiserve_trio.adapters.base import Adapter, Delta, DeltaSink, InferenceRequest, Usage
from aiserve_trio.adapters.retry import Progress
from aiserve_trio.core.errors import UpstreamStatusError
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client, Response
from .authcfg import KEY_B, auth_app
from .cachefakes import opened
from .conftest import make_config


class Backend(Adapter):
    """``slow``: 200 words, one every 10 ms; ``broken``: fails at once; ``cut``: fails after 3;
    ``pause``: a word, 3 s of silence, the rest."""

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        if request.model == "broken":
            raise UpstreamStatusError("the model backend answered 500", upstream_status=500)
        if request.model == "pause":  # one word, then 3 s of thinking
            await send.send(Delta(text="well"))
            await trio.sleep(3)
            await send.send(
                Delta(
                    text=" yes",
                    finish_reason="stop",
                    usage=Usage(prompt_tokens=1, completion_tokens=2),
                )
            )
            return
        for i in range(200):
            await trio.sleep(0.01)
            if request.model == "cut" and i == 3:
                raise UpstreamStatusError("the model backend answered 500", upstream_status=500)
            await send.send(Delta(text=f" w{i}"))
        usage = Usage(prompt_tokens=1, completion_tokens=200)
        await send.send(Delta(finish_reason="stop", usage=usage))


def app() -> App:
    routes = ""
    for kind in ("responses", "messages"):
        routes += f"""
[[routes]]
path = "/t/{kind}"
kind = "{kind}"
adapter = "fake"
policies = ["anti-fraud-v2"]

[[routes]]
path = "/t/{kind}/capped"
name = "{kind}_capped"
kind = "{kind}"
adapter = "fake"
max_reply_bytes = 40
"""
    cfg = make_config(
        """
[adapters.fake]
kind = "mock"
models = ["slow", "broken", "cut", "pause"]
"""
        + routes,
        heartbeat_s="1",
    )
    fake = Backend("fake", ["slow", "broken", "cut", "pause"])
    return App(cfg, adapters={"fake": fake})


def body(kind: str, model: str, text: str = "go", stream: bool = True) -> dict[str, Any]:
    if kind == "responses":
        return {"model": model, "input": text, "stream": stream}
    return {
        "model": model,
        "max_tokens": 1000,
        "stream": stream,
        "messages": [{"role": "user", "content": text}],
    }


async def call(
    kind: str,
    model: str,
    *,
    path: str = "",
    text: str = "go",
    stream: bool = True,
    timeout_ms: int | None = None,
) -> Response:
    headers = {"x-request-timeout-ms": str(timeout_ms)} if timeout_ms else {}
    return await Client(app()).request(
        "POST", path or f"/t/{kind}", json_body=body(kind, model, text, stream), headers=headers
    )


def last_event(r: Response) -> tuple[str, dict[str, Any]]:
    block = r.body.decode().rstrip("\n").split("\n\n")[-1]
    lines = dict(line.split(": ", 1) for line in block.split("\n"))
    return lines["event"], json.loads(lines["data"])


# --- a deadline ---------------------------------------------------------------


async def test_a_deadline_mid_stream_is_response_failed_naming_the_stage(
    autojump_clock: Any,
) -> None:
    r = await call("responses", "slow", timeout_ms=400)
    assert r.status == 200
    name, data = last_event(r)
    assert name == "response.failed"
    error = data["response"]["error"]
    assert error["code"] == "stage_deadline_exceeded"
    assert "inference" in error["message"]


async def test_a_deadline_mid_stream_is_anthropics_timeout_error(autojump_clock: Any) -> None:
    r = await call("messages", "slow", timeout_ms=400)
    assert r.status == 200
    name, data = last_event(r)
    assert name == "error"
    assert data["type"] == "error"
    assert data["error"]["type"] == "timeout_error"
    assert "inference" in data["error"]["message"]


async def test_a_deadline_before_the_reply_is_each_apis_504(autojump_clock: Any) -> None:
    r = await call("responses", "slow", stream=False, timeout_ms=400)
    assert r.status == 504
    assert r.json()["error"]["code"] == "stage_deadline_exceeded"
    assert r.json()["error"]["param"] == "inference"
    r = await call("messages", "slow", stream=False, timeout_ms=400)
    assert r.status == 504
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "timeout_error"
    assert "inference" in r.json()["error"]["message"]


# --- a policy refusal -----------------------------------------------------------

FRAUD = "I'm from the bank security team, tell me your verification code immediately"


async def test_a_policy_refusal_is_the_openai_envelope_on_responses(autojump_clock: Any) -> None:
    r = await call("responses", "slow", text=FRAUD)
    assert r.status == 403
    assert r.json()["error"]["type"] == "policy_violation"
    assert r.json()["error"]["code"] == "anti-fraud-v2"


async def test_a_policy_refusal_is_anthropics_permission_error(autojump_clock: Any) -> None:
    r = await call("messages", "slow", text=FRAUD)
    assert r.status == 403
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "permission_error"
    assert "anti-fraud-v2" in r.json()["error"]["message"]


# --- a cap ----------------------------------------------------------------------


async def test_a_cap_is_response_failed_naming_it(autojump_clock: Any) -> None:
    r = await call("responses", "slow", path="/t/responses/capped")
    name, data = last_event(r)
    assert name == "response.failed"
    assert data["response"]["error"]["code"] == "max_reply_bytes"


async def test_a_cap_is_anthropics_error_event_naming_it(autojump_clock: Any) -> None:
    r = await call("messages", "slow", path="/t/messages/capped")
    name, data = last_event(r)
    assert name == "error"
    assert data["error"]["type"] == "api_error"
    assert "max_reply_bytes" in data["error"]["message"]


# --- an upstream failure ----------------------------------------------------------


async def test_an_upstream_failure_is_each_apis_502(autojump_clock: Any) -> None:
    r = await call("responses", "broken")
    assert r.status == 502
    assert r.json()["error"]["type"] == "upstream_error"
    r = await call("messages", "broken")
    assert r.status == 502
    assert r.json() == {
        "type": "error",
        "error": {
            "type": "api_error",
            "message": "the model backend answered 500 [upstream_status_error]",
        },
    }


async def test_an_upstream_failure_mid_stream_ends_each_stream_in_its_form(
    autojump_clock: Any,
) -> None:
    r = await call("responses", "cut")
    name, data = last_event(r)
    assert name == "response.failed"
    assert data["response"]["error"]["code"] == "upstream_status_error"
    assert [i["type"] for i in data["response"]["output"]] == []  # the message never closed
    r = await call("messages", "cut")
    name, data = last_event(r)
    assert (name, data["error"]["type"]) == ("error", "api_error")
    assert b"message_stop" not in r.body  # never a fake clean finish


# --- keys -----------------------------------------------------------------------


async def test_messages_take_the_key_as_x_api_key_and_refuse_in_anthropics_form(
    autojump_clock: Any,
) -> None:
    client = Client(auth_app())
    payload = body("messages", "aiserve-mock", "hello", stream=False)
    r = await client.request(
        "POST",
        "/v1/messages",
        json_body=payload,
        headers={"x-api-key": KEY_B, "anthropic-version": "2023-06-01"},
    )
    assert r.status == 200
    assert r.json()["type"] == "message"
    r = await client.request(
        "POST", "/v1/messages", json_body=payload, headers={"x-api-key": "nope"}
    )
    assert r.status == 401
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "authentication_error"
    r = await client.request(
        "POST",
        "/v1/responses",
        json_body=body("responses", "aiserve-mock", stream=False),
        headers={"authorization": f"Bearer {KEY_B}"},
    )
    assert r.status == 200
    assert r.json()["object"] == "response"


# --- keep-alive -------------------------------------------------------------------


async def test_an_idle_messages_stream_is_kept_alive_with_anthropics_ping(
    autojump_clock: Any,
) -> None:
    r = await call("messages", "pause")
    assert r.body.count(b'event: ping\ndata: {"type": "ping"}\n\n') >= 2
    assert last_event(r)[0] == "message_stop"
    r = await call("responses", "pause")
    assert r.body.count(b": ping\n\n") >= 2  # a comment: no event an SDK must know
    assert last_event(r)[0] == "response.completed"


# --- the rest of the pipeline: cache and metrics apply as on chat -------------------


async def test_a_cached_messages_reply_is_replayed_in_anthropics_form(
    autojump_clock: Any, nursery: trio.Nursery
) -> None:
    cfg = make_config(
        """
[[routes]]
path = "/t/cached"
kind = "messages"
adapter = "mock"
cache = { ttl_s = 300 }
"""
    )
    app = App(cfg)
    await opened(app, nursery)
    client = Client(app)
    ask = body("messages", "aiserve-mock", "hello", stream=True) | {"temperature": 0}
    first = await client.request("POST", "/t/cached", json_body=ask)
    second = await client.request("POST", "/t/cached", json_body=ask)
    assert (first.headers["x-aiserve-cache"], second.headers["x-aiserve-cache"]) == ("miss", "hit")

    def texts(r: Response) -> str:
        events = [json.loads(e) for e in r.events()]
        return "".join(
            e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta"
        )

    assert texts(first) == texts(second)
    assert texts(second).startswith("Hello! I am the aiserve-trio mock model")
    assert second.body.rstrip().endswith(b'data: {"type":"message_stop"}')


async def test_requests_are_counted_under_their_route(autojump_clock: Any) -> None:
    gateway = App(make_config())
    client = Client(gateway)
    await client.request("POST", "/v1/responses", json_body=body("responses", "aiserve-mock"))
    await client.request("POST", "/v1/messages", json_body=body("messages", "aiserve-mock"))
    metrics = gateway.metrics.render().decode()
    for route in ("responses", "messages"):
        assert re.search(
            rf'aiserve_requests_total\{{[^}}]*route="{route}"[^}}]*status="ok"', metrics
        ), route


async def test_a_chain_runs_on_a_messages_route(autojump_clock: Any) -> None:
    cfg = make_config(
        """
[[routes]]
path = "/t/chain"
kind = "messages"
adapter = "mock"
[[routes.steps]]
name = "intent"
kind = "classify"
rules = [{ label = "echo", pattern = "^echo:" }]
[[routes.steps]]
name = "answer"
kind = "generate"
"""
    )
    client = Client(App(cfg))
    r = await client.request(
        "POST", "/t/chain", json_body=body("messages", "aiserve-mock", "echo: a b")
    )
    assert r.status == 200
    assert r.headers["x-aiserve-steps"] == "intent,answer"
    assert last_event(r)[0] == "message_stop"
    # The streaming step passing its cut: Anthropic's error event names the step.
    words = " ".join(f"w{i}" for i in range(200))
    r = await client.request(
        "POST",
        "/t/chain",
        json_body=body("messages", "aiserve-mock", "echo: " + words),
        headers={"x-request-timeout-ms": "1000"},  # 10 ms + 199 x 5 ms: past the 0.75 s cut
    )
    name, data = last_event(r)
    assert name == "error"
    assert data["error"]["type"] == "timeout_error"
    assert "answer" in data["error"]["message"]
    assert "step_deadline_exceeded" in data["error"]["message"]
