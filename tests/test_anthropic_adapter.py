"""The ``anthropic`` adapter's pure parts, without a socket: the event-stream decoder
(split anywhere, the same reply; tool calls numbered as OpenAI numbers them; errors after
what came before), the request translation, and the error statuses at the boundary."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiserve_trio.adapters.anthropic import AnthropicAdapter, messages_body
from aiserve_trio.adapters.anthropic_stream import AnthropicStreamDecoder
from aiserve_trio.adapters.base import Delta, InferenceRequest
from aiserve_trio.config import AnthropicAdapterConfig
from aiserve_trio.core.errors import (
    BadRequest,
    PayloadTooLarge,
    UpstreamProtocolError,
    UpstreamStatusError,
)
from aiserve_trio.core.messages import FunctionCall, Message, Part, ToolCall

from . import stream_cases


def ev(kind: str, **data: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


START = ev("message_start", message={"id": "m", "usage": {"input_tokens": 11, "output_tokens": 1}})
THINKING = (
    ev("content_block_start", index=0, content_block={"type": "thinking", "thinking": ""})
    + ev("content_block_delta", index=0, delta={"type": "thinking_delta", "thinking": "Let me"})
    + ev("content_block_delta", index=0, delta={"type": "signature_delta", "signature": "x"})
    + ev("content_block_stop", index=0)
)
TEXT = (
    ev("content_block_start", index=1, content_block={"type": "text", "text": ""})
    + b": a comment\n\n"
    + ev("ping")
    + ev("content_block_delta", index=1, delta={"type": "text_delta", "text": "Hello"})
    + ev("content_block_delta", index=1, delta={"type": "text_delta", "text": " w\u00f6rld"})
    + ev("content_block_stop", index=1)
)
TOOL = (
    ev(
        "content_block_start",
        index=2,
        content_block={"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}},
    )
    + ev(
        "content_block_delta", index=2, delta={"type": "input_json_delta", "partial_json": '{"a":'}
    )
    + ev("content_block_delta", index=2, delta={"type": "input_json_delta", "partial_json": " 1}"})
    + ev("content_block_stop", index=2)
)
END = ev("message_delta", delta={"stop_reason": "tool_use"}, usage={"output_tokens": 7}) + ev(
    "message_stop"
)
STREAM = START + THINKING + TEXT + TOOL + END


def decode(chunks: list[bytes]) -> tuple[list[Delta], Delta]:
    return stream_cases.decode(AnthropicStreamDecoder("claude"), chunks)


summary = stream_cases.said


def test_a_whole_stream() -> None:
    deltas, final = decode([STREAM])
    text, thought, calls = summary(deltas)
    assert (text, thought) == ("Hello w\u00f6rld", "Let me")
    # Block 2 is the reply's first tool call: index 0, id and name on its first fragment.
    assert calls == [(0, "toolu_1", "f", ""), (0, None, None, '{"a":'), (0, None, None, " 1}")]
    assert final.finish_reason == "tool_calls"
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (11, 7)
    # What came in one read goes out joined: the thinking and text before the call.
    assert deltas[0].text == "Hello w\u00f6rld"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_split_anywhere_the_same_reply(cuts: list[int]) -> None:
    chunks = stream_cases.pieces(STREAM, cuts)
    deltas, final = decode(chunks)
    assert summary(deltas) == summary(decode([STREAM])[0])
    assert final.finish_reason == "tool_calls"


@pytest.mark.parametrize(
    ("reason", "finish"),
    [
        ("end_turn", "stop"),
        ("max_tokens", "length"),
        ("stop_sequence", "stop"),
        ("refusal", "content_filter"),
    ],
)
def test_stop_reasons(reason: str, finish: str) -> None:
    stream = (
        START
        + TEXT
        + ev("message_delta", delta={"stop_reason": reason}, usage={"output_tokens": 2})
    )
    _, final = decode([stream + ev("message_stop")])
    assert final.finish_reason == finish


def test_an_overloaded_error_mid_stream_is_retryable_and_comes_after_the_text() -> None:
    d = AnthropicStreamDecoder("claude")
    error = ev("error", error={"type": "overloaded_error", "message": "Overloaded"})
    deltas = d.feed(START + TEXT + error)
    assert "".join(x.text for x in deltas) == "Hello w\u00f6rld"
    with pytest.raises(UpstreamStatusError) as info:
        d.check()
    assert info.value.upstream_status == 529
    assert "overloaded_error" in info.value.message


@pytest.mark.parametrize(
    "broken",
    [
        START + b"event: content_block_delta\ndata: {not json\n\n",
        START
        + ev(
            "content_block_delta", index=5, delta={"type": "input_json_delta", "partial_json": "{"}
        ),
        START + ev("error", error={"type": "invalid_request_error", "message": "no"}),
    ],
)
def test_a_broken_stream_is_a_protocol_error(broken: bytes) -> None:
    d = AnthropicStreamDecoder("claude")
    d.feed(broken)
    with pytest.raises(UpstreamProtocolError):
        d.check()


def test_a_stream_cut_before_message_stop_does_not_look_finished() -> None:
    d = AnthropicStreamDecoder("claude")
    d.feed(START + TEXT)
    with pytest.raises(UpstreamProtocolError, match="before message_stop"):
        d.end()


# --- the request ------------------------------------------------------------------------


def msg(role: str, content: Any = None, **kw: Any) -> Message:
    return Message(role=role, content=content, **kw)


def request(messages: list[Message], **kw: Any) -> InferenceRequest:
    extra = {k: msgspec.Raw(json.dumps(v).encode()) for k, v in kw.pop("extra", {}).items()}
    return InferenceRequest(
        request_id="r", model="claude", messages=messages, deadline=1e9, extra=extra, **kw
    )


def body(req: InferenceRequest, default: int = 4096) -> dict[str, Any]:
    return dict(json.loads(messages_body(req, "claude-sonnet-4-5", default)))


def test_the_translation_of_a_conversation_with_tools() -> None:
    image = Part(
        type="image_url",
        raw=msgspec.Raw(b'{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}'),
    )
    call = ToolCall(
        id="call_1", function=FunctionCall(name="get_weather", arguments='{"city":"Oslo"}')
    )
    req = request(
        [
            msg("system", "Be brief."),
            msg("developer", "Answer in English."),
            msg("user", [Part(type="text", text="What is this?"), image]),
            msg("assistant", "Let me look.", tool_calls=[call]),
            msg("tool", "sunny", tool_call_id="call_1"),
            msg("tool", "21 C", tool_call_id="call_2"),
            msg("user", "Thanks"),
        ],
        stop=["END"],
        temperature=0.2,
        top_p=0.9,
        tool_choice="get_weather",
        extra={
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": "d",
                        "parameters": {"type": "object"},
                    },
                }
            ],
            "parallel_tool_calls": False,
            "user": "u-1",
        },
    )
    out = body(req)
    assert out["model"] == "claude-sonnet-4-5"
    assert out["system"] == "Be brief.\n\nAnswer in English."
    assert out["max_tokens"] == 4096
    assert out["stream"] is True
    assert out["stop_sequences"] == ["END"]
    assert (out["temperature"], out["top_p"]) == (0.2, 0.9)
    assert out["tools"] == [
        {"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}
    ]
    assert out["tool_choice"] == {
        "type": "tool",
        "name": "get_weather",
        "disable_parallel_tool_use": True,
    }
    assert out["metadata"] == {"user_id": "u-1"}
    assert [t["role"] for t in out["messages"]] == ["user", "assistant", "user"]
    assert out["messages"][0]["content"] == [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
    ]
    assert out["messages"][1]["content"] == [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Oslo"}},
    ]
    # Both tool results and the next user turn are one user message.
    assert out["messages"][2]["content"] == [
        {"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"},
        {"type": "tool_result", "tool_use_id": "call_2", "content": "21 C"},
        {"type": "text", "text": "Thanks"},
    ]


@pytest.mark.parametrize(
    ("choice", "expected"),
    [("auto", {"type": "auto"}), ("required", {"type": "any"}), ("none", {"type": "none"})],
)
def test_tool_choice_modes(choice: str, expected: dict[str, str]) -> None:
    req = request([msg("user", "hi")], tool_choice=choice, extra={"tools": []})
    assert body(req)["tool_choice"] == expected


def test_max_tokens_the_clients_or_the_default() -> None:
    assert body(request([msg("user", "hi")], max_tokens=17))["max_tokens"] == 17
    assert body(request([msg("user", "hi")]), default=99)["max_tokens"] == 99
    assert "tool_choice" not in body(request([msg("user", "hi")]))


@pytest.mark.parametrize(
    ("effort", "max_tokens", "budget"),
    [("minimal", 4096, 1024), ("low", 4096, 2048), ("high", 32000, 24576), ("high", 4096, 4095)],
)
def test_reasoning_effort_becomes_a_thinking_budget_within_max_tokens(
    effort: str, max_tokens: int, budget: int
) -> None:
    req = request([msg("user", "hi")], max_tokens=max_tokens, extra={"reasoning_effort": effort})
    assert body(req)["thinking"] == {"type": "enabled", "budget_tokens": budget}
    assert "thinking" not in body(request([msg("user", "hi")], extra={"reasoning_effort": "none"}))


def test_a_reasoning_effort_anthropic_cannot_think_within_is_a_400() -> None:
    small = request([msg("user", "hi")], max_tokens=1000, extra={"reasoning_effort": "low"})
    with pytest.raises(BadRequest) as info:
        body(small)
    assert info.value.param == "max_tokens"
    with pytest.raises(BadRequest) as info:
        body(request([msg("user", "hi")], extra={"reasoning_effort": "extreme"}))
    assert info.value.param == "reasoning_effort"


def test_what_cannot_be_said_is_a_400_naming_the_field() -> None:
    bad = ToolCall(id="c", function=FunctionCall(name="f", arguments="{not json"))
    with pytest.raises(BadRequest) as info:
        body(request([msg("assistant", None, tool_calls=[bad])]))
    assert info.value.param == "messages[0].tool_calls[0].function.arguments"
    with pytest.raises(BadRequest) as info:
        body(request([msg("user", [Part(type="input_audio", raw=msgspec.Raw(b"{}"))])]))
    assert info.value.code == "unsupported_content"


@pytest.mark.parametrize(
    ("status", "error", "expected", "code"),
    [
        (
            529,
            {"type": "overloaded_error", "message": "Overloaded"},
            UpstreamStatusError,
            "upstream_status_error",
        ),
        (
            429,
            {"type": "rate_limit_error", "message": "slow down"},
            UpstreamStatusError,
            "upstream_status_error",
        ),
        (
            400,
            {
                "type": "invalid_request_error",
                "message": "prompt is too long: 250000 tokens > 200000",
            },
            BadRequest,
            "context_length_exceeded",
        ),
        (
            400,
            {"type": "invalid_request_error", "message": "temperature: out of range"},
            BadRequest,
            "invalid_request_error",
        ),
        (
            413,
            {"type": "request_too_large", "message": "too big"},
            PayloadTooLarge,
            "request_too_large",
        ),
        (
            401,
            {"type": "authentication_error", "message": "invalid x-api-key"},
            UpstreamStatusError,
            "upstream_status_error",
        ),
    ],
)
def test_error_statuses_at_the_boundary(
    status: int, error: dict[str, str], expected: type, code: str
) -> None:
    adapter = AnthropicAdapter(
        "claude", AnthropicAdapterConfig(models=["claude"], base_url="http://x")
    )
    raw = json.dumps({"type": "error", "error": error}).encode()
    err = adapter.status_error(status, raw, 2.0)
    assert type(err) is expected
    assert err.code == code
    assert error["message"][:20] in err.message
    if isinstance(err, UpstreamStatusError):
        assert (err.upstream_status, err.retry_after) == (status, 2.0)
