"""aiserve-sim serves coding agents, in process on the virtual clock: Claude Code's first
turn as recorded (tests/data/claude_code_first_turn.json) is answered with a signed
thinking block and the tool call its ``sim-call:`` line asks for; its second turn (the
tool result beside reminders, a mid-conversation system message) with text quoting the
result; ``count_tokens`` counts what a message request's usage counts. The real CLI runs
against the sim in tests/test_claude_code.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio.testing

from aiserve_trio.sim.app import SimApp
from aiserve_trio.sim.model import SimSettings, Timing

from .asgi_client import Client, Response
from .claude_code import FIXTURE

AUTH = {"x-api-key": "k", "anthropic-version": "2023-06-01"}
TOOLS: Any = [
    {"name": "Agent", "input_schema": {"type": "object", "properties": {"x": {"type": "string"}}}},
    {
        "name": "Read",
        "input_schema": {
            "type": "object",
            "properties": {"file_path": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["file_path"],
        },
    },
]


def sim() -> SimApp:
    t = Timing(prefill_overhead_ms=5, prefill_per_token_ms=0, itl_ms=1, ttft_std_ms=0)
    return SimApp(SimSettings(timing=t, seed=1))


def first_turn() -> dict[str, Any]:
    return dict(json.loads(FIXTURE.read_text()))


def events(r: Response) -> list[dict[str, Any]]:
    return [json.loads(e) for e in r.events()]


def blocks(evs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The content blocks a stream builds, as a client accumulates them."""
    out: list[dict[str, Any]] = []
    for ev in evs:
        if ev["type"] == "content_block_start":
            out.append(dict(ev["content_block"]))
            out[-1].setdefault("partial", "")
        elif ev["type"] == "content_block_delta":
            b, d = out[ev["index"]], ev["delta"]
            if d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            elif d["type"] == "signature_delta":
                b["signature"] = d["signature"]
            elif d["type"] == "text_delta":
                b["text"] += d["text"]
            elif d["type"] == "input_json_delta":
                b["partial"] += d["partial_json"]
        elif ev["type"] == "content_block_stop":
            b = out[ev["index"]]
            b["stopped"] = True
            if b["type"] == "tool_use":
                b["input"] = json.loads(b["partial"] or "{}")
    return out


async def test_claude_codes_first_turn_gets_a_signed_thought_and_the_asked_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    turn = first_turn()
    body = json.loads(turn["body"])
    # What Claude Code sends that the sim must take: beta header, query string,
    # cache_control, thinking with a budget, context_management, metadata.
    assert "?beta=true" in turn["path"]
    assert "context-management" in turn["headers"]["anthropic-beta"]
    assert body["thinking"]["type"] == "enabled"
    assert {"context_management", "metadata"} <= set(body)
    assert "cache_control" in turn["body"]
    headers = {**turn["headers"], "x-api-key": "k"}
    r = await Client(sim()).request(
        "POST", turn["path"], body=turn["body"].encode(), headers=headers
    )
    assert r.status == 200, r.body
    evs = events(r)
    thought, call = blocks(evs)
    assert thought["type"] == "thinking"
    assert thought["thinking"].startswith("Let me think")
    assert thought["signature"] == "sim-signature"
    assert thought["stopped"]
    # The signature comes before its block's stop, as Anthropic sends it.
    kinds = [(e["type"], e.get("delta", {}).get("type")) for e in evs]
    sig = kinds.index(("content_block_delta", "signature_delta"))
    assert kinds[sig + 1] == ("content_block_stop", None)
    note = "/tmp/claude-code/work/NOTE.txt"
    assert call["type"] == "tool_use"
    assert (call["name"], call["input"]) == ("Read", {"file_path": note})
    assert evs[-2]["delta"]["stop_reason"] == "tool_use"


async def test_claude_codes_second_turn_is_answered_with_the_read_file(
    autojump_clock: trio.testing.MockClock,
) -> None:
    body: dict[str, Any] = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 32000,
        "stream": True,
        "tools": TOOLS,
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "high"},
        "system": [
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}
        ],
        "messages": [
            {"role": "user", "content": 'read it\nsim-call: Read {"file_path": "/n.txt"}'},
            {"role": "system", "content": "Available agent types: ..."},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Let me", "signature": "sim-signature"},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "Read",
                        "input": {"file_path": "/n.txt"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "1\tpelican-42"}],
                        "cache_control": {"type": "ephemeral"},
                    },
                    {"type": "text", "text": "<system-reminder>nothing</system-reminder>"},
                ],
            },
        ],
    }
    r = await Client(sim()).request("POST", "/v1/messages?beta=true", json_body=body, headers=AUTH)
    assert r.status == 200, r.body
    thought, answer = blocks(events(r))
    assert thought["type"] == "thinking"  # adaptive thinking thinks too
    assert answer["type"] == "text"
    assert answer["text"].startswith("The tool returned: 1\tpelican-42")


