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

from .claude_code import FIXTURE, MODEL, SECRET, claude_binary, message_requests, read_task
from .claude_code import run_claude as run
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
