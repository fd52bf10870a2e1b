"""Real MCP clients through the gateway's /mcp (issue 52): Claude Code (``claude mcp add
--transport http`` with the key in a header, then a ``-p`` task that needs a gateway
tool, its model the aiserve-sim the test runs), Codex CLI (``[mcp_servers.gw]`` with
``url`` and ``bearer_token_env_var`` in its config.toml, then a ``codex exec`` task that
needs a gateway tool, its model the sim's Responses API straight or through the gateway's
Responses route -- passed on as it is, or translated to the sim's Chat Completions API, the
MCP tools under flat names) and the MCP Inspector's CLI mode
(``tools/list``). The upstream is ``@modelcontextprotocol/server-everything`` over stdio
(tests/mcp-node); the key is granted ``everything/echo`` and ``everything/get-sum`` only."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aiserve_trio.security.auth import hash_key

from .claude_code import claude_binary, claude_env, message_requests
from .conftest import config_text
from .servers import ROOT, hypercorn_gateway
from .sim_process import run_sim
from .test_codex_cli import codex_config

NODE = ROOT / "tests" / "mcp-node" / "node_modules"
EVERYTHING = NODE / "@modelcontextprotocol/server-everything/dist/index.js"
INSPECTOR = NODE / ".bin" / "mcp-inspector"
KEY = "aik_agent_" + "e" * 32
WORD = "flamingo-7"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not EVERYTHING.exists(), reason="npm ci --prefix tests/mcp-node not run"),
]


#: The gateway's Responses route passing Codex's requests through to the sim (``wire =
#: "responses"``, docs/coding-agents.md): every tool Codex offers reaches the model.
RESPONSES_ROUTE = "/codex/v1/responses"
#: The gateway's Responses route in front of the sim's Chat Completions API: Codex's
#: namespace ``mcp__gw`` reaches the model as ``mcp__gw__<function>`` tools.
CHAT_ROUTE = "/codex-chat/v1/responses"


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with run_sim() as addr:
        yield addr


@pytest.fixture(scope="module")
def gw(sim: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("mcp-clients")
    auth = f"""[auth]
enabled = true
[[auth.keys]]
id = "agent"
hash = "{hash_key(KEY)}"
tenant = "bank-a"
mcp_tools = ["everything/echo", "everything/get-sum"]
"""
    text = config_text().replace("[auth]\nenabled = false\n", auth)
    text += f'\n[mcp.servers.everything]\ncommand = ["node", "{EVERYTHING}", "stdio"]\n'
    text += f"""
[adapters.sim_responses]
kind = "openai"
wire = "responses"
base_url = "http://{sim}/v1"
models = ["sim-model"]
api_key_env = "MCP_CLIENTS_SIM_KEY"

[[routes]]
path = "{RESPONSES_ROUTE}"
name = "codex"
kind = "responses"
adapter = "sim_responses"
default_model = "sim-model"

[adapters.sim_chat]
kind = "openai"
base_url = "http://{sim}/v1"
models = ["sim-model"]
api_key_env = "MCP_CLIENTS_SIM_KEY"

