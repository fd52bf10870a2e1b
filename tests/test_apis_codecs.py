"""The Responses and Messages codecs without sockets: request decoders and stream framers.

Properties (hypothesis): whatever the split of a reply into deltas, the streamed events
are well-formed (numbered, every item or block opened and closed once, in order) and
add up to exactly the reply the same deltas give unstreamed; a field a decoder does not
know is refused with a 400 naming it.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiserve_trio.adapters.base import Delta, ToolCallDelta, Usage
from aiserve_trio.apis import CODECS
from aiserve_trio.apis import messages as anthropic_api
from aiserve_trio.apis import responses as responses_api
from aiserve_trio.core.api import ChunkDelta, FunctionDelta, ToolCallChunk
from aiserve_trio.core.api import Usage as WireUsage
from aiserve_trio.core.errors import (
    BadRequest,
    GatewayError,
    Overloaded,
    PolicyViolation,
    StageDeadlineExceeded,
    UpstreamError,
    UpstreamProtocolError,
)
from aiserve_trio.stages.assembler import ResponseAssembler

# --- replies as deltas ----------------------------------------------------------

words = st.text(alphabet="abc xyz.,\u00e9\u4f60", min_size=1, max_size=12)


@st.composite
def replies(draw: st.DrawFn) -> tuple[list[Delta], str, str, list[tuple[str, str, str]]]:
    """A reply's deltas (reasoning, then text, then tool calls, each split anywhere),
    and what they add up to: reasoning, text, calls (id, name, arguments)."""
    reasoning = draw(st.lists(words, max_size=4))
    text = draw(st.lists(words, max_size=5))
    ncalls = draw(st.integers(0, 3))
    if not (reasoning or text or ncalls):
        text = ["hi"]
    deltas = [Delta(reasoning=r) for r in reasoning] + [Delta(text=t) for t in text]
    calls = []
    for i in range(ncalls):
        args = json.dumps({"city": draw(words), "n": i})
        cuts = sorted(draw(st.lists(st.integers(0, len(args)), max_size=4)))
        pieces = [args[a:b] for a, b in zip([0, *cuts], [*cuts, len(args)], strict=True)]
        first = ToolCallDelta(index=i, id=f"call_{i}", type="function", name=f"fn{i}")
        deltas.append(Delta(tool_calls=[first]))
        deltas += [Delta(tool_calls=[ToolCallDelta(index=i, arguments=p)]) for p in pieces if p]
        calls.append((f"call_{i}", f"fn{i}", args))
    finish = "tool_calls" if ncalls else draw(st.sampled_from(["stop", "length"]))
    deltas.append(Delta(finish_reason=finish, usage=Usage(prompt_tokens=5, completion_tokens=9)))
    return deltas, "".join(reasoning), "".join(text), calls


def assemble(kind: str, deltas: list[Delta], view: object, *, stream: bool) -> bytes:
    asm = ResponseAssembler(
        "resp_abc" if kind == "responses" else "msg_abc",
        "m",
        1,
        stream=stream,
        codec=CODECS[kind],
        view=view,
    )
    out = b"".join(asm.feed(d, 0.0) for d in deltas)
    return out + asm.finish(0.0)


def sse(body: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in body.decode().split("\n\n"):
        if not block:
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


RESPONSES_VIEW = responses_api.ResponsesRequest(input="hi")


# --- Responses ------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(replies())
def test_responses_stream_adds_up_to_the_unstreamed_response(reply: Any) -> None:
    deltas, reasoning, text, calls = reply
    events = sse(assemble("responses", deltas, RESPONSES_VIEW, stream=True))
    names = [name for name, _ in events]
    assert [data["type"] for _, data in events] == names
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] in ("response.completed", "response.incomplete")
    # Every item is added once and done once, in output order, one after the other
    # (parallel calls may overlap: their arguments go in their own items).
    added = [d["output_index"] for n, d in events if n == "response.output_item.added"]
    done = [d["output_index"] for n, d in events if n == "response.output_item.done"]
    assert added == list(range(len(added)))
    assert sorted(done) == added
    # The deltas add up to each item's final text.
    final = events[-1][1]["response"]
    by_item: dict[str, str] = {}
    for name, data in events:
        if name.endswith(".delta"):
            by_item[data["item_id"]] = by_item.get(data["item_id"], "") + data["delta"]
    for item in final["output"]:
        if item["type"] == "message":
            assert by_item[item["id"]] == item["content"][0]["text"] == text
        elif item["type"] == "reasoning":
            assert by_item[item["id"]] == item["content"][0]["text"] == reasoning
        else:
            assert by_item.get(item["id"], "") == item["arguments"]
    assert [
        (i["call_id"], i["name"], i["arguments"])
        for i in final["output"]
        if i["type"] == "function_call"
    ] == calls
    whole = json.loads(assemble("responses", deltas, RESPONSES_VIEW, stream=False))
    assert whole["output"] == final["output"]
    assert whole["status"] == final["status"]
    assert (
        whole["usage"]
        == final["usage"]
        == {
            "input_tokens": 5,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": 9,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 14,
        }
    )


def test_responses_length_is_an_incomplete_response() -> None:
    deltas = [Delta(text="a b"), Delta(finish_reason="length")]
    events = sse(assemble("responses", deltas, RESPONSES_VIEW, stream=True))
    name, data = events[-1]
    assert name == "response.incomplete"
    assert data["response"]["status"] == "incomplete"
    assert data["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_responses_stream_failure_is_response_failed_naming_the_stage() -> None:
    asm = ResponseAssembler(
        "resp_x", "m", 1, stream=True, codec=CODECS["responses"], view=RESPONSES_VIEW
    )
    asm.feed(Delta(text="partial"), 0.0)
    name, data = sse(asm.fail(StageDeadlineExceeded("inference")) or b"")[-1]
    assert name == "response.failed"
    assert data["response"]["status"] == "failed"
    assert data["response"]["error"]["code"] == "stage_deadline_exceeded"
    assert "inference" in data["response"]["error"]["message"]


# --- Messages -------------------------------------------------------------------


def accumulate(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """A message from its events, the way Anthropic's SDK adds them up."""
    message: dict[str, Any] = {}
    partial: dict[int, str] = {}
    open_blocks: set[int] = set()
    for name, data in events:
        assert data["type"] == name
        if name == "message_start":
            message = data["message"]
        elif name == "content_block_start":
            assert data["index"] == len(message["content"])
            message["content"].append(data["content_block"])
            open_blocks.add(data["index"])
        elif name == "content_block_delta":
            assert data["index"] in open_blocks
            block, delta = message["content"][data["index"]], data["delta"]
            if delta["type"] == "input_json_delta":
                partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
            else:
                key = "text" if delta["type"] == "text_delta" else "thinking"
                block[key] += delta[key]
        elif name == "content_block_stop":
            open_blocks.remove(data["index"])
            if data["index"] in partial:
                message["content"][data["index"]]["input"] = json.loads(partial[data["index"]])
        elif name == "message_delta":
            assert not open_blocks
            message.update(data["delta"])
            message["usage"].update(data["usage"])
    assert events[-1][0] == "message_stop"
    return message


