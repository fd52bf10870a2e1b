"""A Responses request as Codex CLI sends it, on a route whose backend speaks Chat Completions:
what Chat Completions cannot honour and the answer means the same without -- ``include``,
``reasoning.summary``, ``client_metadata``, tools other than ``function`` and ``namespace``
(a namespace's functions go on under flat names: tests/test_responses_namespace.py), a
namespace's ``description``, a reasoning item's ``encrypted_content`` -- is dropped and
named in ``X-Aiserve-Dropped``; what would
change the answer's meaning (a ``tool_choice`` forcing a dropped tool, ``background``, a
field the codec does not know) is still a 400 naming it. A hint the route's backend cannot
carry (``prompt_cache_key`` on the mock) is dropped and named too; on chat it is refused."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from aiserve_trio.adapters.mock import MockAdapter
from aiserve_trio.apis import responses
from aiserve_trio.config import MockAdapterConfig
from aiserve_trio.core.errors import BadRequest
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client
from .conftest import make_config
from .fakes import RecordingAdapter

EXEC: dict[str, Any] = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command in a PTY.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string"}},
        "required": ["cmd"],
        "additionalProperties": False,
    },
}
NAMESPACE: dict[str, Any] = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for spawning and managing sub-agents.",
    "tools": [{"type": "function", "name": "close_agent", "parameters": {"type": "object"}}],
}
WEB_SEARCH: dict[str, Any] = {"type": "web_search", "external_web_access": True}


def codex_body(**over: Any) -> dict[str, Any]:
    """The shape of Codex CLI 0.171's first request of a turn (captured, trimmed)."""
    body: dict[str, Any] = {
        "model": "aiserve-mock",
        "stream": True,
        "input": [
            {
                "type": "message",
                "id": "msg_1",
                "role": "developer",
                "content": [{"type": "input_text", "text": "You are a coding agent."}],
            },
            {
                "type": "message",
                "id": "msg_2",
                "role": "user",
                "content": [{"type": "input_text", "text": "run cat NOTE.txt"}],
            },
        ],
        "tools": [EXEC, NAMESPACE, WEB_SEARCH],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "01a24328-2869-7452-9917-96fbd28600e4",
        "client_metadata": {"session_id": "01a24328", "x-codex-window-id": "01a24328:0"},
    }
    return body | over


def decode(body: dict[str, Any]) -> tuple[dict[str, Any], responses.ResponsesRequest]:
    raw, view = responses.decode(json.dumps(body).encode())
    return msgspec.json.decode(raw), view


def test_codex_request_is_carried_and_what_chat_cannot_honour_is_named() -> None:
    chat, view = decode(codex_body())
    assert view.dropped == (
        "include",
        "reasoning.summary",
        "client_metadata",
        "tools[1].description",
        "tools[2]:web_search",
    )
    # The function tools (the namespace's under a flat name), the caching hint and the
    # parallel calls go on; the rest does not.
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {k: EXEC[k] for k in ("name", "description", "strict", "parameters")},
        },
        {
            "type": "function",
            "function": {
                "name": "multi_agent_v1__close_agent",
                "parameters": {"type": "object"},
            },
        },
    ]
    assert chat["tool_choice"] == "auto"
    assert chat["prompt_cache_key"] == "01a24328-2869-7452-9917-96fbd28600e4"
    assert chat["parallel_tool_calls"] is True
    for gone in ("include", "reasoning", "reasoning_effort", "client_metadata", "store"):
        assert gone not in chat
    assert [m["role"] for m in chat["messages"]] == ["developer", "user"]


