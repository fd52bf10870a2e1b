"""Responses ``namespace`` tools on a route whose backend speaks Chat Completions (pure: the
codec and the response assembler, no server). Codex CLI offers each MCP server's tools as a
namespace (``mcp__gw``) and routes a call by its ``namespace`` and ``name``: the request
offers each function of a namespace to the Chat backend as ``<namespace>__<function>``, the
history's namespaced calls and a ``tool_choice`` naming one go the same way, and a call of
such a flat name in the reply -- whole or streamed -- comes back as the function's own
``name`` with its ``namespace``. A flat name a Chat backend cannot take, or one another tool
has, is a 400 naming the tool (on a translated route; a native one sends the namespace)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from aiserve_trio.adapters.base import Delta, ToolCallDelta, Usage
from aiserve_trio.apis import CODECS, responses
from aiserve_trio.core.errors import BadRequest
from aiserve_trio.stages.assembler import ResponseAssembler

ECHO: dict[str, Any] = {
    "type": "function",
    "name": "everything__echo",
    "description": "Echoes back the input",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"message": {"type": "string"}},
        "required": ["message"],
    },
}
SUM: dict[str, Any] = {
    "type": "function",
    "name": "everything__get_sum",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
}
#: As Codex CLI offers the gateway's /mcp configured as ``[mcp_servers.gw]``.
GW: dict[str, Any] = {
    "type": "namespace",
    "name": "mcp__gw",
    "description": "Tools of the MCP server gw",
    "tools": [ECHO, SUM],
}
EXEC: dict[str, Any] = {"type": "function", "name": "exec_command", "parameters": {}}


def decode(**body: Any) -> tuple[dict[str, Any], responses.ResponsesRequest]:
    raw, view = responses.decode(json.dumps({"model": "m", "input": "hi", **body}).encode())
    return msgspec.json.decode(raw), view


def test_each_function_of_a_namespace_is_offered_under_a_flat_name() -> None:
    tools = [EXEC, GW, {"type": "web_search"}]
    chat, view = decode(tools=tools, tool_choice="auto")
    assert [t["function"]["name"] for t in chat["tools"]] == [
        "exec_command",
        "mcp__gw__everything__echo",
        "mcp__gw__everything__get_sum",
    ]
    # The function's own description, schema and strictness go with it.
    assert chat["tools"][1]["function"] == {
        "name": "mcp__gw__everything__echo",
        "description": "Echoes back the input",
        "strict": False,
        "parameters": ECHO["parameters"],
    }
    assert chat["tool_choice"] == "auto"
    assert responses.namespaced(view) == {
        "mcp__gw__everything__echo": ("mcp__gw", "everything__echo"),
        "mcp__gw__everything__get_sum": ("mcp__gw", "everything__get_sum"),
    }
    # The namespace is carried; its description and the built-in tool are not.
    assert view.dropped == ("tools[1].description", "tools[2]:web_search")
    responses.translated(view)  # nothing refused


def test_a_namespaced_call_in_the_history_goes_back_under_its_flat_name() -> None:
    history = [
        {"type": "message", "role": "user", "content": "echo it"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "namespace": "mcp__gw",
            "name": "everything__echo",
            "arguments": '{"message":"hi"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "Echo: hi"},
    ]
    chat, view = decode(input=history, tools=[GW])
    responses.translated(view)
    assert chat["messages"][1]["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "mcp__gw__everything__echo", "arguments": '{"message":"hi"}'},
        }
    ]
    assert chat["messages"][2] == {"role": "tool", "tool_call_id": "call_1", "content": "Echo: hi"}


def test_a_tool_choice_naming_a_namespaced_function_names_its_flat_name() -> None:
    choice = {"type": "function", "namespace": "mcp__gw", "name": "everything__echo"}
    chat, view = decode(tools=[GW], tool_choice=choice)
    responses.translated(view)
    assert chat["tool_choice"] == {
        "type": "function",
        "function": {"name": "mcp__gw__everything__echo"},
    }
    # Forcing a namespace's function is no longer forcing a dropped tool.
    chat, view = decode(tools=[GW], tool_choice="required")
    responses.translated(view)
    assert chat["tool_choice"] == "required"


@pytest.mark.parametrize(
    ("tools", "param", "says"),
    [
        # 36 + 2 + 30 characters: over the 64 a Chat backend takes.
        (
            [
                {
                    "type": "namespace",
                    "name": "mcp__" + "s" * 31,
                    "tools": [{**EXEC, "name": "t" * 30}],
                }
            ],
            "tools[0].tools[0].name",
            "1 to 64",
        ),
        # A dot is a Responses name's, not a Chat one's.
        (
            [{"type": "namespace", "name": "mcp.gw", "tools": [ECHO]}],
            "tools[0].tools[0].name",
            "`mcp.gw__everything__echo`",
        ),
        # A plain function already has the flat name (before or after the namespace).
        (
            [GW, {**EXEC, "name": "mcp__gw__everything__echo"}],
            "tools[0].tools[0].name",
            "`tools[1]` has already",
        ),
        # Two namespaces whose names join into the same one.
        (
            [
                GW,
                {
                    "type": "namespace",
                    "name": "mcp",
                    "tools": [{**EXEC, "name": "gw__everything__echo"}],
                },
            ],
            "tools[1].tools[0].name",
            "`tools[0].tools[0]` has already",
        ),
    ],
)
def test_a_flat_name_that_cannot_fit_or_collides_is_refused_naming_the_tool(
    tools: list[dict[str, Any]], param: str, says: str
) -> None:
    _, view = decode(tools=tools)  # a native route sends the namespace as it is
    with pytest.raises(BadRequest) as err:
        responses.translated(view)
    assert err.value.status == 400
    assert err.value.param == param
    assert says in err.value.message


def test_a_namespace_that_is_not_one_is_refused_at_decode() -> None:
    with pytest.raises(BadRequest) as err:
        decode(tools=[{"type": "namespace", "name": "mcp__gw", "tools": "echo"}])
    assert err.value.param == "tools[0].tools"
    with pytest.raises(BadRequest) as err:
        decode(tools=[{"type": "namespace", "tools": [ECHO]}])
    assert err.value.param == "tools[0].name"


# --- the answer -------------------------------------------------------------------


def reply(*names: str) -> list[Delta]:
    """A streamed reply calling ``names`` in parallel, each name in its first fragment."""
    deltas = []
    for i, name in enumerate(names):
        first = ToolCallDelta(index=i, id=f"call_{i}", type="function", name=name)
        deltas += [Delta(tool_calls=[first])]
        deltas += [
            Delta(tool_calls=[ToolCallDelta(index=i, arguments=p)])
            for p in ('{"mes', 'sage":"hi"}')
        ]
    deltas.append(
        Delta(finish_reason="tool_calls", usage=Usage(prompt_tokens=5, completion_tokens=9))
    )
    return deltas


def assemble(deltas: list[Delta], view: object, *, stream: bool) -> bytes:
    asm = ResponseAssembler("resp_abc", "m", 1, stream=stream, codec=CODECS["responses"], view=view)
    return b"".join(asm.feed(d, 0.0) for d in deltas) + asm.finish(0.0)


def events(body: bytes) -> list[dict[str, Any]]:
    out = []
    for block in body.decode().split("\n\n"):
        if block and not block.startswith(":"):
            data = next(line for line in block.split("\n") if line.startswith("data: "))
            out.append(json.loads(data.removeprefix("data: ")))
    return out


def called(item: dict[str, Any]) -> tuple[str | None, str]:
    return item.get("namespace"), item["name"]


def test_a_call_of_a_flat_name_comes_back_with_its_namespace_whole() -> None:
    _, view = decode(tools=[EXEC, GW])
    names = ("mcp__gw__everything__echo", "exec_command")
    out = json.loads(assemble(reply(*names), view, stream=False))["output"]
    assert [called(item) for item in out] == [
        ("mcp__gw", "everything__echo"),
        (None, "exec_command"),  # a plain function's call has no namespace
    ]
    assert "namespace" not in out[1]
    assert out[0]["arguments"] == '{"message":"hi"}'
    assert out[0]["call_id"] == "call_0"


def test_a_call_of_a_flat_name_comes_back_with_its_namespace_streamed() -> None:
    _, view = decode(tools=[EXEC, GW])
    names = ("mcp__gw__everything__echo", "exec_command")
    got = events(assemble(reply(*names), view, stream=True))
    added = [e["item"] for e in got if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in got if e["type"] == "response.output_item.done"]
    final = next(e for e in got if e["type"] == "response.completed")["response"]["output"]
    for items in (added, done, final):
        assert [called(item) for item in items] == [
            ("mcp__gw", "everything__echo"),
            (None, "exec_command"),
        ]
    assert done[0]["arguments"] == '{"message":"hi"}'


def test_a_name_the_request_did_not_flatten_comes_back_as_it_is() -> None:
    # No namespace offered: a call that only looks like a flat name is left alone.
    _, view = decode(tools=[{**EXEC, "name": "mcp__gw__everything__echo"}])
    for stream in (False, True):
        body = assemble(reply("mcp__gw__everything__echo"), view, stream=stream)
        text = body.decode()
        assert '"namespace"' not in text
        assert "mcp__gw__everything__echo" in text


def test_the_redacted_view_keeps_the_flat_names() -> None:
    _, view = decode(tools=[GW], instructions="be brief")
    steps = responses.redacted_steps(view, str.upper, None)
    try:
        while True:
            next(steps)
    except StopIteration as stop:
        redacted = stop.value
    assert responses.namespaced(redacted) == responses.namespaced(view)
    out = json.loads(assemble(reply("mcp__gw__everything__echo"), redacted, stream=False))
    assert called(out["output"][0]) == ("mcp__gw", "everything__echo")
