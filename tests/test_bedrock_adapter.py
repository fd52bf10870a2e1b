"""The ``bedrock`` adapter's pure parts: the AWS event stream (split anywhere, the same
messages; any changed byte is an error, never a wrong event), the Converse stream decoder,
the request translation, the refusals, and the error statuses at the boundary."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiserve_trio.adapters.base import Delta, InferenceRequest
from aiserve_trio.adapters.bedrock import BedrockAdapter, converse_body
from aiserve_trio.adapters.bedrock_stream import BedrockStreamDecoder
from aiserve_trio.adapters.eventstream import EventStreamDecoder, EventStreamError
from aiserve_trio.config import BedrockAdapterConfig, ConfigError, parse_config
from aiserve_trio.core.errors import BadRequest, UpstreamProtocolError, UpstreamStatusError
from aiserve_trio.core.messages import FunctionCall, Message, ToolCall
from aiserve_trio.sim.bedrock import encode_message, event

from . import stream_cases

headers_st = st.dictionaries(
    st.text(min_size=1, max_size=20).filter(lambda s: len(s.encode()) < 255),
    st.text(max_size=40),
    max_size=4,
)

messages_st = st.lists(st.tuples(headers_st, st.binary(max_size=200)), min_size=1, max_size=5)


@settings(max_examples=150, deadline=None)
@given(messages_st, st.lists(st.integers(min_value=0, max_value=5000), max_size=10))
def test_split_anywhere_the_same_messages(
    msgs: list[tuple[dict[str, str], bytes]], cuts: list[int]
) -> None:
    stream = b"".join(encode_message(h, p) for h, p in msgs)
    points = sorted({c % (len(stream) + 1) for c in cuts})
    d = EventStreamDecoder()
    got = []
    for a, b in zip([0, *points], [*points, len(stream)], strict=True):
        got += d.feed(stream[a:b])
    assert [(m.headers, m.payload) for m in got] == msgs
    assert d.pending == 0


@settings(max_examples=150, deadline=None)
@given(messages_st, st.integers(min_value=0), st.integers(min_value=1, max_value=255))
def test_any_changed_byte_is_an_error(
    msgs: list[tuple[dict[str, str], bytes]], at: int, flip: int
) -> None:
    stream = bytearray(b"".join(encode_message(h, p) for h, p in msgs))
    stream[at % len(stream)] ^= flip
    with pytest.raises(EventStreamError):
        whole(bytes(stream))


def whole(stream: bytes) -> None:
    """Decode a stream that has ended: bytes left over are an error too."""
    d = EventStreamDecoder()
    d.feed(stream)
    if d.pending:  # a changed length may wait for bytes that never come
        raise EventStreamError("cut short")


def test_an_oversized_length_is_refused_at_once() -> None:
    d = EventStreamDecoder(max_message=1024)
    with pytest.raises(EventStreamError, match="out of range"):
        d.feed(encode_message({"a": "b"}, b"x" * 2000))


STREAM = (
    event("messageStart", {"role": "assistant"})
    + event(
        "contentBlockDelta",
        {"contentBlockIndex": 0, "delta": {"reasoningContent": {"text": "Hmm"}}},
    )
    + event("contentBlockStop", {"contentBlockIndex": 0})
    + event("contentBlockDelta", {"contentBlockIndex": 1, "delta": {"text": "Hi "}})
    + event("contentBlockDelta", {"contentBlockIndex": 1, "delta": {"text": "th\u00e9re"}})
    + event("contentBlockStop", {"contentBlockIndex": 1})
    + event(
        "contentBlockStart",
        {"contentBlockIndex": 2, "start": {"toolUse": {"toolUseId": "t1", "name": "f"}}},
    )
    + event("contentBlockDelta", {"contentBlockIndex": 2, "delta": {"toolUse": {"input": '{"a":'}}})
    + event("contentBlockDelta", {"contentBlockIndex": 2, "delta": {"toolUse": {"input": "1}"}}})
    + event("contentBlockStop", {"contentBlockIndex": 2})
    + event("messageStop", {"stopReason": "tool_use"})
    + event("metadata", {"usage": {"inputTokens": 12, "outputTokens": 6, "totalTokens": 18}})
)


def decode(chunks: list[bytes]) -> tuple[list[Delta], Delta]:
    return stream_cases.decode(BedrockStreamDecoder("bedrock"), chunks)


summary = stream_cases.said


def test_a_whole_converse_stream() -> None:
    deltas, final = decode([STREAM])
    assert summary(deltas) == (
        "Hi th\u00e9re",
        "Hmm",
        [(0, "t1", "f", ""), (0, None, None, '{"a":'), (0, None, None, "1}")],
    )
    assert final.finish_reason == "tool_calls"
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (12, 6)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=10))
def test_the_converse_stream_split_anywhere(cuts: list[int]) -> None:
    chunks = stream_cases.pieces(STREAM, cuts)
    assert summary(decode(chunks)[0]) == summary(decode([STREAM])[0])


def exception(kind: str, message: str) -> bytes:
    headers = {
        ":exception-type": kind,
        ":content-type": "application/json",
        ":message-type": "exception",
    }
    return encode_message(headers, json.dumps({"message": message}).encode())


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("throttlingException", UpstreamStatusError),
        ("validationException", BadRequest),
        ("modelStreamErrorException", UpstreamProtocolError),
    ],
)
def test_an_exception_mid_stream_comes_after_the_text(kind: str, expected: type) -> None:
    d = BedrockStreamDecoder("bedrock")
    text = event("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": "Hi"}})
    deltas = d.feed(text + exception(kind, "went wrong"))
    assert [x.text for x in deltas] == ["Hi"]
    with pytest.raises(expected) as info:
        d.check()
    assert "went wrong" in str(info.value)
    if isinstance(info.value, UpstreamStatusError):
        assert info.value.upstream_status == 429


def test_a_stream_without_message_stop_or_with_bad_bytes_is_a_protocol_error() -> None:
    d = BedrockStreamDecoder("bedrock")
    d.feed(event("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": "Hi"}}))
    with pytest.raises(UpstreamProtocolError, match="before messageStop"):
        d.end()
    d = BedrockStreamDecoder("bedrock")
    broken = bytearray(STREAM)
    broken[40] ^= 1
    d.feed(bytes(broken))
    with pytest.raises(UpstreamProtocolError, match="malformed"):
        d.check()


def request(messages: list[Message], **kw: Any) -> InferenceRequest:
    extra = {k: msgspec.Raw(json.dumps(v).encode()) for k, v in kw.pop("extra", {}).items()}
    return InferenceRequest(
        request_id="r", model="m", messages=messages, deadline=1e9, extra=extra, **kw
    )


TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "w", "parameters": {"type": "object"}},
    }
]


def test_the_translation_of_a_conversation_with_tools() -> None:
    call = ToolCall(id="t1", function=FunctionCall(name="get_weather", arguments='{"city":"Oslo"}'))
    req = request(
        [
            Message(role="system", content="Be brief."),
            Message(role="user", content="Weather?"),
            Message(role="assistant", content=None, tool_calls=[call]),
            Message(role="tool", content="sunny", tool_call_id="t1"),
        ],
        max_tokens=20,
        temperature=0.1,
        top_p=0.5,
        stop=["END"],
        tool_choice="required",
        extra={"tools": TOOLS},
    )
    body = json.loads(converse_body(req))
    assert body["system"] == [{"text": "Be brief."}]
    assert body["messages"] == [
        {"role": "user", "content": [{"text": "Weather?"}]},
        {
            "role": "assistant",
            "content": [
                {"toolUse": {"toolUseId": "t1", "name": "get_weather", "input": {"city": "Oslo"}}}
            ],
        },
        {
            "role": "user",
            "content": [{"toolResult": {"toolUseId": "t1", "content": [{"text": "sunny"}]}}],
        },
    ]
    assert body["inferenceConfig"] == {
        "maxTokens": 20,
        "temperature": 0.1,
        "topP": 0.5,
        "stopSequences": ["END"],
    }
    assert body["toolConfig"] == {
        "tools": [
            {
                "toolSpec": {
                    "name": "get_weather",
                    "description": "w",
                    "inputSchema": {"json": {"type": "object"}},
                }
            }
        ],
        "toolChoice": {"any": {}},
    }


def test_what_converse_cannot_say_is_refused_naming_the_field() -> None:
    with pytest.raises(BadRequest) as info:
        converse_body(
            request(
                [Message(role="user", content="hi")], tool_choice="none", extra={"tools": TOOLS}
            )
        )
    assert info.value.param == "tool_choice"


def test_region_sets_the_endpoint_base_url_overrides_and_a_region_is_required() -> None:
    a = BedrockAdapter("b", BedrockAdapterConfig(models=["m"], region="eu-west-3"))
    assert a.base_url == "https://bedrock-runtime.eu-west-3.amazonaws.com"
    b = BedrockAdapter(
        "b", BedrockAdapterConfig(models=["m"], region="eu-west-3", base_url="http://vpce")
    )
    assert b.base_url == "http://vpce"
    text = '[auth]\nenabled = false\n[[routes]]\npath = "/c"\nadapter = "b"\n[adapters.b]\nkind = "bedrock"\nmodels = ["m"]\n'
    with pytest.raises(ConfigError, match=r"adapters\.b\.region"):
        parse_config(text)


@pytest.mark.parametrize(
    ("status", "body", "expected", "code"),
    [
        (429, {"message": "Too many requests"}, UpstreamStatusError, "upstream_status_error"),
        (503, {"message": "unavailable"}, UpstreamStatusError, "upstream_status_error"),
        (
            400,
            {"__type": "ValidationException", "message": "Input is too long for requested model."},
            BadRequest,
            "context_length_exceeded",
        ),
        (
            400,
            {"__type": "ValidationException", "message": "bad"},
            BadRequest,
            "invalid_request_error",
        ),
        (
            403,
            {"__type": "AccessDeniedException", "message": "denied"},
            UpstreamStatusError,
            "upstream_status_error",
        ),
    ],
)
def test_error_statuses_at_the_boundary(
    status: int, body: dict[str, str], expected: type, code: str
) -> None:
    a = BedrockAdapter("b", BedrockAdapterConfig(models=["m"], region="us-east-1"))
    err = a.status_error(status, json.dumps(body).encode(), None)
    assert type(err) is expected
    assert err.code == code
    assert body["message"] in err.message
