"""Runaway generation: a route's caps on tokens, bytes and stream time, a tenant's cap on streams."""

from __future__ import annotations

import json
from typing import Any

import trio
import trio.testing

from aiserve_trio.adapters.base import Adapter, Delta, DeltaSink, InferenceRequest, Usage
from aiserve_trio.adapters.retry import Progress
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client, Response, chat_body
from .authcfg import KEY_A, KEY_ADMIN, KEY_B, auth_app, bearer
from .conftest import make_config
from .fakes import RecordingAdapter

WORDS = " ".join(f"w{i}" for i in range(200))


class Runaway(Adapter):
    """A backend that ignores the token limit it is sent: 200 words, one every 10 ms."""

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        self.asked = request.max_tokens
        for i in range(200):
            await trio.sleep(0.01)
            await send.send(Delta(text=f" w{i}"))
        await send.send(Delta(finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=200)))


def capped_app(caps: str) -> tuple[App, RecordingAdapter]:
    cfg = make_config(
        f"""
[adapters.runaway]
kind = "mock"
models = ["runaway"]

[[routes]]
path = "/v1/capped"
adapter = "runaway"
{caps}
"""
    )
    rec = RecordingAdapter(Runaway("runaway", ["runaway"]))
    return App(cfg, adapters={"runaway": rec}), rec


async def post(app: App, stream: bool = True) -> Response:
    body = {"model": "runaway", "messages": [{"role": "user", "content": "go"}], "stream": stream}
    return await Client(app).request("POST", "/v1/capped", json_body=body)


def final(r: Response) -> tuple[str, Any]:
    events = [json.loads(e) for e in r.events() if e != "[DONE]"]
    last = events[-1]
    if "error" in last:
        return "error", last["error"]
    finishes = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")]
    return "finish", finishes[-1]


async def test_the_token_cap_goes_upstream_and_is_enforced_when_ignored(autojump_clock: Any) -> None:
    app, rec = capped_app("max_tokens = 5")
    r = await post(app)
    assert rec.requests[0].max_tokens == 5  # what the backend was told
    assert final(r) == ("finish", "length")
    assert r.text().split() == ["w0", "w1", "w2", "w3", "w4"]
    assert r.events()[-1] == "[DONE]"
    assert rec.cancelled_at is not None  # the upstream was stopped, not read to its end
    assert trio.current_time() < 1.0  # 200 words would take 2 s
    text = app.metrics.render().decode()
    assert 'aiserve_reply_caps_total{cap="max_tokens",route="v1_capped"} 1.0' in text


async def test_a_client_limit_under_the_cap_wins(autojump_clock: Any) -> None:
    app, rec = capped_app("max_tokens = 50")
    body = {"model": "runaway", "messages": [{"role": "user", "content": "go"}], "max_tokens": 3}
    r = await Client(app).request("POST", "/v1/capped", json_body=body)
    assert rec.requests[0].max_tokens == 3
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["choices"][0]["message"]["content"].split() == ["w0", "w1", "w2"]


async def test_the_bytes_cap_ends_the_stream_with_an_error_naming_it(autojump_clock: Any) -> None:
    app, rec = capped_app("max_reply_bytes = 40")
    r = await post(app)
    kind, err = final(r)
    assert kind == "error"
    assert (err["code"], err["param"]) == ("max_reply_bytes", "max_reply_bytes")
    assert r.events()[-1] == "[DONE]"
    assert len(r.text().encode()) <= 40 + 8  # the delta that crossed the line, no more
    assert rec.cancelled_at is not None
    assert 'cap="max_reply_bytes"' in app.metrics.render().decode()


async def test_the_stream_time_cap_ends_the_stream_with_an_error_naming_it(autojump_clock: Any) -> None:
    app, rec = capped_app("max_stream_s = 0.25")
    t0 = trio.current_time()
    r = await post(app)
    kind, err = final(r)
    assert kind == "error"
    assert err["code"] == "max_stream_s"
    assert 0.25 <= trio.current_time() - t0 < 0.4
    assert rec.cancelled_at is not None
    # Not streamed: nothing was sent yet, so the cap is an HTTP status.
    r = await post(app, stream=False)
    assert (r.status, r.json()["error"]["code"]) == (502, "max_stream_s")


async def test_a_tenant_holds_at_most_its_share_of_streams(autojump_clock: Any) -> None:
    app = auth_app(tenant_max_streams="1", ttft_ms="1000")
    client = Client(app)
    # Keys verified once first: scrypt runs in a thread, which a parked task waits on.
    for key in (KEY_A, KEY_B, KEY_ADMIN):
        assert (await client.request("GET", "/v1/models", headers=bearer(key))).status == 200
    async with client.open(
        "POST", "/v1/chat/completions", json_body=chat_body(stream=True), headers=bearer(KEY_A)
    ) as first:
        await trio.testing.wait_all_tasks_blocked()
        same_tenant = await client.chat(chat_body(stream=True), headers=bearer(KEY_ADMIN))
        assert same_tenant.status == 429
        assert same_tenant.json()["error"]["code"] == "tenant_stream_limit"
        assert same_tenant.headers["retry-after"] == "1"
        other_tenant = await client.chat(chat_body(stream=True), headers=bearer(KEY_B))
        assert other_tenant.status == 200
    assert first.response.status == 200
    again = await client.chat(chat_body(stream=True), headers=bearer(KEY_ADMIN))
    assert again.status == 200
    assert app.gate.admission.by_tenant == {}