[[routes]]
path = "{CHAT_ROUTE}"
name = "codex_chat"
kind = "responses"
adapter = "sim_chat"
default_model = "sim-model"
"""
    cfg = tmp / "gw.toml"
    cfg.write_text(text)
    with hypercorn_gateway(cfg, env={"MCP_CLIENTS_SIM_KEY": "sim-key"}) as (base, _proc):
        end = time.monotonic() + 30
        while httpx.get(base + "/healthz").json()["mcp"]["everything"]["state"] != "ready":
            assert time.monotonic() < end, "server-everything did not start"
            time.sleep(0.1)
        yield base


@pytest.mark.skipif(claude_binary() is None, reason="the claude CLI is not installed")
def test_claude_code_completes_a_task_with_a_gateway_tool(gw: str, tmp_path: Path) -> None:
    claude = claude_binary()
    assert claude is not None
    (tmp_path / "home").mkdir()
    work = tmp_path / "work"
    work.mkdir()
    with run_sim() as addr:
        env = claude_env(f"http://{addr}", tmp_path / "home")
        added = subprocess.run(
            [claude, "mcp", "add", "--transport", "http", "gw", gw + "/mcp",
             "--header", f"Authorization: Bearer {KEY}"],
            cwd=work, env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert added.returncode == 0, added.stderr + added.stdout
        # The sim's model calls the tool the line names; its next turn quotes the result.
        call = json.dumps({"message": WORD})
        prompt = (
            f"Echo {WORD} with the gateway's echo tool.\nsim-call: mcp__gw__everything__echo {call}"
        )
        done = subprocess.run(
            [claude, "-p", prompt, "--allowedTools", "mcp__gw__everything__echo"],
            cwd=work, env=env, capture_output=True, text=True, timeout=180, check=False,
        )  # fmt: skip
        turns = [json.loads(t["body"]) for t in message_requests(addr)]
    assert done.returncode == 0, done.stderr + done.stdout
    assert f"Echo: {WORD}" in done.stdout
    # Claude Code listed the gateway's tools -- the granted ones only -- as the model's tools.
    names = {t["name"] for t in turns[0]["tools"] if t["name"].startswith("mcp__gw__")}
    assert names == {"mcp__gw__everything__echo", "mcp__gw__everything__get-sum"}
    # The tool's result (from the upstream, through /mcp) went back to the model.
    (result,) = [b for b in turns[-1]["messages"][-1]["content"] if b["type"] == "tool_result"]
    assert result["content"][0]["text"] == f"Echo: {WORD}"


def codex_mcp_config(model_base_url: str, gw: str) -> str:
    """Codex's config.toml (docs/guides/mcp.md): its model at ``model_base_url``, and the
    gateway's /mcp as the Streamable HTTP MCP server ``gw``, the key read from the same
    variable as the model provider's (``AISERVE_API_KEY``)."""
    mcp = f"""
[mcp_servers.gw]
url = "{gw}/mcp"
bearer_token_env_var = "AISERVE_API_KEY"
"""
    return codex_config(model_base_url, "sim-model") + mcp


def sim_responses(sim: str, path: str = "/v1/responses") -> list[dict[str, Any]]:
    """The requests at ``path`` the sim has had, oldest first (``headers``, ``body``)."""
    with urllib.request.urlopen(f"http://{sim}/sim/requests", timeout=5) as r:
        asked = json.loads(r.read())["requests"]
    return [x for x in asked if x["path"] == path]


