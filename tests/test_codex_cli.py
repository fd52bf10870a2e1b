"""The real Codex CLI (``codex exec``) through the gateway's Responses route, in front of
aiserve-sim speaking Chat Completions (real processes: hypercorn and aiserve-sim).

Codex sends what a Chat Completions backend cannot honour (``include``,
``reasoning.summary``, ``client_metadata``, a namespace's ``description``, a ``web_search``
tool): the gateway drops and names them (a namespace's functions go on under flat names,
tests/test_responses_namespace.py), and the task needs a tool -- the sim obeys the prompt's
``sim-call:`` line with a call of Codex's ``exec_command``, Codex runs ``cat NOTE.txt``,
and the sim's second answer quotes the tool's output, which Codex prints as its answer.
The second case runs the same task with Codex pointed straight at the sim's own Responses
API (``sim/responses.py``), no gateway between.
The configuration is the one docs/coding-agents.md gives (a temporary ``CODEX_HOME``, so
nothing reads or writes ``~/.codex``; update checks, analytics and feedback off).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import config_text
from .servers import hypercorn_gateway
from .sim_process import run_sim

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("codex") is None,
        reason="the Codex CLI is not installed (npm install -g @openai/codex; .ci/run does)",
    ),
]

ROUTE = "/codex/v1/responses"
CLAUDE_ROUTE = "/claude/v1/responses"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(gateway base URL, sim address): a Responses route whose backend is the sim's Chat API."""
    with run_sim() as sim:
        extra = f"""
[adapters.up]
kind = "openai"
base_url = "http://{sim}/v1"
models = ["sim-model"]

[[routes]]
path = "{ROUTE}"
name = "codex"
kind = "responses"
adapter = "up"
default_model = "sim-model"

# The same client API in front of Anthropic's (the sim's Anthropic dialect)
[adapters.claude]
kind = "anthropic"
base_url = "http://{sim}"
models = ["claude-sonnet-4-5"]
api_key_env = "ANTHROPIC_API_KEY"

[[routes]]
path = "{CLAUDE_ROUTE}"
name = "codex_claude"
kind = "responses"
adapter = "claude"
"""
        cfg: Path = tmp_path_factory.mktemp("conf") / "gateway.toml"
        cfg.write_text(config_text() + extra)
        with hypercorn_gateway(cfg, env={"ANTHROPIC_API_KEY": "sim-key"}) as (base, _):
            yield base, sim


def codex_config(base_url: str, model: str) -> str:
    """``$CODEX_HOME/config.toml``: the gateway as the model provider (docs/coding-agents.md)."""
    return f"""
model = "{model}"
model_provider = "aiserve"
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false

[analytics]
enabled = false

[feedback]
enabled = false

[model_providers.aiserve]
name = "aiserve gateway"
base_url = "{base_url}"
env_key = "AISERVE_API_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
"""


def run_codex(
    tmp: Path, base_url: str, prompt: str, model: str = "sim-model"
) -> tuple[subprocess.CompletedProcess[str], str]:
    """``codex exec`` in a fresh workspace and ``CODEX_HOME``; (the run, its last message)."""
    home = tmp / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(codex_config(base_url, model))
    last = tmp / "last-message.txt"
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp),  # the login shell Codex runs commands in reads nothing of ours
        "CODEX_HOME": str(home),
        "AISERVE_API_KEY": "unused-locally",
        "NO_COLOR": "1",
    }
    cmd = [
        "codex",
        "exec",
        "--strict-config",
        "--skip-git-repo-check",
        "--ephemeral",
        "--color",
        "never",
        "--output-last-message",
        str(last),
        prompt,
    ]
    run = subprocess.run(
        cmd,
        cwd=tmp / "work",
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    return run, last.read_text() if last.exists() else ""


def sim_requests(sim: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"http://{sim}/sim/requests", timeout=5) as r:
        return list(json.loads(r.read())["requests"])


def note_task(tmp: Path) -> tuple[str, str]:
    """A workspace with NOTE.txt holding a fresh code word; (the word, the prompt)."""
    word = f"PELICAN-{secrets.token_hex(4)}"
    (tmp / "work").mkdir()
    (tmp / "work" / "NOTE.txt").write_text(f"The code word is {word}.\n")
    prompt = (
        "Run `cat NOTE.txt` and tell me the code word.\n"
        'sim-call: exec_command {"cmd": "cat NOTE.txt"}'
    )
    return word, prompt


def test_codex_runs_a_command_through_the_gateway_and_answers_with_its_output(
    stack: tuple[str, str], tmp_path: Path
) -> None:
    base, sim = stack
    word, prompt = note_task(tmp_path)
    run, answer = run_codex(tmp_path, base + ROUTE.removesuffix("/responses"), prompt)
    assert run.returncode == 0, run.stderr[-4000:]
    # The final answer quotes what the command printed: the file's code word.
    assert word in answer, (answer, run.stderr[-4000:])
    # Two model turns reached the sim: the call, then the answer after the tool's output.
    asked = [r for r in sim_requests(sim) if r["path"] == "/v1/chat/completions"][-2:]
    first, second = (json.loads(r["body"]) for r in asked)
    assert first["tools"][0]["function"]["name"] == "exec_command"
    assert "include" not in first
    assert "client_metadata" not in first
    tool = second["messages"][-1]
    assert tool["role"] == "tool"
    assert word in tool["content"]


def test_codex_runs_the_same_task_against_the_sims_responses_api(
    stack: tuple[str, str], tmp_path: Path
) -> None:
    """Codex straight at aiserve-sim's own ``POST /v1/responses`` (sim/responses.py)."""
    _, sim = stack
    word, prompt = note_task(tmp_path)
    run, answer = run_codex(tmp_path, f"http://{sim}/v1", prompt)
    assert run.returncode == 0, run.stderr[-4000:]
    assert word in answer, (answer, run.stderr[-4000:])
    asked = [r for r in sim_requests(sim) if r["path"] == "/v1/responses"][-2:]
    first, second = (json.loads(r["body"]) for r in asked)
    assert first["include"] == ["reasoning.encrypted_content"]
    assert any(t.get("name") == "exec_command" for t in first["tools"])
    output = second["input"][-1]
    assert output["type"] == "function_call_output"
    assert word in output["output"]


def test_codex_runs_the_task_through_the_gateway_on_a_claude_backend(
    stack: tuple[str, str], tmp_path: Path
) -> None:
    """The Responses route in front of the ``anthropic`` adapter: Codex's request is
    translated to Chat Completions and on to Anthropic's Messages; ``prompt_cache_key``,
    which that adapter cannot carry, is dropped (``X-Aiserve-Dropped``), not refused."""
    base, sim = stack
    word, prompt = note_task(tmp_path)
    url = base + CLAUDE_ROUTE.removesuffix("/responses")
    run, answer = run_codex(tmp_path, url, prompt, model="claude-sonnet-4-5")
    assert run.returncode == 0, run.stderr[-4000:]
    assert word in answer, (answer, run.stderr[-4000:])
    asked = [r for r in sim_requests(sim) if r["path"] == "/v1/messages"][-2:]
    first, second = (json.loads(r["body"]) for r in asked)
    assert first["tools"][0]["name"] == "exec_command"
    results = [
        block
        for block in second["messages"][-1]["content"]
        if isinstance(block, dict) and block.get("type") == "tool_result"
    ]
    assert len(results) == 1
    assert word in json.dumps(results[0])
