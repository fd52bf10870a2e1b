"""aiserve-sim's Responses dialect (``POST /v1/responses``) through the official ``openai`` SDK,
in-process (httpx's ASGI transport): streamed and whole replies with a function tool,
reasoning with ``encrypted_content`` when ``include`` asks for it, the round trip after the
tool's output, structured output, a cut reply, and the errors OpenAI gives."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import openai
import pytest
import trio
import trio.testing

from aiserve_trio.sim import responses as sim_responses
from aiserve_trio.sim.dialect import DialectError

from .test_sim_chat import TOOL_RESULT, Weather, sim

pytestmark = [
    pytest.mark.filterwarnings("ignore:Async generator .(httpx2?|openai)\\.:ResourceWarning"),
]

SHELL: Any = {
    "type": "function",
    "name": "shell",
    "description": "Runs a shell command.",
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture
async def client() -> AsyncIterator[openai.AsyncOpenAI]:
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=sim()), base_url="http://sim")
    async with http:
        yield openai.AsyncOpenAI(api_key="sk-sim", base_url="http://sim/v1", http_client=http)


async def test_a_streamed_function_call_with_encrypted_reasoning(
    autojump_clock: trio.testing.MockClock, client: openai.AsyncOpenAI
) -> None:
    stream = await client.responses.create(
        model="sim-model",
        input="list the files",
        tools=[SHELL],
        reasoning={"effort": "low"},
        include=["reasoning.encrypted_content"],
        stream=True,
    )
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds.count("response.reasoning_text.delta") == 3  # effort low: three pieces
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # The arguments streamed in pieces are the call's arguments.
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = events[-1]
    assert done.type == "response.completed"
    final = done.response
    reasoning, call = final.output
    assert reasoning.type == "reasoning"
    assert reasoning.encrypted_content
    assert call.type == "function_call"
    assert call.name == "shell"
    assert call.call_id.startswith("call_")
    assert call.arguments == args
    assert set(json.loads(args)) == {"command"}
    assert final.usage is not None
    assert final.usage.output_tokens_details.reasoning_tokens == 3
    assert final.usage.total_tokens == final.usage.input_tokens + final.usage.output_tokens


async def test_without_include_a_reasoning_item_has_no_encrypted_content(
    autojump_clock: trio.testing.MockClock, client: openai.AsyncOpenAI
) -> None:
    r = await client.responses.create(model="sim-model", input="hi", reasoning={"effort": "low"})
    assert [item.type for item in r.output] == ["reasoning", "message"]
    reasoning = r.output[0]
    assert reasoning.type == "reasoning"
    assert reasoning.encrypted_content is None
    assert r.output_text


async def test_the_round_trip_after_the_tools_output_ends_with_text_quoting_it(
    autojump_clock: trio.testing.MockClock, client: openai.AsyncOpenAI
) -> None:
    first = await client.responses.create(
        model="sim-model",
        input='run ls\nsim-call: shell {"command": "ls -l"}',
        tools=[SHELL],
        reasoning={"effort": "minimal"},
        include=["reasoning.encrypted_content"],
    )
    reasoning, call = first.output
    assert call.type == "function_call"
    assert json.loads(call.arguments) == {"command": "ls -l"}  # the directive, exactly
    assert first.status == "completed"
    history: Any = [
        {"role": "user", "content": "run ls"},
        reasoning.model_dump(exclude_none=True),
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT},
    ]
    second = await client.responses.create(
        model="sim-model", input=history, tools=[SHELL], stream=True
    )
    final = [e async for e in second][-1]
    assert final.type == "response.completed"
    assert final.response.output_text.startswith(f"The tool returned: {TOOL_RESULT}")
    # Encrypted reasoning the sim did not write is refused, as OpenAI refuses it.
    history[1]["encrypted_content"] = "Zm9yZ2Vk"
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.create(model="sim-model", input=history, tools=[SHELL])
    assert err.value.code == "invalid_encrypted_content"


#: A ``namespace`` tool as Codex CLI offers an MCP server's tools (``mcp__<server>``).
CRM: Any = {
    "type": "namespace",
    "name": "mcp__crm",
    "description": "The CRM server's tools.",
    "tools": [
        {"type": "function", "name": "lookup", "parameters": {"type": "object"}},
        {"type": "function", "name": "orders", "parameters": {"type": "object"}},
    ],
}


async def test_a_function_in_a_namespace_is_called_with_its_namespace(
    autojump_clock: trio.testing.MockClock, client: openai.AsyncOpenAI
) -> None:
    """``sim-call: <namespace>__<function>`` calls a namespaced function as OpenAI's API
    does: its own ``name`` and the ``namespace`` (Codex CLI routes the call by both); the
    round trip with that call in the history ends with text quoting the output."""
    ask = 'who is 7?\nsim-call: mcp__crm__orders {"id": 7}'
    first = await client.responses.create(model="sim-model", input=ask, tools=[SHELL, CRM])
    (call,) = first.output
    assert call.type == "function_call"
    assert (call.model_dump().get("namespace"), call.name) == ("mcp__crm", "orders")
    async with client.responses.stream(model="sim-model", input=ask, tools=[SHELL, CRM]) as stream:
        added = [e async for e in stream if e.type == "response.output_item.added"]
    assert added[0].item.model_dump().get("namespace") == "mcp__crm"
    # A function outside any namespace is called without one.
    plain = await client.responses.create(
        model="sim-model", input='sim-call: shell {"command": "ls"}', tools=[SHELL, CRM]
    )
    assert "namespace" not in plain.output[0].model_dump(exclude_none=True)
    history: Any = [
        {"role": "user", "content": ask},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT},
    ]
    second = await client.responses.create(model="sim-model", input=history, tools=[CRM])
    assert second.output_text.startswith(f"The tool returned: {TOOL_RESULT}")


async def test_structured_output_parses(
    autojump_clock: trio.testing.MockClock, client: openai.AsyncOpenAI
) -> None:
    r = await client.responses.parse(model="sim-model", input="forecast", text_format=Weather)
    assert r.output_parsed == Weather(city="sim", days=1, unit="sim")


async def test_a_reply_cut_by_max_output_tokens_is_incomplete(
    autojump_clock: trio.testing.MockClock, client: openai.AsyncOpenAI
) -> None:
    r = await client.responses.create(model="sim-model", input="hi", max_output_tokens=2)
    assert r.status == "incomplete"
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None
    assert r.usage.output_tokens == 2
    async with client.responses.stream(
        model="sim-model", input="hi", max_output_tokens=2
    ) as stream:
        kinds = [e.type async for e in stream]
    assert kinds[-1] == "response.incomplete"


async def test_a_request_without_a_key_is_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    transport = httpx2.ASGITransport(app=sim())
    async with httpx2.AsyncClient(transport=transport, base_url="http://sim") as http:
        r = await http.post("/v1/responses", json={"model": "sim-model", "input": "hi"})
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_encrypted_content_is_opaque_and_only_the_sims_is_read_back() -> None:
    sealed = sim_responses.seal("I should list the files.")
    assert "list the files" not in sealed
    sim_responses.messages(sim_responses._request.decode(reasoning_input(sealed)))
    with pytest.raises(DialectError, match="could not be verified"):
        sim_responses.messages(sim_responses._request.decode(reasoning_input("bm90IG91cnM=")))


def reasoning_input(encrypted: str) -> bytes:
    item = {"type": "reasoning", "summary": [], "encrypted_content": encrypted}
    return json.dumps({"input": [item, {"role": "user", "content": "go on"}]}).encode()
