"""The MCP gateway (issue 52) with real servers and clients: the gateway under hypercorn;
``@modelcontextprotocol/server-everything`` (npm, tests/mcp-node) over stdio and over
Streamable HTTP; a small server written with the ``mcp`` SDK (tests/mcp_servers/faulty.py)
for hangs, crashes and garbage; the ``mcp`` SDK's client, and raw JSON-RPC for the errors."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from aiserve_trio.security.auth import hash_key

from .conftest import config_text
from .servers import ROOT, free_port, hypercorn_gateway, wait_http

NODE_DIR = ROOT / "tests" / "mcp-node"
EVERYTHING = NODE_DIR / "node_modules/@modelcontextprotocol/server-everything/dist/index.js"
PYTHON = Path(os.sys.executable)  # type: ignore[attr-defined]

KEY = "aik_agent_" + "a" * 32  # everything/echo, everything/get-sum, everyhttp/*, faulty/*
KEY_NONE = "aik_nogrant_" + "b" * 32  # no mcp_tools: deny by default
KEY_NARROW = "aik_narrow_" + "c" * 32  # everything/* under bank-b's ceiling (echo only)
KEY_SLOW = "aik_limited_" + "d" * 32  # faulty/echo, 2 calls a minute
KEY_B = "aik_bkey_" + "h" * 32  # bank-b: faultyhttp/whoami
KEY_OPS = "aik_ops_" + "f" * 32  # an admin of every tenant
KEY_OPS_B = "aik_opsb_" + "g" * 32  # an admin of bank-b only
OFF = "[auth]\nenabled = false\n"
CARD = "4111 1111 1111 1111"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not EVERYTHING.exists(), reason="npm ci --prefix tests/mcp-node not run"),
]


def _toml(tmp: Path, http_port: int, faulty_port: int) -> str:
    keys = (KEY, KEY_NONE, KEY_NARROW, KEY_SLOW, KEY_OPS, KEY_OPS_B, KEY_B)
    h = {k: hash_key(k) for k in keys}
    auth = f"""[auth]
enabled = true
metrics = "open"
[[auth.keys]]
id = "agent"
hash = "{h[KEY]}"
tenant = "bank-a"
mcp_tools = ["everything/echo", "everything/get-sum", "everything/trigger-long-running-operation", "everyhttp/*", "faulty/*", "faultyhttp/*"]
[[auth.keys]]
id = "nogrant"
hash = "{h[KEY_NONE]}"
tenant = "bank-a"
[[auth.keys]]
id = "narrow"
hash = "{h[KEY_NARROW]}"
tenant = "bank-b"
mcp_tools = ["everything/*"]
[[auth.keys]]
id = "limited"
hash = "{h[KEY_SLOW]}"
tenant = "bank-a"
rpm = 2
mcp_tools = ["faulty/echo"]
[[auth.keys]]
id = "ops"
hash = "{h[KEY_OPS]}"
tenant = "bank-a"
global_admin = true
[[auth.keys]]
id = "opsb"
hash = "{h[KEY_OPS_B]}"
tenant = "bank-b"
admin = true

[[auth.keys]]
id = "bkey"
hash = "{h[KEY_B]}"
tenant = "bank-b"
mcp_tools = ["faultyhttp/whoami"]

[tenants.bank-b]
mcp_tools = ["everything/echo", "faultyhttp/whoami"]

[audit]
path = "{tmp / "audit.db"}"
flush_ms = 50
"""
    return (
        config_text().replace(OFF, auth)
        + f"""
[mcp]
policies = ["gdpr-redact"]
max_result_bytes = 2000

[mcp.servers.everything]
command = ["node", "{EVERYTHING}", "stdio"]

[mcp.servers.everyhttp]
url = "http://127.0.0.1:{http_port}/mcp"
headers = {{ authorization = "Bearer ${{MCP_TEST_UPSTREAM_TOKEN}}" }}

[mcp.servers.faulty]
command = ["{PYTHON}", "-m", "tests.mcp_servers.faulty"]
timeout_ms = 5000
restart_ms = 100

