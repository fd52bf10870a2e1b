"""The real Claude Code CLI (``claude -p``) completes a task that needs a tool: it reads a
note through its ``Read`` tool and answers with what the note says. Against aiserve-sim
directly -- the sim's ``sim-call:`` line makes the model call ``Read`` on the note, and
the next turn quotes the tool's result. The environment is docs/coding-agents.md's; a
fresh HOME, no traffic but the model's. .ci/run installs the CLI (the version
tests/data/claude_code_first_turn.json was recorded with); where it is missing these
tests are skipped with that reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aiserve_trio.security.auth import hash_key

from .claude_code import (
    FIXTURE,
    MODEL,
    SECRET,
    SMALL_MODEL,
    claude_binary,
    message_requests,
    read_task,
    scrub,
)
from .claude_code import run_claude as run
from .conftest import config_text
from .servers import hypercorn_gateway
from .sim_process import run_sim

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        claude_binary() is None,
        reason="the claude CLI is not installed (npm install -g @anthropic-ai/claude-code)",
    ),
]


def test_claude_code_reads_a_file_through_the_sim(tmp_path: Path) -> None:
    note, prompt = read_task(tmp_path / "work")
    with run_sim() as addr:
        done = run(f"http://{addr}", tmp_path, prompt)
        turns = message_requests(addr)
    assert done.returncode == 0, done.stderr + done.stdout
    assert SECRET in done.stdout  # the answer quotes the file it read
    first, second = (json.loads(t["body"]) for t in turns)
    assert turns[0]["path"] == "/v1/messages?beta=true"
    assert first["model"] == MODEL
    assert "Read" in [t["name"] for t in first["tools"]]
    (call,) = [b for b in second["messages"][-2]["content"] if b["type"] == "tool_use"]
    assert (call["name"], call["input"]) == ("Read", {"file_path": str(note)})
    (result,) = second["messages"][-1]["content"]
    assert result["type"] == "tool_result"
    assert result["tool_use_id"] == call["id"]
    assert SECRET in json.dumps(result["content"])
    # The thought the sim sent comes back signed, as Claude Code keeps it.
    (thought,) = [b for b in second["messages"][-2]["content"] if b["type"] == "thinking"]
    assert thought["signature"] == "sim-signature"


def test_the_recorded_first_turn_is_what_this_claude_code_sends(tmp_path: Path) -> None:
    """The fixture the gateway's native pass-through is tested with is still what the
    installed CLI sends: the same path, betas, fields and feature settings (else: python
    -m tests.claude_code record, and pin the new version in .ci/run)."""
    recorded = json.loads(FIXTURE.read_text())
    _, prompt = read_task(tmp_path / "work")
    with run_sim() as addr:
        done = run(f"http://{addr}", tmp_path, prompt)
        first = message_requests(addr)[0]
    assert done.returncode == 0, done.stderr + done.stdout
    assert first["path"] == recorded["path"]
    for header in ("anthropic-beta", "anthropic-version", "x-app"):
        assert first["headers"][header] == recorded["headers"][header], header
    sent, kept = json.loads(first["body"]), json.loads(recorded["body"])
    assert list(sent) == list(kept)  # the same fields, in the same order
    for field in ("thinking", "context_management", "max_tokens", "stream"):
        assert sent[field] == kept[field], field
    assert [t["name"] for t in sent["tools"]] == [t["name"] for t in kept["tools"]]


def gateway_config(sim: str, key: str) -> str:
    """The gateway's config for Claude Code (docs/coding-agents.md): a Messages route on
    an ``anthropic`` adapter pointed at the sim, auth on with one key."""
    auth = f"""[auth]
enabled = true
token_secret_env = "AISERVE_TEST_TOKEN_SECRET_UNSET"

[[auth.keys]]
id = "claude-code"
hash = "{hash_key(key)}"
tenant = "dev"
routes = ["/claude/v1/messages"]
"""
    text = config_text().replace("[auth]\\nenabled = false\\n", auth)
    return (
        text
        + f"""
[adapters.claude]
kind = "anthropic"
base_url = "http://{sim}"
models = ["{MODEL}", "{SMALL_MODEL}"]
api_key_env = "AISERVE_TEST_ANTHROPIC_KEY"

[[routes]]
path = "/claude/v1/messages"
name = "claude"
kind = "messages"
adapter = "claude"
"""
    )


def test_claude_code_through_the_gateway_passes_natively(tmp_path: Path) -> None:
    """Claude Code -> the gateway (a Messages route, anthropic adapter) -> the sim: the task
    completes, and the provider receives Claude Code's first turn byte for byte (the
    recorded fixture, scrubbed the same way), its betas, and the provider's key."""
    key = "aik_claude_" + "k" * 32
    note, prompt = read_task(tmp_path / "work")
    with run_sim() as sim:
        cfg = tmp_path / "gateway.toml"
        cfg.write_text(gateway_config(sim, key))
        env = {"AISERVE_TEST_ANTHROPIC_KEY": "sk-provider"}
        with hypercorn_gateway(cfg, env=env) as (base, _):
            done = run(f"{base}/claude", tmp_path, prompt, key=key)
        turns = message_requests(sim)
    assert done.returncode == 0, done.stderr + done.stdout
    assert SECRET in done.stdout
    recorded = json.loads(FIXTURE.read_text())
    first = scrub(turns[0], tmp_path)
    assert first["body"] == recorded["body"]  # byte for byte: cache_control, thinking, ...
    assert '"cache_control":{"type":"ephemeral"}' in first["body"]
    assert json.loads(first["body"])["thinking"] == {"budget_tokens": 2048, "type": "enabled"}
    for header in ("anthropic-beta", "anthropic-version"):
        assert first["headers"][header] == recorded["headers"][header], header
    assert turns[0]["headers"]["x-api-key"] == "sk-provider"  # the gateway's, not the client's
    second = json.loads(turns[1]["body"])
    (call,) = [b for b in second["messages"][-2]["content"] if b["type"] == "tool_use"]
    assert call["input"] == {"file_path": str(note)}
    (thought,) = [b for b in second["messages"][-2]["content"] if b["type"] == "thinking"]
    assert thought["signature"] == "sim-signature"  # the sim's, back through the gateway
