"""Each ``tools/call`` through ``/mcp`` recorded for replay (issue 52, item 3): the line
(pure, no socket), the recorder's choice of what to take, how a replayed answer counts,
and a gateway with ``[record]`` and the SDK-written faulty server over stdio recording a
call with its PII redacted and a refused call as ``denied``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from aiserve_trio.config import parse_config
from aiserve_trio.record.labels import LabelRules
from aiserve_trio.record.line import LineBuilder
from aiserve_trio.record.mcpcall import ToolCall
from aiserve_trio.record.recorder import recorded_routes
from aiserve_trio.record.schema import MCP_ROUTE, VERSION, decoder
from aiserve_trio.record.settings import check_record, default_rules
from aiserve_trio.replay.client import request_headers
from aiserve_trio.replay.timing import StreamTimer
from aiserve_trio.runtime.asgi import App
from aiserve_trio.security.auth import hash_key

from .asgi_client import Client
from .conftest import config_text, make_config

CARD = "4111 1111 1111 1111"
MAIL = "bob.smith@example.com"
KEY = "aik_tools_" + "t" * 32  # faulty/echo only
OFF = "[auth]\nenabled = false\n"
VERSION_META = "io.modelcontextprotocol/protocolVersion"


def builder(*, redact: bool = True) -> LineBuilder:
    redactor = make_config().build_policies(["gdpr-redact"])[0] if redact else None
    return LineBuilder(
        LabelRules(default_rules()), redactor=redactor, session_key=b"k", started=1000.0, clock_start=5.0
    )


def call(**over: Any) -> ToolCall:
    fields: dict[str, Any] = {
        "arrival": 7.5, "ended": 7.5412, "server": "faulty", "tool": "echo", "known": True,
        "message_id": 3, "arguments": {"text": f"card {CARD}", "card": MAIL}, "status": "ok",
        "error_code": None, "result_bytes": 812,
    }  # fmt: skip
    fields.update(over)
    return ToolCall(**fields)


def line_of(c: ToolCall, *, redact: bool = True) -> dict[str, Any]:
    raw = builder(redact=redact).call_line(c)
    assert raw.endswith(b"\n")
    assert decoder.decode(raw).has_body  # what aiserve-replay reads
    out: dict[str, Any] = json.loads(raw)
    return out


# --- the line (pure) ---------------------------------------------------------------


def test_a_tool_calls_line_is_a_stateless_jsonrpc_message_redacted() -> None:
    line = line_of(call(timeout="3000"))
    assert line["v"] == VERSION == 2
    assert line["route"] == "/mcp"
    assert line["started"] == 1000.0
    assert line["offset"] == 2.5
    assert line["body"]["jsonrpc"] == "2.0"
    assert line["body"]["method"] == "tools/call"
    assert line["body"]["id"] == 3
    params = line["body"]["params"]
    assert params["name"] == "faulty__echo"
    assert params["_meta"] == {VERSION_META: "2026-07-28"}
    args = json.dumps(params["arguments"])
    assert CARD not in args
    assert "4111" not in args
    assert MAIL not in args
    assert "bob.smith" not in args
    assert set(params["arguments"]) == {"text", "card"}
    assert line["headers"] == {"x-channel": "mcp", "x-request-timeout-ms": "3000"}
    assert line["labels"] == {"server": "faulty", "tool": "echo"}
    assert line["outcome"] == {"status": "ok", "total_ms": 41.2, "result_bytes": 812}


def test_redact_false_keeps_what_the_policies_let_through() -> None:
    line = line_of(call(), redact=False)
    assert line["body"]["params"]["arguments"] == {"text": f"card {CARD}", "card": MAIL}


def test_a_refused_call_keeps_its_status_and_no_arguments() -> None:
    line = line_of(call(status="denied", error_code="-32003", arguments=None, result_bytes=0))
    assert line["outcome"]["status"] == "denied"
    assert line["outcome"]["error"] == "-32003"
    assert line["body"]["params"]["arguments"] == {}


@pytest.mark.parametrize(
    ("status", "code", "recorded", "error"),
    [
        ("ok", None, "ok", None),
        ("invalid", "-32602", "invalid", "-32602"),
        ("timeout", "-32001", "timeout", "-32001"),
        ("cancelled", "-32001", "client_closed", None),
        ("upstream_error", "-32603", "error", "upstream_error:-32603"),
        ("tool_error", None, "error", "tool_error"),
        ("rate_limited", "-32029", "error", "rate_limited:-32029"),
    ],
)
def test_statuses(status: str, code: str | None, recorded: str, error: str | None) -> None:
    out = line_of(call(status=status, error_code=code))["outcome"]
    assert (out["status"], out.get("error")) == (recorded, error)


def test_a_tool_the_upstream_does_not_list_is_labelled_other() -> None:
    assert line_of(call(tool="no such, tool", known=False))["labels"] == {"server": "faulty", "tool": "other"}
    assert line_of(call(tool="x" * 80))["labels"]["tool"] == "other"  # no label value


# --- what is recorded ----------------------------------------------------------------


def test_mcp_is_recorded_when_routes_are_all_or_name_it() -> None:
    def routes(record: str) -> dict[str, str]:
        return recorded_routes(make_config(f"[record]\nenabled = true\n{record}"))

    assert MCP_ROUTE in routes("")
    assert MCP_ROUTE in routes('routes = ["/mcp"]')
    assert MCP_ROUTE not in routes('routes = ["/v1/chat/completions"]')
    assert check_record(["/v1/chat/completions"], make_config('[record]\nroutes = ["/mcp"]').record) is None


def test_a_replay_sends_an_mcp_line_stateless_with_its_key() -> None:
    record = decoder.decode(builder().call_line(call()))
    headers = dict(request_headers(record, "aik_replay", "run1", sessions=True))
    assert headers["mcp-protocol-version"] == "2026-07-28"
    assert "application/json" in headers["accept"]
    assert "text/event-stream" in headers["accept"]
    assert headers["authorization"] == "Bearer aik_replay"
    assert "mcp-session-id" not in headers
    assert "x-session-id" not in headers


@pytest.mark.parametrize(
    ("status", "body", "error"),
    [
        (200, {"jsonrpc": "2.0", "id": 1, "result": {"content": []}}, None),
        (200, {"jsonrpc": "2.0", "id": 1, "error": {"code": -32003, "message": "no grant"}}, "rpc_-32003"),
        (200, {"jsonrpc": "2.0", "id": 1, "result": {"content": [], "isError": True}}, "tool_error"),
        (200, {"jsonrpc": "2.0", "id": 1}, "malformed_body"),
        (401, {"jsonrpc": "2.0", "id": None, "error": {"code": -32001, "message": "no key"}}, "http_401"),
    ],
)
def test_a_replayed_tool_calls_answer_is_an_error_when_jsonrpc_says_so(
    status: int, body: dict[str, Any], error: str | None
) -> None:
    timer = StreamTimer(0, 0, 10.0, stream=False, rpc=True)
    timer.head(status)
    timer.feed(json.dumps(body).encode(), 10.02)
    result = timer.finish(10.03)
    assert result.error == error
    assert result.total == pytest.approx(0.03)
    assert result.ttft is None


# --- a gateway recording tool calls ---------------------------------------------------


def gateway_toml(directory: Path, record: str = "", mcp: str = "") -> str:
    auth = f"""[auth]
