"""Every kind of bad request gets a clear OpenAI error envelope and the right status,
and the server goes on serving."""

from __future__ import annotations

import json

import pytest

from aiserve_trio.config import parse_config

from .asgi_client import Client, chat_body
from .conftest import config_text

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
