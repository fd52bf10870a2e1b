"""The ``gemini`` adapter's pure parts: the stream decoder (split anywhere, the same reply;
whole function calls as tool-call deltas; finish reasons; a blocked prompt), the request
translation, and the error statuses at the boundary."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiserve_trio.adapters.base import Delta, InferenceRequest
from aiserve_trio.adapters.gemini import GeminiAdapter, gemini_body
from aiserve_trio.adapters.gemini_stream import GeminiStreamDecoder
from aiserve_trio.config import GeminiAdapterConfig
from aiserve_trio.core.errors import BadRequest, UpstreamProtocolError, UpstreamStatusError
from aiserve_trio.core.messages import FunctionCall, Message, Part, ToolCall

from . import stream_cases


def ev(parts: list[dict[str, Any]], **extra: Any) -> bytes:
    body: dict[str, Any] = {
        "candidates": [{"content": {"parts": parts, "role": "model"}, "index": 0, **extra}]
    }
    if "finishReason" in extra:
        body["usageMetadata"] = {
            "promptTokenCount": 9,
            "candidatesTokenCount": 4,
            "thoughtsTokenCount": 1,
        }
    return b"data: " + json.dumps(body).encode() + b"\r\n\r\n"


STREAM = (
    ev([{"text": "Hmm", "thought": True}])
    + ev([{"text": "Hel"}])
    + ev([{"text": "lo \u00e9"}])
    + ev([{"functionCall": {"name": "f", "args": {"a": 1}}}])
    + ev([{"functionCall": {"name": "g", "args": {}, "id": "given-id"}}])
    + ev([{"text": ""}], finishReason="STOP")
)


def decode(chunks: list[bytes]) -> tuple[list[Delta], Delta]:
    return stream_cases.decode(GeminiStreamDecoder("gemini", "call_x_"), chunks)


summary = stream_cases.said


def test_a_whole_stream() -> None:
    deltas, final = decode([STREAM])
    assert summary(deltas) == (
        "Hello \u00e9",
        "Hmm",
        [(0, "call_x_0", "f", '{"a":1}'), (1, "given-id", "g", "{}")],
    )
    assert final.finish_reason == "tool_calls"  # STOP after calls
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (9, 5)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_split_anywhere_the_same_reply(cuts: list[int]) -> None:
    chunks = stream_cases.pieces(STREAM, cuts)
    deltas, final = decode(chunks)
    assert summary(deltas) == summary(decode([STREAM])[0])
    assert final.finish_reason == "tool_calls"


@pytest.mark.parametrize(
    ("reason", "finish"),
    [("STOP", "stop"), ("MAX_TOKENS", "length"), ("SAFETY", "content_filter"), ("OTHER", "stop")],
)
def test_finish_reasons(reason: str, finish: str) -> None:
    assert decode([ev([{"text": "x"}], finishReason=reason)])[1].finish_reason == finish


def test_a_blocked_prompt_is_the_clients_400_and_a_cut_stream_a_protocol_error() -> None:
    d = GeminiStreamDecoder("gemini", "c")
    d.feed(b'data: {"promptFeedback": {"blockReason": "SAFETY"}}\r\n\r\n')
    with pytest.raises(BadRequest) as info:
        d.check()
    assert info.value.code == "content_filter"
    d = GeminiStreamDecoder("gemini", "c")
    d.feed(ev([{"text": "x"}]))
    with pytest.raises(UpstreamProtocolError, match="without a finish reason"):
        d.end()
    d = GeminiStreamDecoder("gemini", "c")
    d.feed(b"data: {broken\r\n\r\n")
    with pytest.raises(UpstreamProtocolError):
        d.check()


def request(messages: list[Message], **kw: Any) -> InferenceRequest:
    extra = {k: msgspec.Raw(json.dumps(v).encode()) for k, v in kw.pop("extra", {}).items()}
    return InferenceRequest(
        request_id="r", model="g", messages=messages, deadline=1e9, extra=extra, **kw
    )


def test_the_translation_of_a_conversation_with_tools() -> None:
    call = ToolCall(
        id="call_1", function=FunctionCall(name="get_weather", arguments='{"city":"Oslo"}')
    )
    image = Part(
        type="image_url",
        raw=msgspec.Raw(b'{"type":"image_url","image_url":{"url":"data:image/jpeg;base64,QUJD"}}'),
    )
    req = request(
        [
            Message(role="system", content="Be brief."),
            Message(role="user", content=[Part(type="text", text="Look"), image]),
            Message(role="assistant", content=None, tool_calls=[call]),
            Message(role="tool", content="sunny", tool_call_id="call_1"),
        ],
        max_tokens=50,
        temperature=0.3,
        top_p=0.8,
        stop=["END"],
        tool_choice="get_weather",
        extra={
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "parameters": {"type": "object"}},
                }
            ]
        },
    )
    body = json.loads(gemini_body(req))
    assert body["systemInstruction"] == {"parts": [{"text": "Be brief."}]}
    assert body["contents"] == [
        {
            "role": "user",
            "parts": [{"text": "Look"}, {"inlineData": {"mimeType": "image/jpeg", "data": "QUJD"}}],
        },
        {
            "role": "model",
            "parts": [{"functionCall": {"name": "get_weather", "args": {"city": "Oslo"}}}],
        },
        {
            "role": "user",
            "parts": [
                {"functionResponse": {"name": "get_weather", "response": {"result": "sunny"}}}
            ],
        },
    ]
    assert body["tools"] == [
        {"functionDeclarations": [{"name": "get_weather", "parameters": {"type": "object"}}]}
    ]
    assert body["toolConfig"] == {
        "functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["get_weather"]}
    }
    assert body["generationConfig"] == {
        "maxOutputTokens": 50,
        "temperature": 0.3,
        "topP": 0.8,
        "stopSequences": ["END"],
    }


def test_an_image_by_url_is_refused_naming_the_part() -> None:
    image = Part(
        type="image_url",
        raw=msgspec.Raw(b'{"type":"image_url","image_url":{"url":"https://x/y.png"}}'),
    )
    with pytest.raises(BadRequest) as info:
        gemini_body(request([Message(role="user", content=[image])]))
    assert info.value.param == "messages[0].content[0]"


@pytest.mark.parametrize(
    ("status", "error", "expected", "code"),
    [
        (
            429,
            {"code": 429, "message": "Resource exhausted", "status": "RESOURCE_EXHAUSTED"},
            UpstreamStatusError,
            "upstream_status_error",
        ),
        (
            503,
            {"code": 503, "message": "overloaded", "status": "UNAVAILABLE"},
            UpstreamStatusError,
            "upstream_status_error",
        ),
        (
            400,
            {
                "code": 400,
                "message": "The input token count (2000000) exceeds the maximum",
                "status": "INVALID_ARGUMENT",
            },
            BadRequest,
            "context_length_exceeded",
        ),
        (
            400,
            {"code": 400, "message": "bad field", "status": "INVALID_ARGUMENT"},
            BadRequest,
            "invalid_request_error",
        ),
    ],
)
def test_error_statuses_at_the_boundary(
    status: int, error: dict[str, Any], expected: type, code: str
) -> None:
    adapter = GeminiAdapter("gemini", GeminiAdapterConfig(models=["g"]))
    err = adapter.status_error(status, json.dumps({"error": error}).encode(), None)
    assert type(err) is expected
    assert err.code == code
    assert error["message"] in err.message
