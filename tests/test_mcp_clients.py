"""Real MCP clients through the gateway's /mcp (issue 52): Claude Code (``claude mcp add
--transport http`` with the key in a header, then a ``-p`` task that needs a gateway
tool, its model the aiserve-sim the test runs) and the MCP Inspector's CLI mode
(``tools/list``). The upstream is ``@modelcontextprotocol/server-everything`` over stdio
(tests/mcp-node); the key is granted ``everything/echo`` and ``everything/get-sum`` only."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aiserve_trio.security.auth import hash_key

from .claude_code import claude_binary, claude_env, message_requests
from .conftest import config_text
from .servers import ROOT, hypercorn_gateway
from .sim_process import run_sim

NODE = ROOT / "tests" / "mcp-node" / "node_modules"
EVERYTHING = NODE / "@modelcontextprotocol/server-everything/dist/index.js"
INSPECTOR = NODE / ".bin" / "mcp-inspector"
KEY = "aik_agent_" + "e" * 32
WORD = "flamingo-7"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not EVERYTHING.exists(), reason="npm ci --prefix tests/mcp-node not run"),
]


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
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
    cfg = tmp / "gw.toml"
    cfg.write_text(text)
    with hypercorn_gateway(cfg) as (base, _proc):
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
