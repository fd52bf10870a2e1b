"""A reload adds and removes upstream MCP servers without a restart (issue 52): the config
file is rewritten under a running gateway (its watcher reloads it); the new server is
started and its tools listed, a removed one is stopped and its tools are gone, and the
one left alone keeps its child process (the same pid) and its clients' sessions."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from aiserve_trio.security.auth import hash_key

from .conftest import config_text
from .servers import ROOT, hypercorn_gateway

KEY = "aik_agent_" + "r" * 32
FAULTY = f'command = ["{sys.executable}", "-m", "tests.mcp_servers.faulty"]\n'

pytestmark = pytest.mark.slow


def _config(servers: list[str]) -> str:
    auth = f"""[auth]
enabled = true
[[auth.keys]]
id = "agent"
hash = "{hash_key(KEY)}"
tenant = "bank-a"
mcp_tools = ["*"]
"""
    text = config_text(reload_watch_s="0.2").replace("[auth]\nenabled = false\n", auth)
    for name in servers:
        text += f"\n[mcp.servers.{name}]\n{FAULTY}"
    return text


def _rpc(base: str, sid: str | None, method: str, params: dict[str, Any]) -> httpx.Response:
    headers = {"authorization": f"Bearer {KEY}", "accept": "application/json, text/event-stream"}
    if sid is not None:
        headers["mcp-session-id"] = sid
    msg = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
    return httpx.post(base + "/mcp", content=json.dumps(msg), headers=headers, timeout=30)


def _wait(base: str, want: dict[str, str]) -> dict[str, Any]:
    end = time.monotonic() + 30
    while True:
        mcp = httpx.get(base + "/healthz").json().get("mcp", {})
        if {n: s["state"] for n, s in mcp.items()} == want:
            return dict(mcp)
        assert time.monotonic() < end, f"MCP servers {mcp}, not {want}"
        time.sleep(0.1)


def test_reload_adds_and_removes_servers(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.toml"
    cfg.write_text(_config(["one", "two"]))
    with hypercorn_gateway(cfg, env={"PYTHONPATH": str(ROOT)}) as (base, _proc):
        _wait(base, {"one": "ready", "two": "ready"})
        init = {"protocolVersion": "2025-11-25", "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"}}  # fmt: skip
        r = _rpc(base, None, "initialize", init)
        sid = r.headers["mcp-session-id"]
        pid = _rpc(base, sid, "tools/call", {"name": "one__pid", "arguments": {}}).json()

        cfg.write_text(_config(["one", "three"]))
        _wait(base, {"one": "ready", "three": "ready"})
        r = _rpc(base, sid, "tools/list", {})  # the session outlived the reload
        assert r.status_code == 200
        names = {t["name"].split("__")[0] for t in r.json()["result"]["tools"]}
        assert names == {"one", "three"}
        again = _rpc(base, sid, "tools/call", {"name": "one__pid", "arguments": {}}).json()
        assert again["result"]["content"] == pid["result"]["content"]  # not restarted
        gone = _rpc(base, sid, "tools/call", {"name": "two__pid", "arguments": {}}).json()
        assert gone["error"]["code"] == -32602
        assert "two" in gone["error"]["message"]
        ok = _rpc(base, sid, "tools/call", {"name": "three__echo", "arguments": {"text": "x"}})
        assert json.loads(ok.json()["result"]["content"][0]["text"])["text"] == "x"