[mcp.servers.faultyhttp]
url = "http://127.0.0.1:{faulty_port}/mcp"
headers = {{ authorization = "Bearer ${{MCP_TEST_UPSTREAM_TOKEN}}" }}
timeout_ms = 5000
restart_ms = 100

[mcp.servers.faultyhttp.tenants.bank-b]
headers = {{ authorization = "Bearer ${{MCP_TEST_BANK_B_TOKEN}}" }}
"""
    )


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("mcp")
    port = free_port()
    node = subprocess.Popen(
        ["node", str(EVERYTHING), "streamableHttp"],
        env={**os.environ, "PORT": str(port)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    faulty_port = free_port()
    faulty = subprocess.Popen(
        [str(PYTHON), "-m", "tests.mcp_servers.faulty", "http", str(faulty_port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/mcp", proc=None)
        wait_http(f"http://127.0.0.1:{faulty_port}/mcp", proc=None)
        cfg = tmp / "gw.toml"
        cfg.write_text(_toml(tmp, port, faulty_port))
        env = {
            "MCP_TEST_UPSTREAM_TOKEN": "upstream-secret",
            "MCP_TEST_BANK_B_TOKEN": "bank-b-secret",
            "PYTHONPATH": str(ROOT),
        }
        with hypercorn_gateway(cfg, env=env) as (base, _proc):
            end = time.monotonic() + 30
            while time.monotonic() < end:
                health = httpx.get(base + "/healthz").json()
                if all(s["state"] == "ready" for s in health["mcp"].values()):
                    break
                time.sleep(0.1)
            else:
                raise AssertionError(f"MCP servers not ready: {health}")
            os.environ["MCP_TEST_AUDIT_DB"] = str(tmp / "audit.db")
            yield base
    finally:
        node.terminate()
        node.wait(10)
        faulty.terminate()
        faulty.wait(10)


# --- raw JSON-RPC --------------------------------------------------------------------------


class Rpc:
    """A Streamable HTTP client of /mcp made by hand: one session, plain JSON."""

    def __init__(self, base: str, key: str | None, version: str = "2025-11-25") -> None:
        self.url = base + "/mcp"
        self.headers = {"accept": "application/json, text/event-stream"}
        if key is not None:
            self.headers["authorization"] = f"Bearer {key}"
        self.ids = 0
        r = self.post({"method": "initialize", "params": _init(version)})
        assert r.status_code == 200, r.text
        self.init = r.json()["result"]
        self.headers["mcp-session-id"] = r.headers["mcp-session-id"]
        assert self.post({"method": "notifications/initialized"}).status_code == 202

    def post(self, msg: dict[str, Any] | list[Any] | bytes, **headers: str) -> httpx.Response:
        if isinstance(msg, dict):
            msg = {"jsonrpc": "2.0", **msg}
            if not msg["method"].startswith("notifications/"):
                self.ids += 1
                msg.setdefault("id", self.ids)
        content = msg if isinstance(msg, bytes) else json.dumps(msg).encode()
        return httpx.post(
            self.url, content=content, headers={**self.headers, **headers}, timeout=30
        )

    def call(
        self, name: str, arguments: dict[str, Any] | None = None, timeout_ms: str | None = None
    ) -> Any:
        params = {"name": name, "arguments": arguments or {}}
        extra = {"x-request-timeout-ms": timeout_ms} if timeout_ms is not None else {}
        r = self.post({"method": "tools/call", "params": params}, **extra)
        assert r.status_code == 200, r.text
        return r.json()

    def tools(self) -> list[str]:
        r = self.post({"method": "tools/list"})
        assert r.status_code == 200, r.text
        return [t["name"] for t in r.json()["result"]["tools"]]


def _init(version: str) -> dict[str, Any]:
    return {
        "protocolVersion": version,
        "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"},
    }


def _text(answer: dict[str, Any]) -> str:
    return "".join(c.get("text", "") for c in answer["result"]["content"])


# --- the SDK's client ---------------------------------------------------------------------


async def _sdk(base: str, key: str, mode: str = "legacy") -> tuple[str, list[str], str, Any]:
    """List and call through the gateway with the ``mcp`` SDK's Client: (the protocol it
    settled on, the tools it saw, echo's text, the refused get-env's result)."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as hc:
        transport = streamable_http_client(base + "/mcp", http_client=hc)
        async with Client(transport, mode=mode) as client:
            tools = await client.list_tools()
            echo = await client.call_tool("everything__echo", {"message": "via the gateway"})
            refused: Any
            try:
                refused = await client.call_tool("everything__get-env", {})
            except Exception as exc:  # the SDK raises MCPError for a JSON-RPC error
                refused = exc
            session = client.session
            version = (
                session.discover_result.supported_versions[-1]
                if session.discover_result is not None
                else session.initialize_result.protocol_version  # type: ignore[union-attr]
            )
            text = getattr(echo.content[0], "text", None)
            return version, [t.name for t in tools.tools], str(text), refused