enabled = true
[[auth.keys]]
id = "tools"
hash = "{hash_key(KEY)}"
tenant = "bank-a"
mcp_tools = ["faulty/echo"]
"""
    return (
        config_text().replace(OFF, auth)
        + f"""
[record]
enabled = true
path = "{directory}"
{record}

[mcp]
{mcp}

[mcp.servers.faulty]
command = ["{sys.executable}", "-m", "tests.mcp_servers.faulty"]
timeout_ms = 10000
"""
    )


def tools_call(name: str, arguments: dict[str, Any], id_: int = 1) -> dict[str, Any]:
    meta = {VERSION_META: "2026-07-28"}
    return {"jsonrpc": "2.0", "id": id_, "method": "tools/call",
            "params": {"name": name, "arguments": arguments, "_meta": meta}}  # fmt: skip


async def recorded_calls(
    directory: Path, *calls: dict[str, Any], record: str = "", mcp: str = ""
) -> list[dict[str, Any]]:
    """The lines a gateway recording into ``directory`` writes for ``calls`` (sent with KEY)."""
    app = App(parse_config(gateway_toml(directory, record, mcp), source="<test>"))
    headers = {"accept": "application/json, text/event-stream", "authorization": f"Bearer {KEY}",
               "mcp-protocol-version": "2026-07-28"}  # fmt: skip
    async with trio.open_nursery() as nursery:
        await app.startup(nursery)
        try:
            client = Client(app)
            with trio.fail_after(30):
                while True:  # the server starts as a child process: polled
                    health = json.loads((await client.request("GET", "/healthz")).body)
                    if health["mcp"]["faulty"]["state"] == "ready":
                        break
                    await trio.sleep(0.05)
            for c in calls:
                r = await client.request("POST", "/mcp", headers=headers, json_body=c)
                assert r.status == 200, r.body
        finally:
            await app.shutdown()  # the writer writes what is queued
    return [json.loads(x) for x in read_recording_text(directory).splitlines()]


def read_recording_text(directory: Path) -> str:
    return "".join(f.read_text() for f in sorted(directory.glob("rec-*.jsonl")))


@pytest.mark.slow
async def test_a_gateway_records_a_tool_call_redacted_and_a_refused_one_as_denied(tmp_path: Path) -> None:
    ok = tools_call("faulty__echo", {"text": f"my card is {CARD}", "card": MAIL}, 7)
    refused = tools_call("faulty__pid", {"text": f"card {CARD}"}, 8)
    lines = await recorded_calls(tmp_path, ok, refused)
    assert CARD not in json.dumps(lines)
    assert MAIL not in json.dumps(lines)
    assert "4111" not in json.dumps(lines)
    assert KEY not in json.dumps(lines)
    done, denied = lines
    assert done["route"] == denied["route"] == "/mcp"
    assert done["body"]["params"]["name"] == "faulty__echo"
    assert set(done["body"]["params"]["arguments"]) == {"text", "card"}
    assert done["body"]["params"]["arguments"]["text"].startswith("my card is ")
    assert done["labels"] == {"server": "faulty", "tool": "echo"}
    assert done["headers"] == {"x-channel": "mcp"}
    assert done["outcome"]["status"] == "ok"
    assert done["outcome"]["result_bytes"] > 0
    assert 0 < done["outcome"]["total_ms"] < 30_000
    assert denied["body"]["params"]["name"] == "faulty__pid"
    assert denied["labels"] == {"server": "faulty", "tool": "pid"}
    assert denied["outcome"]["status"] == "denied"
    assert "result_bytes" in denied["outcome"]
    assert denied["offset"] >= done["offset"]


@pytest.mark.slow
async def test_routes_that_leave_out_mcp_record_no_tool_call(tmp_path: Path) -> None:
    ok = tools_call("faulty__echo", {"text": "hi"})
    assert await recorded_calls(tmp_path, ok, record='routes = ["/v1/chat/completions"]') == []


@pytest.mark.slow
async def test_the_arguments_are_recorded_as_the_mcp_policies_left_them(tmp_path: Path) -> None:
    # The recording's own redaction off: what is redacted in the line is the policies'.
    ok = tools_call("faulty__echo", {"text": f"my card is {CARD}"}, 1)
    refused = tools_call("faulty__pid", {"text": f"card {CARD}"}, 2)
    done, denied = await recorded_calls(
        tmp_path, ok, refused, record="redact = false", mcp='policies = ["gdpr-redact"]'
    )
    assert CARD not in json.dumps(done)
    assert done["body"]["params"]["arguments"]["text"].startswith("my card is ")
    # Refused before the policies ran: its arguments are not recorded.
    assert denied["outcome"]["status"] == "denied"
    assert denied["body"]["params"]["arguments"] == {}
