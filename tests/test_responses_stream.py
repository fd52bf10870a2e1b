"""The Responses event stream decoder (adapters/responses_stream.py), pure: the streams
aiserve-sim's Responses dialect writes (rendered without a server) decode to the reply the
sim decided, split at any byte; hand-written events cover what the sim never sends (text
or arguments only in ``.done``, a refusal, a failure, a cut stream)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from aiserve_trio.adapters.base import Delta
from aiserve_trio.adapters.responses_stream import ResponsesStreamDecoder
from aiserve_trio.core.errors import UpstreamProtocolError, UpstreamStatusError
from aiserve_trio.sim.core import Prepared, SimCore
from aiserve_trio.sim.model import SimSettings
from aiserve_trio.sim.responses import ResponsesDialect

SHELL: Any = {
    "type": "function",
    "name": "shell",
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
}


def sim_stream(**body: Any) -> tuple[bytes, Prepared]:
    """The bytes aiserve-sim streams for a Responses request ``body``, and its decision."""
    core = SimCore(SimSettings(seed=3))
    ask = ResponsesDialect().read("/v1/responses", "", json.dumps(body).encode())
    assert ask.render is not None
    r = ask.render
    decided = core.decide_for(ask)
    ready = core.prepare(decided, ask.max_tokens)
    tokens = b"".join(r.token(ready, k) for k in range(ready.plan.tokens))
    return r.opening(ready, ask.model) + tokens + r.closing(ready, ask.model), ready


def decode(reads: list[bytes]) -> tuple[list[Delta], Delta]:
    dec = ResponsesStreamDecoder("up")
    out: list[Delta] = []
    for data in reads:
        out += dec.feed(data)
        dec.check()
    return out, dec.end()


def split(data: bytes, step: int) -> list[bytes]:
    return [data[i : i + step] for i in range(0, len(data), step)]


def summary(deltas: list[Delta]) -> dict[str, Any]:
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        for c in d.tool_calls or ():
            call = calls.setdefault(c.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += c.id or ""
            call["name"] += c.name or ""
            call["arguments"] += c.arguments
    return {
        "text": "".join(d.text for d in deltas),
        "reasoning": "".join(d.reasoning for d in deltas),
        "refusal": "".join(d.refusal for d in deltas),
        "calls": [calls[i] for i in sorted(calls)],
    }


@pytest.mark.parametrize("step", [1, 7, 64, 1 << 20])
def test_a_text_reply_decodes_to_what_the_sim_said(step: int) -> None:
    data, ready = sim_stream(model="sim-model", input="hi", reasoning={"effort": "low"})
    deltas, last = decode(split(data, step))
    got = summary(deltas)
    assert got["text"] == ready.script.visible_text(ready.plan.visible)
    assert got["reasoning"] == "".join(ready.script.reasoning)
    assert got["calls"] == []
    assert last.finish_reason == "stop"
    assert last.usage is not None
    assert last.usage.prompt_tokens == ready.prompt_tokens
    assert last.usage.completion_tokens == ready.plan.tokens
    assert last.usage.completion_details is not None
    assert json.loads(bytes(last.usage.completion_details)) == {"reasoning_tokens": 3}


@pytest.mark.parametrize("step", [1, 13, 1 << 20])
def test_a_function_call_decodes_to_one_tool_call(step: int) -> None:
    data, ready = sim_stream(
        model="sim-model",
        input='list it\nsim-call: shell {"command": "ls -l"}',
        tools=[SHELL],
        reasoning={"effort": "minimal"},
        include=["reasoning.encrypted_content"],
    )
    deltas, last = decode(split(data, step))
    assert ready.script.tool is not None
    assert summary(deltas)["calls"] == [
        {"id": ready.script.tool.call_id, "name": "shell", "arguments": '{"command":"ls -l"}'}
    ]
    assert last.finish_reason == "tool_calls"
    # The call opens with its id and name, alone; its arguments follow in order.
    first = next(d for d in deltas if d.tool_calls)
    assert first.tool_calls is not None
    assert first.tool_calls[0].name == "shell"
    assert first.tool_calls[0].type == "function"


def test_a_reply_cut_at_max_output_tokens_finishes_with_length() -> None:
    data, _ = sim_stream(model="sim-model", input="hi", max_output_tokens=2)
    deltas, last = decode([data])
    assert last.finish_reason == "length"
    assert last.usage is not None
    assert last.usage.completion_tokens == 2
    assert summary(deltas)["text"]


def events(*objs: dict[str, Any]) -> bytes:
    return b"".join(
        b"event: %s\ndata: %s\n\n" % (o["type"].encode(), json.dumps(o).encode()) for o in objs
    )


COMPLETED = {"type": "response.completed", "response": {"usage": None}}


def test_text_and_arguments_sent_only_whole_are_taken_from_done() -> None:
    data = events(
        {"type": "response.output_item.added", "output_index": 0, "item": {"type": "message"}},
        {"type": "response.output_text.done", "output_index": 0, "text": "whole text"},
        {
            "type": "response.output_item.added",
            "output_index": 1,
            "item": {"type": "function_call", "call_id": "c1", "name": "f", "arguments": ""},
        },
        {"type": "response.function_call_arguments.done", "output_index": 1, "arguments": "{}"},
        COMPLETED,
    )
    deltas, last = decode([data])
    got = summary(deltas)
    assert got["text"] == "whole text"
    assert got["calls"] == [{"id": "c1", "name": "f", "arguments": "{}"}]
    assert last.finish_reason == "tool_calls"
    assert last.usage is None  # none given: the caller counts


def test_done_does_not_repeat_what_was_streamed() -> None:
    data = events(
        {"type": "response.output_text.delta", "output_index": 0, "delta": "ab"},
        {"type": "response.output_text.done", "output_index": 0, "text": "ab"},
        {"type": "response.refusal.delta", "output_index": 0, "delta": "no"},
        COMPLETED,
    )
    deltas, _ = decode([data])
    assert summary(deltas) == {"text": "ab", "reasoning": "", "refusal": "no", "calls": []}


def test_a_failure_mid_stream_is_raised_after_what_came_before() -> None:
    dec = ResponsesStreamDecoder("up")
    out = dec.feed(
        events(
            {"type": "response.output_text.delta", "output_index": 0, "delta": "partial"},
            {"type": "response.failed", "response": {"error": {"message": "overloaded"}}},
        )
    )
    assert summary(out)["text"] == "partial"
    with pytest.raises(UpstreamProtocolError, match="overloaded"):
        dec.check()


@pytest.mark.parametrize(
    "data",
    [
        events({"type": "response.output_text.delta", "output_index": 0, "delta": "x"}),
        b"event: response.output_text.delta\ndata: {not json\n\n",
        events({"type": "response.function_call_arguments.delta", "output_index": 4, "delta": "{"}),
    ],
)
def test_a_stream_cut_short_or_broken_is_an_error(data: bytes) -> None:
    dec = ResponsesStreamDecoder("up")
    dec.feed(data)
    with pytest.raises(UpstreamProtocolError):
        dec.end()


def test_nothing_after_the_end_counts() -> None:
    deltas, last = decode(
        [events(COMPLETED), events({"type": "response.output_text.delta", "delta": "late"})]
    )
    assert deltas == []
    assert last.finish_reason == "stop"


def test_what_does_not_join_keeps_its_place_in_the_read() -> None:
    data = events(
        {"type": "response.output_text.delta", "output_index": 0, "delta": "ab"},
        {"type": "response.refusal.delta", "output_index": 0, "delta": "no"},
        {"type": "response.output_text.delta", "output_index": 0, "delta": "cd"},
        COMPLETED,
    )
    deltas, _ = decode([data])
    assert [(d.text, d.refusal) for d in deltas] == [("ab", ""), ("", "no"), ("cd", "")]


@pytest.mark.parametrize(
    ("failure", "status"),
    [
        ({"type": "error", "code": "rate_limit_exceeded", "message": "slow down"}, 429),
        (
            {
                "type": "response.failed",
                "response": {"error": {"code": "server_error", "message": "oops"}},
            },
            500,
        ),
    ],
)
def test_a_rate_limit_or_server_error_mid_stream_is_a_status(
    failure: dict[str, Any], status: int
) -> None:
    dec = ResponsesStreamDecoder("up")
    dec.feed(events(failure))
    with pytest.raises(UpstreamStatusError) as err:
        dec.check()
    assert err.value.upstream_status == status