@pytest.mark.parametrize("mode", ["legacy", "auto"])
def test_sdk_client_lists_and_calls_granted_tools_only(gw: str, mode: str) -> None:
    version, tools, echo, refused = trio.run(_sdk, gw, KEY, mode)
    # legacy: the initialize handshake at 2025-11-25; auto: server/discover, then 2026-07-28.
    assert version == ("2025-11-25" if mode == "legacy" else "2026-07-28")
    assert "everything__echo" in tools
    assert "everything__get-sum" in tools
    assert "everything__get-env" not in tools  # not granted: not listed
    assert any(t.startswith("everyhttp__") for t in tools)  # the HTTP upstream, by glob
    assert echo == "Echo: via the gateway"
    # get-env prints the server's environment: refused to a key without its grant, by name.
    assert "everything/get-env" in str(refused)
    assert "agent" in str(refused)


def test_schemas_and_annotations_unchanged(gw: str) -> None:
    direct = _list_direct_stdio()
    rpc = Rpc(gw, KEY)
    r = rpc.post({"method": "tools/list"})
    through = {t["name"]: t for t in r.json()["result"]["tools"]}
    for name in ("echo", "get-sum"):
        mine = dict(through[f"everything__{name}"])
        mine["name"] = name
        assert mine == direct[name]