def run_codex_echo(model: str, gw: str, tmp_path: Path) -> tuple[str, str]:
    """``codex exec`` with its model at ``model`` and the gateway's /mcp as ``gw``, on a task
    whose ``sim-call:`` makes the model call echo; (its stderr, its last message)."""
    home = tmp_path / "codex-home"
    home.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),  # nothing of the machine's ~/.codex
        "CODEX_HOME": str(home),
        "AISERVE_API_KEY": KEY,  # the gateway's key (the sim takes any)
        "NO_COLOR": "1",
    }
    (home / "config.toml").write_text(codex_mcp_config(model, gw))
    last = tmp_path / "last-message.txt"
    # Codex offers a server's tools as a Responses ``namespace`` tool (``mcp__gw``); the
    # sim knows a namespaced function as ``<namespace>__<function>`` (on its Responses API
    # it calls it with the call's ``namespace`` set, as OpenAI's API does; on its Chat API
    # it calls the tool of that name, which the gateway offered it under the flat name).
    call = json.dumps({"message": WORD})
    prompt = (
        f"Echo {WORD} with the gateway's echo tool.\nsim-call: mcp__gw__everything__echo {call}"
    )
    done = subprocess.run(
        ["codex", "exec", "--strict-config", "--skip-git-repo-check", "--ephemeral",
         "--color", "never", "--output-last-message", str(last), prompt],
        cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr, last.read_text() if last.exists() else ""


@pytest.mark.skipif(shutil.which("codex") is None, reason="the Codex CLI is not installed")
@pytest.mark.parametrize("model_via", ["sim", "gateway"])
def test_codex_cli_completes_a_task_with_a_gateway_tool(
    gw: str, sim: str, model_via: str, tmp_path: Path
) -> None:
    """Codex's model straight at the sim's Responses API, or at the gateway's Responses
    route passing its requests on (``wire = "responses"``; one key for both), and the
    gateway's /mcp as its MCP server."""
    model = (
        f"http://{sim}/v1"
        if model_via == "sim"
        else gw + RESPONSES_ROUTE.removesuffix("/responses")
    )
    before = len(sim_responses(sim))
    stderr, answer = run_codex_echo(model, gw, tmp_path)
    asked = sim_responses(sim)[before:]
    assert len(asked) == 2, stderr[-4000:]  # the call, then the answer
    # Through the gateway, the model's requests carry the adapter's key, not the client's.
    via = {f"Bearer {KEY}": "sim", "Bearer sim-key": "gateway"}
    assert {via[x["headers"]["authorization"]] for x in asked} == {model_via}
    turns = [json.loads(x["body"]) for x in asked]
    # Codex listed the gateway's tools -- the granted ones only -- to the model, as the
    # namespace ``mcp__gw`` (its names: ``get-sum`` becomes ``get_sum``).
    (listed,) = [t for t in turns[0]["tools"] if t.get("name") == "mcp__gw"]
    assert listed["type"] == "namespace"
    assert {f["name"] for f in listed["tools"]} == {"everything__echo", "everything__get_sum"}
    # The model called echo; Codex sent the call to /mcp and the upstream's answer back.
    called, output = turns[1]["input"][-2:]
    assert (called["namespace"], called["name"]) == ("mcp__gw", "everything__echo")
    assert output["type"] == "function_call_output"
    assert output["call_id"] == called["call_id"]
    assert f"Echo: {WORD}" in json.dumps(output["output"])
    # And the final answer quotes it.
    assert f"Echo: {WORD}" in answer, stderr[-4000:]


@pytest.mark.skipif(shutil.which("codex") is None, reason="the Codex CLI is not installed")
def test_codex_cli_uses_a_gateway_tool_through_a_responses_route_on_a_chat_backend(
    gw: str, sim: str, tmp_path: Path
) -> None:
    """Codex's model at the gateway's Responses route whose backend is the sim's Chat
    Completions API: the namespace ``mcp__gw`` is translated, not dropped -- its functions
    reach the model as ``mcp__gw__<function>``, the model's call of one goes back to Codex
    as the function with its ``namespace``, Codex sends it to /mcp, and the answer quotes
    the upstream's echo."""
    model = gw + CHAT_ROUTE.removesuffix("/responses")
    before = len(sim_responses(sim, "/v1/chat/completions"))
    stderr, answer = run_codex_echo(model, gw, tmp_path)
    asked = sim_responses(sim, "/v1/chat/completions")[before:]
    assert len(asked) == 2, stderr[-4000:]  # the call, then the answer
    assert {x["headers"]["authorization"] for x in asked} == {"Bearer sim-key"}
    first, second = (json.loads(x["body"]) for x in asked)
    # The gateway's tools -- the granted ones only -- under their flat names.
    names = {t["function"]["name"] for t in first["tools"]}
    assert {n for n in names if n.startswith("mcp__gw__")} == {
        "mcp__gw__everything__echo",
        "mcp__gw__everything__get_sum",
    }
    # The model called echo by its flat name; Codex knew it as mcp__gw's everything__echo
    # (else it would not have sent it to /mcp): the upstream's answer is the tool result,
    # and the call is in the history under the flat name again.
    (call,) = second["messages"][-2]["tool_calls"]
    assert call["function"]["name"] == "mcp__gw__everything__echo"
    assert json.loads(call["function"]["arguments"]) == {"message": WORD}
    result = second["messages"][-1]
    assert result["role"] == "tool"
    assert result["tool_call_id"] == call["id"]
    assert f"Echo: {WORD}" in result["content"]
    # And the final answer quotes it.
    assert f"Echo: {WORD}" in answer, stderr[-4000:]


@pytest.mark.skipif(not INSPECTOR.exists(), reason="npm ci --prefix tests/mcp-node not run")
def test_inspector_cli_lists_the_granted_tools(gw: str) -> None:
    done = subprocess.run(
        [str(INSPECTOR), "--cli", gw + "/mcp", "--transport", "http",
         "--method", "tools/list", "--header", f"Authorization: Bearer {KEY}"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    tools = json.loads(done.stdout)["tools"]
    assert [t["name"] for t in tools] == ["everything__echo", "everything__get-sum"]
    assert tools[0]["annotations"]["readOnlyHint"] is True  # the upstream's, unchanged


@pytest.mark.skipif(not INSPECTOR.exists(), reason="npm ci --prefix tests/mcp-node not run")
def test_inspector_cli_without_a_key_is_refused(gw: str) -> None:
    done = subprocess.run(
        [str(INSPECTOR), "--cli", gw + "/mcp", "--transport", "http", "--method", "tools/list"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    # The 401's WWW-Authenticate tells it credentials are needed; it does not list anything.
    assert done.returncode != 0
    assert "auth_required" in done.stderr + done.stdout
    assert "everything__echo" not in done.stdout
