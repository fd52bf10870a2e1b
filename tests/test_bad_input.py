"""Every kind of bad request gets a clear OpenAI error envelope and the right status,
and the server goes on serving."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

import httpx2
import pytest
import trio

from aiserve_trio.adapters.openai import OpenAIAdapter
from aiserve_trio.adapters.settings import OpenAIAdapterConfig
from aiserve_trio.config import parse_config
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client, Response, chat_body
from .conftest import config_text, make_config

CT = {"content-type": "application/json"}
OK_MSG = [{"role": "user", "content": "hi"}]


def js(obj: object) -> bytes:
    return json.dumps(obj).encode()


# (case id, method, path, body, headers, status, type, code, param)
CASES = [
    (
        "malformed json",
        "POST",
        "/v1/chat/completions",
        b'{"messages": [',
        CT,
        400,
        "invalid_request_error",
        "invalid_json",
        None,
    ),
    (
        "empty body",
        "POST",
        "/v1/chat/completions",
        b"",
        CT,
        400,
        "invalid_request_error",
        "invalid_json",
        None,
    ),
    (
        "json array",
        "POST",
        "/v1/chat/completions",
        b"[1, 2]",
        CT,
        400,
        "invalid_request_error",
        "invalid_type",
        None,
    ),
    (
        "invalid utf-8",
        "POST",
        "/v1/chat/completions",
        b'{"messages":[{"role":"user","content":"\xff\xfe"}]}',
        CT,
        400,
        "invalid_request_error",
        "invalid_json",
        None,
    ),
    (
        "missing messages",
        "POST",
        "/v1/chat/completions",
        js({"model": "aiserve-mock"}),
        CT,
        400,
        "invalid_request_error",
        "missing_required_parameter",
        "messages",
    ),
    (
        "messages not a list",
        "POST",
        "/v1/chat/completions",
        js({"messages": "hi"}),
        CT,
        400,
        "invalid_request_error",
        "invalid_type",
        "messages",
    ),
    (
        "wrong role type",
        "POST",
        "/v1/chat/completions",
        js({"messages": [{"role": 1, "content": "x"}]}),
        CT,
        400,
        "invalid_request_error",
        "invalid_type",
        "messages[0].role",
    ),
    (
        "unknown role",
        "POST",
        "/v1/chat/completions",
        js({"messages": [{"role": "wizard", "content": "x"}]}),
        CT,
        400,
        "invalid_request_error",
        "invalid_type",
        "messages[0].role",
    ),
    (
        "stream not bool",
        "POST",
        "/v1/chat/completions",
        js({"messages": OK_MSG, "stream": "yes"}),
        CT,
        400,
        "invalid_request_error",
        "invalid_type",
        "stream",
    ),
    (
        "max_tokens not int",
        "POST",
        "/v1/chat/completions",
        js({"messages": OK_MSG, "max_tokens": "10"}),
        CT,
        400,
        "invalid_request_error",
        "invalid_type",
        "max_tokens",
    ),
    (
        "empty messages",
        "POST",
        "/v1/chat/completions",
        js({"messages": []}),
        CT,
        400,
        "invalid_request_error",
        "empty_array",
        "messages",
    ),
    (
        "too many messages",
        "POST",
        "/v1/chat/completions",
        js({"messages": OK_MSG * 257}),
        CT,
        400,
        "invalid_request_error",
        "too_many_messages",
        "messages",
    ),
    (
        "content too long",
        "POST",
        "/v1/chat/completions",
        js({"messages": [{"role": "user", "content": "x" * 262_145}]}),
        CT,
        400,
        "invalid_request_error",
        "content_too_long",
        "messages[0].content",
    ),
    (
        "last message from assistant",
        "POST",
        "/v1/chat/completions",
        js({"messages": [{"role": "assistant", "content": "x"}]}),
        CT,
        400,
        "invalid_request_error",
        "invalid_last_role",
        "messages[0].role",
    ),
    (
        "max_tokens zero",
        "POST",
        "/v1/chat/completions",
        js({"messages": OK_MSG, "max_tokens": 0}),
        CT,
        400,
        "invalid_request_error",
        "integer_below_min_value",
        "max_tokens",
    ),
    (
        "n = 2",
        "POST",
        "/v1/chat/completions",
        js({"messages": OK_MSG, "n": 2}),
        CT,
        400,
        "invalid_request_error",
        "unsupported_value",
        "n",
    ),
    (
        "temperature 5",
        "POST",
        "/v1/chat/completions",
        js({"messages": OK_MSG, "temperature": 5}),
        CT,
        400,
        "invalid_request_error",
        "decimal_above_max_value",
        "temperature",
    ),
    (
        "max_completion_tokens too high",
        "POST",
        "/v1/chat/completions",
        js({"messages": OK_MSG, "max_completion_tokens": 200_000}),
        CT,
        400,
        "invalid_request_error",
        "integer_above_max_value",
        "max_completion_tokens",
    ),
    (
        "top_p negative",
        "POST",
        "/v1/chat/completions",
        js({"messages": OK_MSG, "top_p": -0.5}),
        CT,
        400,
        "invalid_request_error",
        "decimal_below_min_value",
        "top_p",
    ),
    (
        "five stop sequences",
        "POST",
        "/v1/chat/completions",
        js({"messages": OK_MSG, "stop": ["a", "b", "c", "d", "e"]}),
        CT,
        400,
        "invalid_request_error",
        "array_above_max_length",
        "stop",
    ),
    (
        "message without a role",
        "POST",
        "/v1/chat/completions",
        js({"messages": [{"content": "x"}]}),
        CT,
        400,
        "invalid_request_error",
        "missing_required_parameter",
        "messages[0].role",
    ),
    (
        "tool message without tool_call_id",
        "POST",
        "/v1/chat/completions",
        js({"messages": [{"role": "tool", "content": "x"}]}),
        CT,
        400,
        "invalid_request_error",
        "missing_required_parameter",
        "messages[0].tool_call_id",
    ),
    (
        "unknown model",
        "POST",
        "/v1/chat/completions",
        js({"model": "gpt-9", "messages": OK_MSG}),
        CT,
        404,
        "invalid_request_error",
        "model_not_found",
        "model",
    ),
    (
        "wrong content type",
        "POST",
        "/v1/chat/completions",
        js({"messages": OK_MSG}),
        {"content-type": "text/plain"},
        415,
        "invalid_request_error",
        "unsupported_media_type",
        "Content-Type",
    ),
    (
        "form content type",
        "POST",
        "/v1/chat/completions",
        b"a=b",
        {"content-type": "application/x-www-form-urlencoded"},
        415,
        "invalid_request_error",
        "unsupported_media_type",
        "Content-Type",
    ),
    (
        "declared body too large",
        "POST",
        "/v1/chat/completions",
        b"{}",
        {**CT, "content-length": "8388609"},
        413,
        "invalid_request_error",
        "request_too_large",
        None,
    ),
    (
        "unknown route",
        "POST",
        "/v1/nope",
        js({"messages": OK_MSG}),
        CT,
        404,
        "invalid_request_error",
        "unknown_url",
        None,
    ),
    (
        "wrong method on chat",
        "GET",
        "/v1/chat/completions",
        b"",
        {},
        405,
        "invalid_request_error",
        "method_not_allowed",
        None,
    ),
    (
        "wrong method on models",
        "POST",
        "/v1/models",
        b"",
        {},
        405,
        "invalid_request_error",
        "method_not_allowed",
        None,
    ),
    (
        "bad timeout header",
        "POST",
        "/v1/chat/completions",
        js({"messages": OK_MSG}),
        {**CT, "x-request-timeout-ms": "soon"},
        400,
        "invalid_request_error",
        "invalid_timeout",
        "X-Request-Timeout-Ms",
    ),
    (
        "unknown channel",
        "POST",
        "/v1/chat/completions",
        js({"messages": OK_MSG}),
        {**CT, "x-channel": "fax"},
        400,
        "invalid_request_error",
        "invalid_channel",
        "X-Channel",
    ),
    (
        "bad session id",
        "POST",
        "/v1/chat/completions",
        js({"messages": OK_MSG}),
        {**CT, "x-session-id": "a b*{}"},
        400,
        "invalid_request_error",
        "invalid_session_id",
        "X-Session-Id",
    ),
    (
        "session id too long",
        "POST",
        "/v1/chat/completions",
        js({"messages": OK_MSG}),
        {**CT, "x-session-id": "s" * 129},
        400,
        "invalid_request_error",
        "invalid_session_id",
        "X-Session-Id",
    ),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "headers", "status", "type_", "code", "param"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
async def test_bad_request_gets_an_envelope_and_the_server_keeps_serving(
    client, method, path, body, headers, status, type_, code, param, autojump_clock
):
    r = await client.request(method, path, body=body, headers=headers)
    assert r.status == status, r.body
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == type_
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    assert err["message"]
    assert "Traceback" not in err["message"]
    if status == 405:
        assert r.headers["allow"] in ("GET", "POST")
    ok = await client.chat(chat_body("echo: still here"))
    assert ok.status == 200
    assert ok.json()["choices"][0]["message"]["content"] == "still here"


async def test_oversized_body_is_refused_while_reading(make_app, autojump_clock):
    # No Content-Length (chunked): 20 parts of 100 kB against a 1 MiB limit.
    text = config_text().replace("max_body_bytes = 8388608", "max_body_bytes = 1048576")
    app = make_app(config=parse_config(text, source="<test>"))
    parts = [b"x" * 100_000] * 20
    async with Client(app).open("POST", "/v1/chat/completions", body=parts, headers=CT) as ex:
        await ex.done.wait()
    assert ex.response.status == 413
    assert ex.response.json()["error"]["code"] == "request_too_large"
    assert ex.parts_read <= 12  # stopped at the limit, not after buffering all 2 MB


async def test_multipart_text_content_is_accepted(client, autojump_clock):
    body = {
        "model": "aiserve-mock",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "echo: x y"}]}],
    }
    r = await client.chat(body)
    assert r.json()["choices"][0]["message"]["content"] == "x y"


async def test_fields_the_backend_cannot_carry_are_refused_not_dropped(client, autojump_clock):
    # The mock acts on seed and tools; it has no use for a frequency penalty,
    # and a gateway that dropped it would change the request's meaning unsaid.
    r = await client.chat(chat_body("echo: ok", tools=[], seed=3))
    assert r.status == 200
    r = await client.chat(chat_body("echo: ok", frequency_penalty=0.5, seed=3))
    assert r.status == 400
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("frequency_penalty", "unsupported_field")


# --- values every provider refuses (issue 51, item 4) --------------------------------
# Each went to the backend, whose 400 came back as a 502 api_error (retried by the SDKs);
# now the gateway refuses it first, in the client's own API envelope.

MSG = {"model": "aiserve-mock", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
TOOL_USE_AS_STRING = [
    {"role": "user", "content": "weather?"},
    {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": '{"city": "Oslo"}'}],
    },
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sun"}]},
]


def image(source: dict[str, object]) -> list[dict[str, object]]:
    return [{"role": "user", "content": [{"type": "image", "source": source}]}]


def b64(media_type: object, data: str = "aGVsbG8=") -> dict[str, object]:
    return {"type": "base64", "media_type": media_type, "data": data}


def user_part(part: dict[str, object]) -> list[dict[str, object]]:
    return [{"role": "user", "content": [{"type": "input_text", "text": "look"}, part]}]


RESP = {"model": "aiserve-mock", "input": "hi"}
CRLF_NAME = "get_weather\r\nX-Injected: 1"
LONG_NAME = "f" * 10_000

# (case id, path, body, param)
INVALID_VALUES = [
    ("messages: schema a string", "/v1/messages",
     {**MSG, "tools": [{"name": "f", "input_schema": '{"type": "object"}'}]},
     "tools[0].input_schema"),
    ("messages: schema a list", "/v1/messages",
     {**MSG, "tools": [{"name": "f", "input_schema": [{"type": "object"}]}]},
     "tools[0].input_schema"),
    ("messages: tool_use.input a string", "/v1/messages",
     {**MSG, "messages": TOOL_USE_AS_STRING}, "messages[1].content[0].input"),
    ("messages: image data not base64", "/v1/messages",
     {**MSG, "messages": image(b64("image/png", "<script>not base64</script>"))},
     "messages[0].content[0].source.data"),
    ("messages: media_type an object", "/v1/messages",
     {**MSG, "messages": image(b64({"type": "image/png"}))},
     "messages[0].content[0].source.media_type"),
    ("messages: media_type text/html", "/v1/messages",
     {**MSG, "messages": image(b64("text/html"))},
     "messages[0].content[0].source.media_type"),
    ("messages: javascript document url", "/v1/messages",
     {**MSG, "messages": [{"role": "user", "content": [
         {"type": "document", "source": {"type": "url", "url": "javascript:alert(1)"}}]}]},
     "messages[0].content[0].source.url"),
    ("messages: top_k -5", "/v1/messages", {**MSG, "top_k": -5}, "top_k"),
    ("messages: budget_tokens true", "/v1/messages",
     {**MSG, "thinking": {"type": "enabled", "budget_tokens": True}},
     "thinking.budget_tokens"),
    ("messages: tool name with CRLF", "/v1/messages",
     {**MSG, "tools": [{"name": CRLF_NAME, "input_schema": {"type": "object"}}]},
     "tools[0].name"),
    ("messages: tool name of 10,000 characters", "/v1/messages",
     {**MSG, "tools": [{"name": LONG_NAME, "input_schema": {"type": "object"}}]},
     "tools[0].name"),
    ("responses: schema a string", "/v1/responses",
     {**RESP, "tools": [{"type": "function", "name": "f", "parameters": "{}"}]},
     "tools[0].parameters"),
    ("responses: schema a list", "/v1/responses",
     {**RESP, "tools": [{"type": "function", "name": "f", "parameters": []}]},
     "tools[0].parameters"),
    ("responses: image data not base64", "/v1/responses",
     {**RESP, "input": user_part(
         {"type": "input_image", "image_url": "data:image/png;base64,%%%not base64%%%"})},
     "input[0].content[1].image_url"),
    ("responses: image of type text/html", "/v1/responses",
     {**RESP, "input": user_part(
         {"type": "input_image", "image_url": "data:text/html;base64,PGI+aGk8L2I+"})},
     "input[0].content[1].image_url"),
    ("responses: javascript image url", "/v1/responses",
     {**RESP, "input": user_part({"type": "input_image", "image_url": "javascript:alert(1)"})},
     "input[0].content[1].image_url"),
    ("responses: top_logprobs 1000", "/v1/responses", {**RESP, "top_logprobs": 1000},
     "top_logprobs"),
    ("responses: reasoning.effort ludicrous", "/v1/responses",
     {**RESP, "reasoning": {"effort": "ludicrous"}}, "reasoning.effort"),
    ("responses: tool name with CRLF", "/v1/responses",
     {**RESP, "tools": [{"type": "function", "name": CRLF_NAME, "parameters": {}}]},
     "tools[0].name"),
    ("responses: tool name of 10,000 characters", "/v1/responses",
     {**RESP, "tools": [{"type": "function", "name": LONG_NAME, "parameters": {}}]},
     "tools[0].name"),
    ("chat: schema a string", "/v1/chat/completions",
     chat_body("hi", tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]),
     "tools[0].function.parameters"),
    ("chat: schema a list", "/v1/chat/completions",
     chat_body("hi", tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
     "tools[0].function.parameters"),
    ("chat: top_logprobs 1000", "/v1/chat/completions",
     chat_body("hi", logprobs=True, top_logprobs=1000), "top_logprobs"),
    ("chat: reasoning_effort ludicrous", "/v1/chat/completions",
     chat_body("hi", reasoning_effort="ludicrous"), "reasoning_effort"),
    ("chat: tool name with CRLF", "/v1/chat/completions",
     chat_body("hi", tools=[{"type": "function", "function": {"name": CRLF_NAME}}]),
     "tools[0].function.name"),
    ("chat: tool name of 10,000 characters", "/v1/chat/completions",
     chat_body("hi", tools=[{"type": "function", "function": {"name": LONG_NAME}}]),
     "tools[0].function.name"),
]  # fmt: skip


def error_of(path: str, r: Response) -> tuple[str, str | None, str | None]:
    """(message, param, code) of an error in the envelope of ``path``'s API, after
    checking it is that envelope."""
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    if path == "/v1/messages":  # Anthropic's: no param or code fields, both in the message
        assert set(body) == {"type", "error"}
        assert body["type"] == "error"
        assert set(body["error"]) == {"type", "message"}
        assert body["error"]["type"] == "invalid_request_error"
        return body["error"]["message"], None, None
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    return err["message"], err["param"], err["code"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [c[1:] for c in INVALID_VALUES],
    ids=[c[0] for c in INVALID_VALUES],
)
async def test_a_value_the_providers_refuse_is_a_400_in_the_apis_envelope(
    client, path, body, param, autojump_clock
):
    r = await client.request("POST", path, json_body=body)
    assert r.status == 400, r.body
    message, got_param, code = error_of(path, r)
    if path == "/v1/messages":
        assert param in message, message
        assert "[invalid_value]" in message, message
    else:
        assert (got_param, code) == (param, "invalid_value"), message
    assert "Traceback" not in message
    assert "\r\n" not in message
    ok = await client.chat(chat_body("echo: still here"))
    assert ok.status == 200


# --- a backend's refusal is the client's 400 (issue 51, item 4) ----------------------

#: What OpenAI answers a tool name with a dot (the gateway lets dots through: other
#: backends take them).
REFUSAL = {
    "error": {
        "message": "Invalid 'tools[0].function.name': string does not match pattern. "
        "Expected a string that matches the pattern '^[a-zA-Z0-9_-]+$'.",
        "type": "invalid_request_error",
        "param": "tools[0].function.name",
        "code": "invalid_value",
    }
}
DOTTED = {"name": "get.weather", "parameters": {"type": "object"}}


def refusing_app(wire: Literal["chat", "responses"]) -> tuple[App, list[httpx2.Request]]:
    """The default config, its ``mock`` adapter an OpenAI-compatible backend (speaking
    ``wire``) that refuses every request with OpenAI's 400; and the requests it got."""
    seen: list[httpx2.Request] = []

    def handler(req: httpx2.Request) -> httpx2.Response:
        seen.append(req)
        return httpx2.Response(400, json=REFUSAL)

    cfg = OpenAIAdapterConfig(
        base_url="http://upstream.test/v1", models=["aiserve-mock"], wire=wire
    )
    adapter = OpenAIAdapter("mock", cfg, transport=httpx2.MockTransport(handler))
    return App(make_config(), adapters={"mock": adapter}), seen