def _list_direct_stdio() -> dict[str, Any]:
    """server-everything's tools/list straight from a child of its own (no gateway)."""
    lines = [
        {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": _init("2025-11-25")},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}},
    ]
    proc = subprocess.Popen(
        ["node", str(EVERYTHING), "stdio"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.stdin is not None
    assert proc.stdout is not None
    for m in lines:
        proc.stdin.write(json.dumps(m).encode() + b"\n")
        proc.stdin.flush()
    try:
        while True:
            msg = json.loads(proc.stdout.readline())
            if msg.get("id") == 2:
                return {t["name"]: t for t in msg["result"]["tools"]}
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()


# --- grants -------------------------------------------------------------------------------


def test_deny_by_default_a_key_without_grants_sees_and_calls_nothing(gw: str) -> None:
    rpc = Rpc(gw, KEY_NONE)
    assert rpc.tools() == []
    answer = rpc.call("everything__echo", {"message": "x"})
    assert "result" not in answer
    assert answer["error"]["code"] == -32003
    assert "everything/echo" in answer["error"]["message"]
    assert "nogrant" in answer["error"]["message"]


def test_exact_grant_and_glob_grant(gw: str) -> None:
    tools = Rpc(gw, KEY).tools()
    everything = {t for t in tools if t.startswith("everything__")}
    # exact: only the three named
    assert everything == {
        "everything__echo",
        "everything__get-sum",
        "everything__trigger-long-running-operation",
    }
    # glob: every tool of the HTTP upstream, as many as it lists itself
    assert len([t for t in tools if t.startswith("everyhttp__")]) >= 10


def test_a_key_cannot_widen_its_tenants_grant(gw: str) -> None:
    rpc = Rpc(gw, KEY_NARROW)  # everything/*, under bank-b's everything/echo
    assert rpc.tools() == ["everything__echo"]
    answer = rpc.call("everything__get-sum", {"a": 1, "b": 2})
    assert answer["error"]["code"] == -32003
    assert "tenant 'bank-b'" in answer["error"]["message"]
    assert _text(rpc.call("everything__echo", {"message": "ok"})) == "Echo: ok"


def test_no_key_is_401_with_www_authenticate(gw: str) -> None:
    r = httpx.post(
        gw + "/mcp",
        json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": _init("2025-11-25")},
    )
    assert r.status_code == 401
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert r.json()["error"]["code"] == -32001


def test_a_session_is_its_keys(gw: str) -> None:
    mine = Rpc(gw, KEY)
    theirs = Rpc(gw, KEY_NONE)
    r = theirs.post({"method": "tools/list"}, **{"mcp-session-id": mine.headers["mcp-session-id"]})
    assert r.status_code == 404


# --- JSON-RPC errors ----------------------------------------------------------------------


def test_jsonrpc_error_codes(gw: str) -> None:
    rpc = Rpc(gw, KEY)
    r = rpc.post(b"{not json")
    assert (r.status_code, r.json()["error"]["code"]) == (400, -32700)
    r = rpc.post(b"[]")  # an empty batch
    assert (r.status_code, r.json()["error"]["code"]) == (400, -32600)
    r = rpc.post(b'{"id": 1, "method": "tools/list"}')  # no "jsonrpc": "2.0"
    assert r.json()["error"]["code"] == -32600
    r = rpc.post({"method": "tools/frobnicate"})
    assert r.json()["error"]["code"] == -32601
    r = rpc.post({"method": "tools/call", "params": {"arguments": {}}})  # no name
    assert r.json()["error"]["code"] == -32602
    r = rpc.post({"method": "tools/list", "params": {"cursor": "not-a-cursor"}})
    assert r.json()["error"]["code"] == -32602
    r = rpc.post({"method": "tools/call", "params": {"name": "nosuch__tool"}})
    assert r.json()["error"]["code"] == -32602


def test_batches_and_messages_are_bounded(gw: str) -> None:
    rpc = Rpc(gw, KEY)
    batch = [{"jsonrpc": "2.0", "id": i, "method": "ping"} for i in range(3)]
    batch.append({"jsonrpc": "2.0", "id": 99, "method": "nope"})
    r = rpc.post(batch)
    answers = {a["id"]: a for a in r.json()}
    assert [answers[i]["result"] for i in range(3)] == [{}, {}, {}]
    assert answers[99]["error"]["code"] == -32601
    too_many = [{"jsonrpc": "2.0", "id": i, "method": "ping"} for i in range(33)]
    r = rpc.post(too_many)
    assert (r.status_code, r.json()["error"]["code"]) == (400, -32600)
    r = rpc.post(b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "x": "' + b"y" * 1_100_000 + b'"}')
    assert r.status_code == 413
    assert r.json()["error"]["code"] == -32600


@pytest.mark.parametrize("version", ["2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"])
def test_handshake_versions_the_sdks_send(gw: str, version: str) -> None:
    rpc = Rpc(gw, KEY, version)
    assert rpc.init["protocolVersion"] == version
    assert "everything__echo" in rpc.tools()


def test_an_unknown_version_is_answered_with_the_latest(gw: str) -> None:
    rpc = Rpc(gw, KEY, "2099-01-01")
    assert rpc.init["protocolVersion"] == "2025-11-25"


# --- the call's promises ------------------------------------------------------------------


def test_http_upstream_gets_the_gateways_credential_and_answers(gw: str) -> None:
    rpc = Rpc(gw, KEY)
    assert _text(rpc.call("everyhttp__echo", {"message": "over http"})) == "Echo: over http"
    sums = rpc.call("everyhttp__get-sum", {"a": 2, "b": 3})
    assert "5" in _text(sums)


def test_pii_reaches_the_upstream_redacted_and_the_audit_row(gw: str) -> None:
    rpc = Rpc(gw, KEY)
    answer = rpc.call("faulty__echo", {"text": "pay with", "card": CARD})
    seen = json.loads(_text(answer))  # what the upstream received
    assert CARD not in seen["card"]
    assert "4111" not in seen["card"]
    rows = _audit_rows("faulty/echo")
    assert rows
    assert CARD not in rows[-1]["prompt"]
    assert rows[-1]["key_id"] == "agent"
    assert rows[-1]["tenant"] == "bank-a"
    assert rows[-1]["status"] == "ok"
    assert rows[-1]["deployment"] == "faulty"


def test_every_call_leaves_one_audit_row(gw: str) -> None:
    rpc = Rpc(gw, KEY)
    before = len(_audit_rows("everything/get-sum", settle=False))
    for i in range(3):
        rpc.call("everything__get-sum", {"a": i, "b": 1})
    denied = len(_audit_rows("everything/get-env", settle=False))
    rpc.call("everything__get-env", {})  # refused before the upstream: a row all the same
    rows = _audit_rows("everything/get-sum", want=before + 3)
    assert len(rows) == before + 3
    assert all(r["api"] == "mcp" for r in rows)
    assert all(r["total_ms"] > 0 for r in rows)
    refused = _audit_rows("everything/get-env", want=denied + 1)
    assert len(refused) == denied + 1
    assert refused[-1]["status"] == "error"
    assert refused[-1]["error_code"] == "denied:-32003"


def _audit_rows(model: str, want: int = 1, settle: bool = True) -> list[dict[str, Any]]:
    path = os.environ["MCP_TEST_AUDIT_DB"]
    end = time.monotonic() + (10 if settle else 0)
    rows: list[dict[str, Any]] = []
    while True:
        if Path(path).exists():
            with sqlite3.connect(path) as db:
                db.row_factory = sqlite3.Row
                rows = [dict(r) for r in db.execute(
                    "SELECT * FROM audit_requests WHERE api = 'mcp' AND model = ? ORDER BY ts", (model,)
                )]  # fmt: skip
        if len(rows) >= want or time.monotonic() >= end:
            return rows
        time.sleep(0.1)


def test_metrics_count_calls_by_server_tool_and_status(gw: str) -> None:
    rpc = Rpc(gw, KEY)
    rpc.call("everything__echo", {"message": "m"})
    text = httpx.get(gw + "/metrics").text
    line = next(
        ln for ln in text.splitlines()
        if ln.startswith('aiserve_mcp_calls_total{server="everything",status="ok",tool="echo"}')
    )  # fmt: skip
    assert float(line.split()[-1]) >= 1
    # A tool name the upstream does not list is no label of its own.
    assert rpc.call("everyhttp__no-such-tool")["error"]["code"] == -32602
    text = httpx.get(gw + "/metrics").text
    assert 'aiserve_mcp_calls_total{server="everyhttp",status="invalid",tool="other"}' in text
    assert "no-such-tool" not in text
    assert 'aiserve_mcp_call_seconds_bucket{le="0.005",server="everything"}' in text


def test_a_big_result_is_cut_with_a_marker(gw: str) -> None:
    answer = Rpc(gw, KEY).call("faulty__big", {"n": 50_000})
    text = _text(answer)
    assert "[aiserve: result cut to 2000 bytes" in text
    assert len(json.dumps(answer)) < 3000


def test_a_hung_upstream_hits_the_deadline_and_is_cancelled_upstream(gw: str) -> None:
    rpc = Rpc(gw, KEY)
    before = int(_text(rpc.call("faulty__cancelled")))
    t0 = time.monotonic()
    answer = rpc.call("faulty__hang", timeout_ms="800")
    took = time.monotonic() - t0
    assert answer["error"]["code"] == -32001
    assert "800 ms" in answer["error"]["message"]
    assert 0.7 < took < 2.5
    end = time.monotonic() + 5
    while int(_text(rpc.call("faulty__cancelled"))) == before and time.monotonic() < end:
        time.sleep(0.05)
    assert int(_text(rpc.call("faulty__cancelled"))) == before + 1
    # and the server's own timeout_ms (5 s) bounds a client that sends none
    assert rpc.call("faulty__echo", {"text": "still serving"})["result"]


def test_a_clients_cancellation_reaches_the_upstream(gw: str) -> None:
    rpc = Rpc(gw, KEY)
    before = int(_text(rpc.call("faulty__cancelled")))

    async def main() -> tuple[Any, float]:
        async with trio.open_nursery() as nursery:
            got: list[Any] = []

            async def call() -> None:
                msg = {"jsonrpc": "2.0", "id": 4242, "method": "tools/call",
                       "params": {"name": "faulty__hang", "arguments": {}}}  # fmt: skip
                r = await trio.to_thread.run_sync(lambda: rpc.post(msg))
                got.append(r.json())

            nursery.start_soon(call)
            await trio.sleep(0.5)
            t0 = time.monotonic()
            note = {"method": "notifications/cancelled", "params": {"requestId": 4242}}
            await trio.to_thread.run_sync(lambda: rpc.post(note))
        return got[0], time.monotonic() - t0

    answer, took = trio.run(main)
    assert answer["error"]["code"] == -32001
    assert "cancelled" in answer["error"]["message"]
    assert took < 2
    end = time.monotonic() + 5
    while int(_text(rpc.call("faulty__cancelled"))) == before and time.monotonic() < end:
        time.sleep(0.05)
    assert int(_text(rpc.call("faulty__cancelled"))) == before + 1


def test_a_client_that_goes_away_cancels_its_call_upstream(gw: str) -> None:
    rpc = Rpc(gw, KEY)
    before = int(_text(rpc.call("faulty__cancelled")))
    body = json.dumps({"jsonrpc": "2.0", "id": 5, "method": "tools/call",
                       "params": {"name": "faulty__hang", "arguments": {}}}).encode()  # fmt: skip
    host, port = gw.removeprefix("http://").split(":")
    head = (
        f"POST /mcp HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"accept: application/json\r\nauthorization: Bearer {KEY}\r\n"
        f"mcp-session-id: {rpc.headers['mcp-session-id']}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head.encode() + body)
        time.sleep(0.5)  # the call is upstream, hanging
    end = time.monotonic() + 4  # well before the server's 5 s timeout_ms
    while int(_text(rpc.call("faulty__cancelled"))) == before and time.monotonic() < end:
        time.sleep(0.05)
    assert int(_text(rpc.call("faulty__cancelled"))) == before + 1


def test_a_stdio_server_killed_mid_call_errors_then_restarts(gw: str) -> None:
    rpc = Rpc(gw, KEY)
    pid = _text(rpc.call("faulty__pid"))
    t0 = time.monotonic()
    answer = rpc.call("faulty__crash")
    assert time.monotonic() - t0 < 2  # not the 5 s deadline: the exit is seen at once
    assert answer["error"]["code"] == -32010
    assert "exit" in answer["error"]["message"] or "closed" in answer["error"]["message"]
    end = time.monotonic() + 10
    while time.monotonic() < end:
        again = rpc.call("faulty__pid", timeout_ms="3000")
        if "result" in again:
            break
        time.sleep(0.1)
    assert _text(again) != pid  # a new child answers
    health = httpx.get(gw + "/healthz").json()["mcp"]["faulty"]
    assert health["state"] == "ready"
    assert health["restarts"] >= 1


def test_garbage_from_a_stdio_server_is_a_clear_error_then_it_restarts(gw: str) -> None:
    rpc = Rpc(gw, KEY)
    answer = rpc.call("faulty__garbage")
    assert answer["error"]["code"] == -32010
    assert "garbage" in answer["error"]["message"]
    end = time.monotonic() + 10
    while time.monotonic() < end:
        again = rpc.call("faulty__echo", {"text": "back"}, timeout_ms="3000")
        if "result" in again:
            break
        time.sleep(0.1)
    assert json.loads(_text(again))["text"] == "back"


def test_rpm_limits_a_keys_calls(gw: str) -> None:
    rpc = Rpc(gw, KEY_SLOW)
    codes = [
        rpc.call("faulty__echo", {"text": str(i)}).get("error", {}).get("code") for i in range(3)
    ]
    assert codes[:2] == [None, None]
    assert codes[2] == -32029


def test_progress_streams_as_sse_before_the_result(gw: str) -> None:
    rpc = Rpc(gw, KEY)
    msg = {
        "jsonrpc": "2.0", "id": 7, "method": "tools/call",
        "params": {
            "name": "everything__trigger-long-running-operation",
            "arguments": {"duration": 1, "steps": 3},
            "_meta": {"progressToken": "p-1"},
        },
    }  # fmt: skip
    r = rpc.post(msg)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(ln[5:]) for ln in r.text.splitlines() if ln.startswith("data:")]
    progress = [e for e in events if e.get("method") == "notifications/progress"]
    assert len(progress) == 3
    assert all(p["params"]["progressToken"] == "p-1" for p in progress)
    assert events[-1]["id"] == 7
    assert "Long running operation completed" in _text(events[-1])


def test_healthz_shows_each_servers_state(gw: str) -> None:
    health = httpx.get(gw + "/healthz").json()
    assert health["status"] == "ok"
    assert {n: s["transport"] for n, s in health["mcp"].items()} == {
        "everything": "stdio",
        "everyhttp": "http",
        "faulty": "stdio",
        "faultyhttp": "http",
    }
    assert health["mcp"]["everyhttp"]["state"] == "ready"


def test_admin_lists_servers_tools_and_recent_calls_of_its_tenants(gw: str) -> None:
    Rpc(gw, KEY).call("everything__echo", {"message": "from bank-a"})
    Rpc(gw, KEY_NARROW).call("everything__echo", {"message": "from bank-b"})

    def admin(key: str) -> dict[str, Any]:
        r = httpx.get(gw + "/admin/mcp", headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return dict(r.json())

    every = admin(KEY_OPS)
    assert every["servers"]["everything"]["state"] == "ready"
    assert "get-env" in every["servers"]["everything"]["tool_names"]
    assert {"bank-a", "bank-b"} <= {c["tenant"] for c in every["calls"]}
    latest = every["calls"][0]
    assert (latest["key_id"], latest["server"], latest["tool"]) == ("narrow", "everything", "echo")
    assert {c["tenant"] for c in admin(KEY_OPS_B)["calls"]} == {"bank-b"}
    r = httpx.get(gw + "/admin/mcp", headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 403  # not an admin


def test_the_console_shows_each_servers_state_tools_and_the_recent_calls(gw: str) -> None:
    from playwright.sync_api import expect

    from .test_console_browser import browser_page, log_in

    rpc = Rpc(gw, KEY)
    rpc.call("everything__echo", {"message": "seen in the console"})
    refused = rpc.post({"method": "tools/call", "params": {"name": "everything__get-env"}})
    assert refused.json()["error"]["code"] == -32003
    with browser_page() as page:
        page.goto(f"{gw}/admin/")
        log_in(page, KEY_OPS)
        expect(page.locator("#mcp")).to_be_visible()
        row = page.locator("#mcp-servers tbody tr[data-server=everything]")
        expect(row.locator("td.state")).to_have_text("ready")
        cells = row.locator("td").all_inner_texts()
        assert cells[2] == "stdio"
        listed = httpx.get(gw + "/admin/mcp", headers={"authorization": f"Bearer {KEY_OPS}"})
        assert int(cells[3]) == listed.json()["servers"]["everything"]["tools"] > 0
        row.locator("summary").click()
        expect(row.locator("details span")).to_contain_text("get-env")
        expect(
            page.locator("#mcp-servers tbody tr[data-server=faultyhttp] td").nth(5)
        ).to_have_text("bank-b: ready")
        calls = page.locator("#mcp-calls tbody tr")
        newest, before = calls.nth(0).locator("td"), calls.nth(1).locator("td")
        expect(newest.nth(3)).to_have_text("everything__get-env")
        expect(newest.nth(4)).to_have_text("denied")
        assert before.all_inner_texts()[1:5] == ["agent", "bank-a", "everything__echo", "ok"]


def test_a_hung_http_upstream_hits_the_deadline_and_is_cancelled_upstream(gw: str) -> None:
    rpc = Rpc(gw, KEY)
    before = int(_text(rpc.call("faultyhttp__cancelled")))
    t0 = time.monotonic()
    answer = rpc.call("faultyhttp__hang", timeout_ms="800")
    assert answer["error"]["code"] == -32001
    assert 0.7 < time.monotonic() - t0 < 2.5
    end = time.monotonic() + 5
    while int(_text(rpc.call("faultyhttp__cancelled"))) == before and time.monotonic() < end:
        time.sleep(0.05)
    assert int(_text(rpc.call("faultyhttp__cancelled"))) == before + 1


def test_prompts_and_resources_of_a_whole_granted_server(gw: str) -> None:
    rpc = Rpc(gw, KEY)  # everyhttp/* (the whole server); everything: three tools only
    prompts = rpc.post({"method": "prompts/list"}).json()["result"]["prompts"]
    names = [p["name"] for p in prompts]
    assert names
    assert all(n.startswith("everyhttp__") for n in names)
    simple = next(n for n in names if "simple" in n)
    got = rpc.post({"method": "prompts/get", "params": {"name": simple}}).json()
    assert got["result"]["messages"]
    resources = rpc.post({"method": "resources/list"}).json()["result"]["resources"]
    uri = resources[0]["uri"]
    assert uri.startswith("demo://")  # a resource keeps the upstream's URI
    read = rpc.post({"method": "resources/read", "params": {"uri": uri}}).json()
    assert read["result"]["contents"][0]["uri"] == uri
    # A key granted one tool of a server sees none of its prompts and cannot get one.
    narrow = Rpc(gw, KEY_NARROW)
    assert narrow.post({"method": "prompts/list"}).json()["result"]["prompts"] == []
    refused = narrow.post(
        {"method": "prompts/get", "params": {"name": "everything__simple-prompt"}}
    )
    assert refused.json()["error"]["code"] == -32003


def test_a_tenant_reaches_an_http_server_with_its_own_credential(gw: str) -> None:
    mine = Rpc(gw, KEY).call("faultyhttp__whoami")
    assert _text(mine) == "Bearer upstream-secret"  # the server's own credential
    theirs = Rpc(gw, KEY_B).call("faultyhttp__whoami")
    assert _text(theirs) == "Bearer bank-b-secret"  # bank-b's, on a session of its own
    health = httpx.get(gw + "/healthz").json()["mcp"]["faultyhttp"]
    assert health["tenants"] == {"bank-b": "ready"}
    # Neither credential is ever shown to a client.
    listing = json.dumps(Rpc(gw, KEY_B).post({"method": "tools/list"}).json())
    assert "secret" not in listing


def test_an_http_upstream_that_dies_mid_call_is_a_clear_error_at_once(gw: str) -> None:
    # Last in the module: the HTTP server is the test's, not the gateway's child, so
    # nothing starts it again.
    rpc = Rpc(gw, KEY)
    t0 = time.monotonic()
    answer = rpc.call("faultyhttp__crash")
    assert time.monotonic() - t0 < 2  # not the 5 s deadline
    assert answer["error"]["code"] == -32010
    assert "faultyhttp" in answer["error"]["message"]
    again = rpc.call("faultyhttp__echo", {"text": "x"})
    assert again["error"]["code"] == -32010
    assert "cannot be reached" in again["error"]["message"]
    assert _text(rpc.call("faulty__echo", {"text": "others still serve"}))