@settings(max_examples=150, deadline=None)
@given(replies())
def test_messages_stream_adds_up_to_the_unstreamed_message(reply: Any) -> None:
    deltas, reasoning, text, calls = reply
    events = sse(assemble("messages", deltas, None, stream=True))
    streamed = accumulate(events)
    whole = json.loads(assemble("messages", deltas, None, stream=False))
    assert streamed == whole
    kinds = [b["type"] for b in whole["content"]]
    assert kinds == ["thinking"] * bool(reasoning) + ["text"] * bool(text) + ["tool_use"] * len(
        calls
    )
    uses = [(b["id"], b["name"], b["input"]) for b in whole["content"] if b["type"] == "tool_use"]
    assert uses == [(i, n, json.loads(a)) for i, n, a in calls]
    finish = deltas[-1].finish_reason
    assert (
        whole["stop_reason"]
        == {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}[finish]
    )
    assert whole["usage"]["input_tokens"] == 5
    assert whole["usage"]["output_tokens"] == 9


def test_messages_stream_failure_is_anthropics_error_event() -> None:
    asm = ResponseAssembler("msg_x", "m", 1, stream=True, codec=CODECS["messages"])
    asm.feed(Delta(text="partial"), 0.0)
    name, data = sse(asm.fail(UpstreamError("the backend went away")) or b"")[-1]
    assert name == "error"
    assert data == {
        "type": "error",
        "error": {"type": "api_error", "message": "the backend went away [upstream_error]"},
    }