@asynccontextmanager
async def serving(app: App) -> AsyncIterator[Client]:
    async with trio.open_nursery() as nursery:
        await app.startup(nursery)
        try:
            yield Client(app)
        finally:
            await app.shutdown()
            nursery.cancel_scope.cancel()


async def test_a_backends_400_is_the_clients_400_in_its_apis_envelope(autojump_clock):
    app, seen = refusing_app("chat")
    requests = [
        ("/v1/chat/completions", chat_body("hi", tools=[{"type": "function", "function": DOTTED}])),
        ("/v1/responses", {**RESP, "tools": [{"type": "function", **DOTTED}]}),
        ("/v1/messages", {**MSG, "tools": [{"name": "get.weather", "input_schema": {}}]}),
    ]
    async with serving(app) as client:
        for path, body in requests:
            before = len(seen)
            r = await client.request("POST", path, json_body=body)
            # A 502 api_error was retried twice by the SDKs and counted against the backend.
            assert r.status == 400, (path, r.body)
            assert len(seen) == before + 1, "a refusal is not retried"
            message, _, _ = error_of(path, r)
            assert REFUSAL["error"]["message"] in message
            if path != "/v1/messages":
                assert r.json() == REFUSAL  # the provider's own error, field for field


async def test_on_a_native_route_the_providers_400_passes_as_it_sent_it(autojump_clock):
    app, seen = refusing_app("responses")
    async with serving(app) as client:
        body = {**RESP, "tools": [{"type": "function", **DOTTED}]}
        r = await client.request("POST", "/v1/responses", json_body=body)
    assert len(seen) == 1
    assert seen[0].url.path == "/v1/responses"  # natively
    assert r.status == 400, r.body
    assert r.json() == REFUSAL
