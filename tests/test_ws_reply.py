"""The WebSocket reply decoder without a socket: tokens, done, error, and what breaks the step."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiserve_trio.adapters.base import Delta, Usage
from aiserve_trio.adapters.ws_reply import WsReplyDecoder
from aiserve_trio.core.errors import (
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
)


def msg(**fields: object) -> str:
    return json.dumps(fields)


def test_tokens_then_done() -> None:
    d = WsReplyDecoder("up", "r1")
    assert d.feed(msg(type="token", id="r1", text="He")) == [Delta(text="He")]
    assert d.feed(msg(type="token", text="")) == []  # no id, no text: fine, nothing to send
    assert d.feed(msg(type="token", text="llo").encode()) == [Delta(text="llo")]
    assert not d.ended
    usage = {"prompt_tokens": 4, "completion_tokens": 2}
    final = d.feed(msg(type="done", id="r1", finish_reason="length", usage=usage))
    assert final == [
        Delta(finish_reason="length", usage=Usage(prompt_tokens=4, completion_tokens=2))
    ]
    assert d.ended


def test_done_without_usage_counts_the_tokens() -> None:
    d = WsReplyDecoder("up", "r1")
    d.feed(msg(type="token", text="a"))
    d.feed(msg(type="token", text="b"))
    (final,) = d.feed(msg(type="done"))
    assert final == Delta(finish_reason="stop", usage=Usage(prompt_tokens=0, completion_tokens=2))


def test_an_error_message_ends_the_reply_in_step() -> None:
    d = WsReplyDecoder("up", "r1")
    with pytest.raises(UpstreamStatusError) as info:
        d.feed(msg(type="error", status=429, message="slow down", retry_after=1.5))
    assert (info.value.upstream_status, info.value.retry_after) == (429, 1.5)
    assert d.ended  # the connection may carry the next request
    d = WsReplyDecoder("up", "r1")
    with pytest.raises(UpstreamTimeout, match="answered 504"):
        d.feed(msg(type="error", status=504, message="late"))
    assert d.ended


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (msg(type="token", id="r2", text="x"), "a message for request 'r2' arrived during 'r1'"),
        (msg(type="thinking"), "unknown message type 'thinking'"),
        ("{not json", "malformed message"),
        (b"\xff\xfe", "malformed message"),
        (msg(text="no type"), "malformed message"),
        (msg(type="token", text=5), "malformed message"),
    ],
)
def test_what_puts_the_connection_out_of_step(raw: str | bytes, match: str) -> None:
    d = WsReplyDecoder("up", "r1")
    with pytest.raises(UpstreamProtocolError, match=match):
        d.feed(raw)
    assert not d.ended


def test_a_message_after_the_end_is_a_protocol_error() -> None:
    d = WsReplyDecoder("up", "r1")
    d.feed(msg(type="done"))
    with pytest.raises(UpstreamProtocolError, match="after the reply ended"):
        d.feed(msg(type="token", text="late"))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
fields = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["token", "done", "error", "other"]) | st.text(max_size=5),
        "id": st.sampled_from(["r1", "r2"]) | json_values,
        "text": st.text(max_size=5) | json_values,
        "usage": json_values,
        "status": st.integers(-1, 600) | json_values,
        "retry_after": json_values,
        "finish_reason": json_values,
    },
)


@given(st.lists(st.binary(max_size=40) | st.text(max_size=40) | fields.map(json.dumps), max_size=6))
def test_any_messages_raise_only_upstream_errors(messages: list[str | bytes]) -> None:
    d = WsReplyDecoder("up", "r1")
    finals = 0
    try:
        for m in messages:
            finals += sum(1 for x in d.feed(m) if x.finish_reason is not None)
    except UpstreamError:
        pass
    assert finals <= 1