def test_an_encrypted_reasoning_item_keeps_its_text_and_loses_what_only_openai_can_read() -> None:
    history = [
        {"type": "message", "role": "user", "content": "run it"},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "I should run it."}],
            "encrypted_content": "gAAAAB-opaque",
        },
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "exec_command",
            "arguments": '{"cmd":"cat NOTE.txt"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "PELICAN-42"},
    ]
    chat, view = decode(codex_body(input=history))
    assert "input[1].encrypted_content" in view.dropped
    turn = chat["messages"][1]
    assert turn["reasoning_content"] == "I should run it."
    assert turn["tool_calls"][0]["function"]["arguments"] == '{"cmd":"cat NOTE.txt"}'
    assert chat["messages"][2] == {
        "role": "tool",
        "tool_call_id": "call_1",
        "content": "PELICAN-42",
    }


def test_a_plain_request_drops_nothing() -> None:
    _, view = decode({"model": "m", "input": "hi", "tools": [EXEC], "reasoning": {"effort": "low"}})
    assert view.dropped == ()


@pytest.mark.parametrize(
    ("over", "param"),
    [
        # Forcing a call when every tool offered was dropped would change the answer.
        ({"tools": [WEB_SEARCH], "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
    ],
)
def test_what_would_change_the_answer_is_still_refused_by_name(
    over: dict[str, Any], param: str
) -> None:
    _, view = decode(codex_body(**over))  # a native route would carry it
    with pytest.raises(BadRequest) as err:
        responses.translated(view)  # a translated route refuses it
    assert err.value.param == param
    assert err.value.status == 400


def test_only_dropped_tools_and_auto_choice_ask_for_no_tools() -> None:
    chat, view = decode(codex_body(tools=[WEB_SEARCH], tool_choice="auto"))
    assert "tools" not in chat
    assert "tool_choice" not in chat
    assert view.dropped[-1] == "tools[0]:web_search"


def recording() -> tuple[Client, RecordingAdapter]:
    cfg = make_config()
    mock_cfg = cfg.adapters["mock"]
    assert isinstance(mock_cfg, MockAdapterConfig)
    rec = RecordingAdapter(MockAdapter("mock", mock_cfg))
    return Client(App(cfg, adapters={"mock": rec})), rec


@pytest.mark.parametrize("stream", [True, False])
async def test_the_client_is_told_what_was_dropped(autojump_clock: Any, stream: bool) -> None:
    client, rec = recording()
    body = codex_body(stream=stream)
    # The mock carries no parallel calls: a constraint, still refused (below).
    del body["parallel_tool_calls"]
    r = await client.request("POST", "/v1/responses", json_body=body)
    assert r.status == 200
    # The mock cannot carry a prompt-cache key either: a hint, dropped and named too.
    assert r.headers["x-aiserve-dropped"] == (
        "include, reasoning.summary, client_metadata, tools[1].description, "
        "tools[2]:web_search, prompt_cache_key"
    )
    asked = rec.requests[-1]
    assert asked.tool_names == ["exec_command", "multi_agent_v1__close_agent"]
    for gone in ("include", "reasoning", "client_metadata", "prompt_cache_key"):
        assert gone not in asked.extra
    if stream:
        assert json.loads(r.events()[-1])["type"] == "response.completed"
    else:
        assert r.json()["status"] == "completed"
    plain = await client.request(
        "POST", "/v1/responses", json_body={"model": "aiserve-mock", "input": "hi"}
    )
    assert plain.status == 200
    assert "x-aiserve-dropped" not in plain.headers


async def test_a_field_the_backend_cannot_carry_that_is_no_hint_is_still_refused(
    autojump_clock: Any,
) -> None:
    client, _ = recording()
    r = await client.request("POST", "/v1/responses", json_body=codex_body())
    assert r.status == 400
    assert r.json()["error"]["param"] == "parallel_tool_calls"
    # On chat, a hint the backend cannot carry is refused as any other field.
    chat = {"model": "aiserve-mock", "messages": [{"role": "user", "content": "hi"}]}
    r = await client.chat({**chat, "prompt_cache_key": "k"})
    assert r.status == 400
    assert r.json()["error"]["param"] == "prompt_cache_key"
