"""gdpr-redact on the tool calls of the model's output (issue 51, item 2): numbers,
object keys, arguments that are not strict JSON, the call's name and id -- in
every API's shape, streamed and whole, however the arguments are split."""

from __future__ import annotations

import json

import pytest

from aiserve_trio.adapters.base import Delta, ToolCallDelta
from aiserve_trio.apis import CODECS, chat
from aiserve_trio.apis.responses import ResponsesRequest
from aiserve_trio.config import build_policies
from aiserve_trio.policies.base import OutputFilter, PolicyContext
from aiserve_trio.stages.assembler import ResponseAssembler

from .conftest import make_config

(REDACT,) = build_policies(["gdpr-redact"], make_config())
CTX = PolicyContext(route="chat", channel="app", tenant="t", request_id="r")
#: What must not come out (as a run of digits, or at all).
TELLS = ("13800138000", "4111111111111111", "4111 1111", "jane.doe", "example.org")


def side() -> list[OutputFilter]:
    flt = REDACT.output_filter(CTX)
    assert flt is not None
    return [flt]


def reply(
    kind: str, stream: bool, arguments: str, *, name: str = "lookup", ident: str = "call_1"
) -> str:
    """The reply's bytes for one tool call whose arguments arrive in 3-character pieces."""
    asm = ResponseAssembler(
        "resp_1" if kind == "responses" else "msg_1",
        "m",
        7,
        stream=stream,
        filters=side(),
        side_filters=side,
        codec=CODECS.get(kind, chat.CODEC),
        view=ResponsesRequest(input="hi") if kind == "responses" else None,
    )
    out = asm.feed(
        Delta(tool_calls=[ToolCallDelta(index=0, id=ident, type="function", name=name)]), 0.0
    )
    for i in range(0, len(arguments), 3):
        frag = ToolCallDelta(index=0, arguments=arguments[i : i + 3])
        out += asm.feed(Delta(tool_calls=[frag]), 1.0)
    out += asm.feed(Delta(finish_reason="tool_calls"), 2.0)
    try:
        out += asm.finish(3.0)
    except Exception:  # Messages cannot end a call whose input is not an object
        if kind != "messages":
            raise
    return out.decode()


def leaks(raw: str) -> list[str]:
    """The tells in the reply, or in the strings its events stream in pieces."""
    pieces: list[str] = []

    def walk(v: object) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                if k in ("arguments", "delta", "partial_json") and isinstance(x, str):
                    pieces.append(x)
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    for line in raw.splitlines():
        if line.startswith("data: {"):
            walk(json.loads(line[6:]))
    flat = (raw + "".join(pieces)).replace("\\u0040", "@").replace('\\"', '"')
    return [t for t in TELLS if t in flat]


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("kind", ["chat", "responses", "messages"])
@pytest.mark.parametrize(
    "arguments",
    [
        '{"phone": 13800138000}',
        '{"card": 4111111111111111, "n": 2}',
        '{"jane.doe@example.org": "x", "13800138000": 1}',
        "{'phone': 13800138000, 'mail': 'jane.doe@example.org'}",  # a Python-style dict
        '{"a": 1}{"phone": "13800138000"}',  # two objects back to back
        "phone=13800138000 card=4111 1111 1111 1111",
        '{"q": "x"} trailing jane.doe@example.org',
    ],
    ids=["number", "card-number", "keys", "python-dict", "back-to-back", "key=value", "junk"],
)
def test_personal_data_in_tool_call_arguments_does_not_come_out(
    kind: str, stream: bool, arguments: str
) -> None:
    raw = reply(kind, stream, arguments)
    assert leaks(raw) == []
    # (a whole Messages reply whose tool input is not an object is an error: nothing out)
    assert "[" in raw or (kind == "messages" and not stream and raw == "")


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("kind", ["chat", "responses", "messages"])
def test_a_number_becomes_a_string_and_the_arguments_stay_json(kind: str, stream: bool) -> None:
    if kind != "chat" or stream:
        raw = reply(kind, stream, '{"phone": 13800138000, "n": 2}')
        assert leaks(raw) == []
        return
    body = json.loads(reply(kind, stream, '{"phone": 13800138000, "n": 2}'))
    call = body["choices"][0]["message"]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"phone": "[PHONE]", "n": 2}


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("kind", ["chat", "responses", "messages"])
def test_the_calls_name_and_id_are_redacted(kind: str, stream: bool) -> None:
    raw = reply(
        kind, stream, '{"a": 1}', name="notify_jane.doe@example.org", ident="call_13800138000"
    )
    assert leaks(raw) == []
    assert "[EMAIL]" in raw
    assert "call_[PHONE]" in raw


def test_an_ordinary_call_is_untouched() -> None:
    body = json.loads(reply("chat", False, '{"city": "Paris", "days": 3}', name="weather"))
    call = body["choices"][0]["message"]["tool_calls"][0]
    assert call["id"] == "call_1"
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Paris", "days": 3}'}