@pytest.mark.parametrize("args", ["[1, 2]", '"Paris"', "42", "null", '{"city": '])
def test_messages_stream_whose_tool_input_is_not_an_object_ends_with_an_error_event(
    args: str,
) -> None:
    """Issue 51, item 2: the stream ended with ``message_stop`` and the official SDK
    then failed parsing the input; now the framer refuses to close, and the stream
    ends with Anthropic's ``error`` event -- the error the unstreamed reply gets."""
    deltas = [
        Delta(tool_calls=[ToolCallDelta(index=0, id="call_0", type="function", name="fn")]),
        Delta(tool_calls=[ToolCallDelta(index=0, arguments=args)]),
        Delta(finish_reason="tool_calls"),
    ]
    framer = anthropic_api.MessagesFramer("msg_x", "m", 1, None)
    framer.role()
    for d in deltas[:2]:
        assert d.tool_calls is not None
        (call,) = d.tool_calls
        fn = FunctionDelta(name=call.name, arguments=call.arguments or None)
        framer.delta(ChunkDelta(tool_calls=[ToolCallChunk(index=0, id=call.id, function=fn)]))
    usage = WireUsage(prompt_tokens=1, completion_tokens=2, total_tokens=3)
    with pytest.raises(UpstreamProtocolError, match="'call_0' are not a JSON object"):
        framer.close("tool_calls", usage)
    assert [n for n, _ in sse(framer.fail(UpstreamProtocolError("x")))] == ["error"]
    # As the pipeline drives it: the assembler's finish raises and stays open for
    # its fail, whose bytes end the stream; no message_delta, no message_stop.
    asm = ResponseAssembler("msg_x", "m", 1, stream=True, codec=CODECS["messages"])
    out = b"".join(asm.feed(d, 0.0) for d in deltas)
    with pytest.raises(UpstreamProtocolError) as streamed:
        asm.finish(1.0)
    events = sse(out + (asm.fail(streamed.value) or b""))
    names = [n for n, _ in events]
    assert names[-1] == "error"
    assert "message_delta" not in names
    assert "message_stop" not in names
    assert events[-1][1]["error"]["type"] == "api_error"
    assert "[upstream_protocol_error]" in events[-1][1]["error"]["message"]
    whole = ResponseAssembler("msg_x", "m", 1, stream=False, codec=CODECS["messages"])
    for d in deltas:
        whole.feed(d, 0.0)
    with pytest.raises(UpstreamProtocolError) as unstreamed:
        whole.finish(1.0)
    assert str(unstreamed.value) == str(streamed.value)


@pytest.mark.parametrize(
    ("err", "status", "kind"),
    [
        (BadRequest("bad", param="x"), 400, "invalid_request_error"),
        (PolicyViolation("blocked", code="anti_fraud"), 403, "permission_error"),
        (Overloaded("busy"), 529, "overloaded_error"),
        (StageDeadlineExceeded("context"), 504, "timeout_error"),
        (UpstreamError("down"), 502, "api_error"),
    ],
)
def test_every_gateway_error_has_anthropics_shape(
    err: GatewayError, status: int, kind: str
) -> None:
    got, body = anthropic_api.error_body(err)
    assert got == status
    data = json.loads(body)
    assert data["type"] == "error"
    assert data["error"]["type"] == kind
    assert err.message in data["error"]["message"]


# --- decoders -------------------------------------------------------------------


def chat(codec: str, body: dict[str, Any]) -> dict[str, Any]:
    """The Chat body a translated route of ``codec`` makes of ``body``."""
    c = CODECS[codec]
    raw, view = c.decode(json.dumps(body).encode())
    c.translated(view)
    out: dict[str, Any] = msgspec.json.decode(raw)
    return out


