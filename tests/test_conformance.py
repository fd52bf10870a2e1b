"""Conformance: every field and content part a client sends reaches the backend as sent.

The gateway runs under the real hypercorn binary in front of a real aiserve-sim,
which records every request body it receives (``GET /sim/requests``). For each
request shape below, streamed and not, the body that arrived upstream is compared
with the body the client sent: byte for byte for every field the gateway does not
own, and as documented for the ones it does (``model``, ``stream``,
``stream_options``). The WebSocket adapter carries the fields its protocol has
and refuses the others with a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import msgspec
import pytest

from .stack import stack as stack

pytestmark = pytest.mark.slow

PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAcCBlCwAAAABJRU5ErkJggg=="
WAV = "UklGRiQAAABXQVZFZm10IBAAAAABAAEAQB8AAEAfAAABAAgAZGF0YQAAAAA="
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather by city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
            "strict": True,
        },
    }
]
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"answer": {"type": "string"}, "n": {"type": "integer"}},
            "required": ["answer", "n"],
            "additionalProperties": False,
        },
    },
}
CALL = {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}

#: name -> (extra top-level fields, messages); each is sent streamed and not.
SHAPES: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {
    "tools": ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, []),
    "named tool choice": (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        [],
    ),
    "json_object": ({"response_format": {"type": "json_object"}}, []),
    "json_schema": ({"response_format": SCHEMA}, []),
    "sampling": (
        {
            "seed": 42,
            "temperature": 0.70,
            "top_p": 0.9,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.25,
            "logit_bias": {"50256": -100},
            "stop": ["\n\n", "END"],
            "max_completion_tokens": 64,
        },
        [],
    ),
    "logprobs": ({"logprobs": True, "top_logprobs": 2}, []),
    "reasoning": ({"reasoning_effort": "high"}, []),
    "audio out": ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, []),
    "prediction and more": (
        {
            "prediction": {"type": "content", "content": "hello"},
            "service_tier": "default",
            "store": False,
            "user": "u-42",
            "metadata": {"purpose": "conformance"},
            "stream_options": {"include_usage": False, "include_obfuscation": True},
        },
        [],
    ),
    "a field unknown today": ({"x_future_field": {"nested": [1, 2.50, None, "é"]}}, []),
    "content parts": (
        {},
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look at these"},
                    {"type": "image_url", "image_url": {"url": PNG, "detail": "low"}},
                    {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                    {"type": "input_audio", "input_audio": {"data": WAV, "format": "wav"}},
                    {"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBERi0=", "filename": "a.pdf"}},
                ],
            }
        ],
    ),
    "tool round trip": (
        {"tools": TOOLS},
        [
            {"role": "user", "content": "weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_abc", "content": '{"temp": -3}'},
        ],
    ),
}
#: What the WebSocket protocol carries (the adapter's capabilities).
WS_OK = {"named tool choice", "json_object", "json_schema", "reasoning", "tool round trip"}
WS_REFUSED = {
    "tools": "parallel_tool_calls",
    "sampling": "presence_penalty",
    "logprobs": "logprobs",
    "audio out": "modalities",
    "prediction and more": "prediction",
    "a field unknown today": "x_future_field",
    "content parts": "messages[0].content[1]",
}


def sent_body(extra: dict[str, Any], messages: list[dict[str, Any]], stream: bool) -> bytes:
    msgs = messages or [{"role": "user", "content": "hello there"}]
    # json.dumps with its default spacing: bytes a re-encoding would not reproduce.
    return json.dumps({"model": "sim-model", "messages": msgs, "stream": stream, **extra}).encode()


def last_upstream(http: httpx.Client, sim: str) -> dict[str, Any]:
    last: dict[str, Any] = http.get(f"{sim}/sim/requests").json()["requests"][-1]
    return last


def raw_fields(body: bytes | str) -> dict[str, Any]:
    """Each top-level field's bytes; ``messages`` as the bytes of each message."""
    text = body.encode() if isinstance(body, str) else body
    fields: dict[str, Any] = {
        k: bytes(v) for k, v in msgspec.json.decode(text, type=dict[str, msgspec.Raw]).items()
    }
    if "messages" in fields:
        items = msgspec.json.decode(fields["messages"], type=list[msgspec.Raw])
        fields["messages"] = [bytes(m) for m in items]
    return fields


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_what_the_client_sent_is_what_the_backend_got(
    stack: tuple[str, str], shape: str, stream: bool
) -> None:
    base, sim = stack
    extra, messages = SHAPES[shape]
    body = sent_body(extra, messages, stream)
    with httpx.Client(timeout=30) as http:
        r = http.post(f"{base}/v1/up", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        got = last_upstream(http, sim)
    assert got["path"] == "/v1/chat/completions"
    sent, arrived = raw_fields(body), raw_fields(got["body"])
    for key, value in sent.items():
        if key in ("stream", "stream_options"):
            continue
        assert arrived[key] == value, key  # byte for byte
    assert json.loads(arrived["stream"]) is True
    opts = json.loads(arrived["stream_options"])
    assert opts["include_usage"] is True
    assert {k: v for k, v in opts.items() if k != "include_usage"} == {
        k: v for k, v in extra.get("stream_options", {}).items() if k != "include_usage"
    }
    assert set(arrived) <= set(sent) | {"stream", "stream_options"}  # nothing added


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("shape", sorted(WS_OK | set(WS_REFUSED)))
def test_the_websocket_adapter_carries_its_fields_and_refuses_the_rest(
    stack: tuple[str, str], shape: str, stream: bool
) -> None:
    base, sim = stack
    extra, messages = SHAPES[shape]
    body = sent_body(extra, messages, stream)
    with httpx.Client(timeout=30) as http:
        before = len(http.get(f"{sim}/sim/requests").json()["requests"])
        r = http.post(f"{base}/v1/ws", content=body, headers={"content-type": "application/json"})
        if shape in WS_REFUSED:
            err = r.json()["error"]
            assert (r.status_code, err["param"]) == (400, WS_REFUSED[shape])
            assert err["code"] in ("unsupported_field", "unsupported_content")
            assert len(http.get(f"{sim}/sim/requests").json()["requests"]) == before
            return
        assert r.status_code == 200, r.text
        got = last_upstream(http, sim)
    assert got["transport"] == "ws"
    sent, arrived = raw_fields(body), raw_fields(got["body"])
    assert json.loads(arrived["type"]) == "generate"
    for key, value in sent.items():
        if key in ("model", "stream"):
            continue
        assert arrived[key] == value, key


def chunks(text: str) -> list[dict[str, Any]]:
    out = []
    for block in text.split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def summary(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per field, what a stream said in all (fragment boundaries do not matter)."""
    s: dict[str, Any] = {"content": "", "reasoning": "", "args": "", "names": [], "logprobs": []}
    for ev in events:
        if ev.get("usage"):
            s["usage"] = ev["usage"]
        for ch in ev.get("choices", []):
            d = ch.get("delta", {})
            s["content"] += d.get("content") or ""
            s["reasoning"] += d.get("reasoning_content") or ""
            for call in d.get("tool_calls") or []:
                fn = call.get("function") or {}
                s["args"] += fn.get("arguments") or ""
                if fn.get("name"):
                    s["names"].append(fn["name"])
            if ch.get("logprobs"):
                s["logprobs"] += [t["token"] for t in ch["logprobs"]["content"]]
            if ch.get("finish_reason"):
                s["finish"] = ch["finish_reason"]
    return s


@pytest.mark.parametrize("shape", ["tools", "json_schema", "reasoning", "logprobs"])
def test_what_the_backend_streamed_is_what_the_client_got(
    stack: tuple[str, str], shape: str
) -> None:
    base, sim = stack
    extra, messages = SHAPES[shape]
    extra = {**extra, "stream_options": {"include_usage": True}}
    body = sent_body(extra, messages, True)
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=30) as http:
        direct = http.post(f"{sim}/v1/chat/completions", content=body, headers=headers).text
        through = http.post(f"{base}/v1/up", content=body, headers=headers).text
    want, got = summary(chunks(direct)), summary(chunks(through))
    want_id = want.pop("usage")
    got_id = got.pop("usage")
    assert got == want
    assert got_id == want_id  # usage with its details
    assert got["content"] or got["args"]


def test_a_non_streamed_reply_keeps_the_whole_message(stack: tuple[str, str]) -> None:
    base, sim = stack
    extra = {"tools": TOOLS, "tool_choice": "required", "reasoning_effort": "low"}
    body = sent_body(extra, [], False)
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=30) as http:
        direct = http.post(f"{sim}/v1/chat/completions", content=body, headers=headers).json()
        through = http.post(f"{base}/v1/up", content=body, headers=headers).json()
    want, got = direct["choices"][0], through["choices"][0]
    assert got["finish_reason"] == want["finish_reason"] == "tool_calls"
    assert got["message"]["reasoning_content"] == want["message"]["reasoning_content"]
    assert got["message"]["content"] is None
    (call,) = got["message"]["tool_calls"]
    (wcall,) = want["message"]["tool_calls"]
    assert call["function"] == wcall["function"]
    assert through["usage"] == direct["usage"]


def test_embeddings_relay_the_clients_body(stack: tuple[str, str]) -> None:
    base, sim = stack
    body = b'{"model": "sim-model", "input": ["one", "two"], "dimensions": 4, "user": "u1"}'
    with httpx.Client(timeout=30) as http:
        r = http.post(f"{base}/sdk/v1/embeddings", content=body, headers={"content-type": "application/json"})
        got = last_upstream(http, sim)
    assert r.status_code == 200, r.text
    assert [len(d["embedding"]) for d in r.json()["data"]] == [4, 4]
    assert got["path"] == "/v1/embeddings"
    assert raw_fields(got["body"]) == raw_fields(body)