async def test_the_sim_call_line_picks_the_tool_and_its_arguments(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = sim()
    # Without the line the sim calls the first tool with generated arguments.
    ask: Any = {"model": "m", "max_tokens": 64, "tools": TOOLS}
    plain = await Client(app).request(
        "POST",
        "/v1/messages",
        json_body={**ask, "messages": [{"role": "user", "content": "hi"}]},
        headers=AUTH,
    )
    assert plain.json()["content"][0]["name"] == "Agent"
    line = 'look\n  sim-call: Read {"file_path": "/a b.txt", "limit": 2}  \nthanks'
    asked = await Client(app).request(
        "POST",
        "/v1/messages",
        json_body={**ask, "messages": [{"role": "user", "content": line}]},
        headers=AUTH,
    )
    (call,) = asked.json()["content"]
    assert (call["name"], call["input"]) == ("Read", {"file_path": "/a b.txt", "limit": 2})
    # The same on chat completions (Codex and other OpenAI clients).
    chat = await Client(app).chat(
        {
            "model": "m",
            "messages": [{"role": "user", "content": line}],
            "tools": [
                {
                    "type": "function",
                    "function": {"name": t["name"], "parameters": t["input_schema"]},
                }
                for t in TOOLS
            ],
        }
    )
    fn = chat.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert (fn["name"], json.loads(fn["arguments"])) == (
        "Read",
        {"file_path": "/a b.txt", "limit": 2},
    )
    # Arguments that are not a JSON object: a 400 that says so, in Anthropic's shape.
    bad = await Client(app).request(
        "POST",
        "/v1/messages",
        json_body={**ask, "messages": [{"role": "user", "content": "sim-call: Read [1]"}]},
        headers=AUTH,
    )
    assert bad.status == 400
    assert bad.json()["error"]["type"] == "invalid_request_error"
    assert "sim-call: Read" in bad.json()["error"]["message"]


async def test_count_tokens_counts_what_a_message_request_counts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = sim()
    body: Any = {
        "model": "claude-sonnet-4-5",
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": "how many tokens is this?"}],
        "tools": TOOLS,
    }
    counted = await Client(app).request(
        "POST", "/v1/messages/count_tokens?beta=true", json_body=body, headers=AUTH
    )
    assert counted.status == 200, counted.body
    n = counted.json()["input_tokens"]
    whole = await Client(app).request(
        "POST", "/v1/messages", json_body={**body, "max_tokens": 8}, headers=AUTH
    )
    assert n == whole.json()["usage"]["input_tokens"] > 0
    assert app.stats.requests == 1  # counting is not a model request
    # The message request itself still needs max_tokens.
    missing = await Client(app).request("POST", "/v1/messages", json_body=body, headers=AUTH)
    assert missing.status == 400
    assert "max_tokens" in missing.json()["error"]["message"]
    refused = await Client(app).request("POST", "/v1/messages/count_tokens", json_body=body)
    assert refused.status == 401
    assert refused.json()["error"]["type"] == "authentication_error"
    broken = await Client(app).request("POST", "/v1/messages/count_tokens", body=b"{", headers=AUTH)
    assert broken.status == 400
    assert broken.json()["type"] == "error"


@pytest.mark.parametrize("stream", [True, False])
async def test_a_thinking_block_carries_its_signature_streamed_and_whole(
    stream: bool, autojump_clock: trio.testing.MockClock
) -> None:
    body: Any = {
        "model": "m",
        "max_tokens": 64,
        "stream": stream,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [{"role": "user", "content": "hi"}],
    }
    r = await Client(sim()).request("POST", "/v1/messages", json_body=body, headers=AUTH)
    thought, text = blocks(events(r)) if stream else r.json()["content"]
    assert thought["type"] == "thinking"
    assert thought["signature"] == "sim-signature"
    assert text["type"] == "text"