def test_responses_items_become_chat_messages() -> None:
    got = chat(
        "responses",
        {
            "model": "m",
            "instructions": "be brief",
            "max_output_tokens": 50,
            "reasoning": {"effort": "low"},
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "hi"},
                        {"type": "input_image", "image_url": "https://x/i.png"},
                    ],
                },
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "think"}],
                },
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "f", "arguments": '{"a":1}'},
                {"type": "function_call_output", "call_id": "c1", "output": "one"},
                {"type": "function_call_output", "call_id": "c2", "output": "two"},
            ],
        },
    )
    assert got["messages"] == [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "hi"},
                {"type": "image_url", "image_url": {"url": "https://x/i.png"}},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}},
            ],
            "reasoning_content": "think",
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]
    assert got["max_completion_tokens"] == 50
    assert got["reasoning_effort"] == "low"
    assert got["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert got["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert got["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "s", "schema": {"type": "object"}},
    }


def test_messages_blocks_become_chat_messages() -> None:
    got = chat(
        "messages",
        {
            "model": "m",
            "max_tokens": 64,
            "system": [{"type": "text", "text": "be brief"}],
            "stop_sequences": ["END"],
            "top_k": 5,
            "metadata": {"user_id": "u1"},
            "thinking": {"type": "enabled", "budget_tokens": 2000},
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look"},
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AAA"},
                        },
                    ],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": ""},
                        {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
                        {"type": "tool_use", "id": "t2", "name": "f", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "one"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "t2",
                            "content": [{"type": "text", "text": "two"}],
                        },
                        {"type": "text", "text": "and?"},
                    ],
                },
            ],
        },
    )
    assert got["messages"] == [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}},
                {"id": "t2", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            ],
            "reasoning_content": "hm",
        },
        {"role": "tool", "tool_call_id": "t1", "content": "one"},
        {"role": "tool", "tool_call_id": "t2", "content": "two"},
        {"role": "user", "content": [{"type": "text", "text": "and?"}]},
    ]
    assert got["max_tokens"] == 64
    assert got["stop"] == ["END"]
    assert got["top_k"] == 5
    assert got["user"] == "u1"
    assert got["reasoning_effort"] == "low"
    assert got["tool_choice"] == "required"
    assert got["parallel_tool_calls"] is False


known = {
    "responses": set(responses_api.ResponsesRequest.__struct_fields__),
    "messages": set(anthropic_api.MessagesRequest.__struct_fields__),
}
BASE: dict[str, dict[str, Any]] = {
    "responses": {"model": "m", "input": "hi"},
    "messages": {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
}


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(["responses", "messages"]),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=20),
)
def test_a_field_without_equivalent_is_refused_naming_it(codec: str, field: str) -> None:
    if field in known[codec]:
        return
    with pytest.raises(BadRequest) as err:
        chat(codec, {**BASE[codec], field: 1})
    assert err.value.param == field
    assert err.value.code == "unsupported_field"


@pytest.mark.parametrize(
    ("codec", "body", "param"),
    [
        ("responses", {"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type"),
        (
            "responses",
            {
                "input": "x",
                "tools": [{"type": "web_search"}],
                "tool_choice": {"type": "web_search"},
            },
            "tool_choice",
        ),
        ("responses", {"input": "x", "background": True}, "background"),
        (
            "messages",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t",
                                "content": "x",
                                "is_error": True,
                            }
                        ],
                    }
                ]
            },
            "messages[0].content[0].is_error",
        ),
        ("messages", {"tools": [{"type": "web_search_20250305", "name": "w"}]}, "tools[0].type"),
    ],
)
def test_what_has_no_equivalent_is_refused_by_name(
    codec: str, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as err:
        chat(codec, {**BASE[codec], **body})
    assert err.value.param == param


def test_hints_a_translation_cannot_honour_are_dropped_and_named() -> None:
    block = {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}
    body = {
        **BASE["messages"],
        "system": [block],
        "messages": [
            {"role": "user", "content": [block]},
            {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "opaque"}]},
            {"role": "user", "content": "go on"},
        ],
        "context_management": {"edits": []},
    }
    c = CODECS["messages"]
    raw, view = c.decode(json.dumps(body).encode())
    dropped = c.translated(view)
    assert set(getattr(dropped, "dropped", ())) == {
        "cache_control",
        "redacted_thinking",
        "context_management",
    }
    out = msgspec.json.decode(raw)
    assert [m["role"] for m in out["messages"]] == ["system", "user", "assistant", "user"]


def test_a_tools_eager_input_streaming_is_a_hint() -> None:
    # The Vercel AI SDK's Anthropic provider sets it on every tool: a translated route
    # offers the tool and names what it left out, rather than refusing the request.
    tool = {
        "name": "get_weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        "eager_input_streaming": True,
    }
    c = CODECS["messages"]
    raw, view = c.decode(json.dumps({**BASE["messages"], "tools": [tool]}).encode())
    assert getattr(c.translated(view), "dropped", ()) == ("eager_input_streaming",)
    [offered] = msgspec.json.decode(raw)["tools"]
    assert offered["function"]["name"] == "get_weather"
    assert offered["function"]["parameters"] == tool["input_schema"]


