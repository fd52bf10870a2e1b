"""/mcp sessions across hypercorn workers: an id one worker issued is good on the other
(issue 52 left sessions in one worker: with ``workers = 2`` about half of a client's
requests answered 404). The gateway under hypercorn with two workers and
``AISERVE_TOKEN_SECRET`` set, the SDK-written test server over stdio (a child per
worker), and a client that opens a new connection for each request."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from aiserve_trio.security.auth import hash_key

from .conftest import config_text
from .servers import ROOT, hypercorn_gateway
from .test_mcp import PYTHON, _init

KEY = "aik_agent_" + "w" * 32

pytestmark = pytest.mark.slow


def _post(base: str, msg: dict[str, Any], sid: str | None = None) -> httpx.Response:
    headers = {
        "authorization": f"Bearer {KEY}",
        "accept": "application/json, text/event-stream",
        "content-type": "application/json",
    }
    if sid is not None:
        headers["mcp-session-id"] = sid
    # A client of its own each time: a new connection, which either worker may accept.
    with httpx.Client(timeout=30) as client:
        return client.post(
            base + "/mcp", content=json.dumps({"jsonrpc": "2.0", **msg}), headers=headers
        )


def test_a_session_opened_on_one_worker_is_served_by_the_other(tmp_path: Path) -> None:
    auth = f"""[auth]
enabled = true
[[auth.keys]]
id = "agent"
hash = "{hash_key(KEY)}"
tenant = "bank-a"
mcp_tools = ["faulty/*"]
"""
    text = config_text().replace("[auth]\nenabled = false\n", auth)
    text += f'\n[mcp.servers.faulty]\ncommand = ["{PYTHON}", "-m", "tests.mcp_servers.faulty"]\n'
    cfg = tmp_path / "gw.toml"
    cfg.write_text(text)
    env = {"AISERVE_TOKEN_SECRET": "a-secret-every-worker-shares", "PYTHONPATH": str(ROOT)}
    with hypercorn_gateway(cfg, extra_args=["--workers", "2"], env=env) as (base, _proc):
        r = _post(base, {"id": 1, "method": "initialize", "params": _init("2025-06-18")})
        assert r.status_code == 200, r.text
        sid = r.headers["mcp-session-id"]
        pids: set[str] = set()
        end = time.monotonic() + 60
        n = 0
        while len(pids) < 2 and n < 60 and time.monotonic() < end:
            n += 1
            call = {"id": n + 1, "method": "tools/call", "params": {"name": "faulty__pid"}}
            r = _post(base, call, sid)
            assert r.status_code == 200, (n, r.status_code, r.text)
            answer = r.json()
            assert "result" in answer, answer
            pids.add(answer["result"]["content"][0]["text"])
        # Two stdio children answered: both workers served the one session.
        assert len(pids) == 2, f"{n} calls reached one worker only"
        # An id no worker signed is no session, on either.
        assert (
            _post(base, {"method": "notifications/initialized"}, "forged." + sid[-8:]).status_code
            == 404
        )