def test_structured_outputs_become_a_json_schema_response_format() -> None:
    # ChatAnthropic's with_structured_output(method="json_schema") and the SDK's
    # messages.parse send output_config.format; a Chat backend gets response_format.
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    c = CODECS["messages"]
    body = {
        **BASE["messages"],
        "output_config": {"format": {"type": "json_schema", "schema": schema}},
    }
    raw, view = c.decode(json.dumps(body).encode())
    assert getattr(c.translated(view), "dropped", ()) == ()
    assert msgspec.json.decode(raw)["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }
    # what has no Chat equivalent is still refused on a translated route
    for config, param in [
        ({"effort": "low"}, "output_config.effort"),
        ({"format": {"type": "xml"}}, "output_config.format"),
    ]:
        _, view = c.decode(json.dumps({**BASE["messages"], "output_config": config}).encode())
        with pytest.raises(BadRequest) as err:
            c.translated(view)
        assert err.value.param == param


def test_a_native_route_carries_every_field_untouched() -> None:
    body = json.dumps(
        {
            **BASE["messages"],
            "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
            "tools": [{"type": "web_search_20250305", "name": "w"}],
            "container": "c-1",
        }
    ).encode()
    _, view = CODECS["messages"].decode(body)
    assert CODECS["messages"].native is not None
    # Nothing refused: what Chat has no place for is noted, for a translated route.
    assert {name for name, _ in getattr(view, "notes", ())} == {
        "context_management",
        "web_search_20250305",
        "container",
    }


# Bodies shaped like each API's, with any JSON where the values go.
anything = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=3), inner, max_size=2)
    ),
    max_leaves=6,
)


def shaped(kinds: dict[str, list[str]], inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A dict of one of the ``kinds`` (``type`` -> its keys) with some of its keys, or any JSON."""
    return anything | st.one_of(
        [
            st.fixed_dictionaries({"type": st.just(kind)}, optional=dict.fromkeys(keys, inner))
            for kind, keys in kinds.items()
        ]
    )


SOURCE = shaped({"base64": ["media_type", "data"], "url": ["url"], "file": []}, anything)
INNER = shaped({"text": ["text"], "image": ["source"]}, anything)
BLOCK = shaped(
    {
        "text": ["text"],
        "image": ["source"],
        "document": ["source", "title"],
        "tool_use": ["id", "name", "input"],
        "tool_result": ["tool_use_id", "content", "is_error"],
        "thinking": ["thinking", "signature"],
        "other": ["text"],
    },
    anything | SOURCE | st.lists(INNER, max_size=2),
)
MESSAGE = anything | st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system"])},
    optional={"content": anything | st.lists(BLOCK, max_size=3)},
)
PART = shaped(
    {
        "input_text": ["text"],
        "output_text": ["text", "annotations"],
        "input_image": ["image_url", "detail"],
        "input_file": ["file_data", "filename", "file_id"],
        "refusal": ["refusal"],
        "other": [],
    },
    anything,
)
ITEM = st.fixed_dictionaries(
    {"type": st.just("message"), "role": st.sampled_from(["user", "assistant", "developer"])},
    optional={"content": anything | st.lists(PART, max_size=3)},
) | shaped(
    {
        "function_call": ["call_id", "name", "arguments"],
        "function_call_output": ["call_id", "output"],
        "reasoning": ["summary", "content"],
        "item_reference": ["id"],
    },
    anything | st.sampled_from(["user", "assistant", "developer"]) | st.lists(PART, max_size=3),
)
TOOL = shaped(
    {"function": ["name", "parameters"], "custom": ["name", "input_schema"], "web_search": []},
    anything,
)
BODIES = {
    "messages": st.fixed_dictionaries(
        {"messages": st.lists(MESSAGE, max_size=3)},
        optional={
            "system": anything | st.lists(BLOCK, max_size=2),
            "tools": st.lists(TOOL, max_size=2),
            "tool_choice": shaped({"auto": [], "any": [], "tool": ["name"], "none": []}, anything),
            "thinking": shaped({"enabled": ["budget_tokens"], "disabled": []}, anything),
            "metadata": anything,
        },
    ),
    "responses": st.fixed_dictionaries(
        {"input": st.text(max_size=3) | st.lists(ITEM, max_size=3)},
        optional={
            "tools": st.lists(TOOL, max_size=2),
            "tool_choice": shaped({"function": ["name"]}, anything),
            "text": st.fixed_dictionaries(
                {}, optional={"format": shaped({"json_schema": ["name", "schema"]}, anything)}
            ),
        },
    ),
}


@settings(max_examples=500, deadline=None)
@given(st.data())
def test_any_body_is_decoded_or_refused_with_a_400(data: st.DataObject) -> None:
    codec = data.draw(st.sampled_from(["responses", "messages"]))
    body = data.draw(BODIES[codec])
    with contextlib.suppress(BadRequest):  # anything else escapes and fails the test
        chat(codec, {**BASE[codec], **body})
