"""Each MCP tool call is an OpenTelemetry span (issue 52): named for the tool, with its
server, tool, status, result size, tenant and key -- refused calls too."""

from __future__ import annotations

import json
import sys

import pytest
import trio
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from aiserve_trio.config import parse_config
from aiserve_trio.runtime.asgi import App

from .conftest import config_text
from .sim_gateway import running

pytestmark = pytest.mark.slow


async def test_a_tool_call_is_a_span() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    text = (
        config_text()
        + f"""
[mcp.servers.faulty]
command = ["{sys.executable}", "-m", "tests.mcp_servers.faulty"]
"""
    )
    app = App(parse_config(text, source="<test>"), tracer_provider=provider)
    async with running(app) as client:
        with trio.fail_after(30):
            while True:
                health = json.loads((await client.request("GET", "/healthz")).body)
                if health["mcp"]["faulty"]["state"] == "ready":
                    break
                await trio.sleep(0.1)
        headers = {"accept": "application/json, text/event-stream"}
        init = {"protocolVersion": "2025-11-25", "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"}}  # fmt: skip
        r = await client.request("POST", "/mcp", headers=headers,
                                 json_body={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": init})  # fmt: skip
        headers["mcp-session-id"] = r.headers["mcp-session-id"]
        for i, args in enumerate(({"text": "hi"}, ["not", "an", "object"])):
            call = {"jsonrpc": "2.0", "id": 2 + i, "method": "tools/call",
                    "params": {"name": "faulty__echo", "arguments": args}}  # fmt: skip
            await client.request("POST", "/mcp", headers=headers, json_body=call)
    spans = [s for s in exporter.get_finished_spans() if s.name.startswith("mcp ")]
    assert [s.name for s in spans] == ["mcp tools/call faulty__echo"] * 2
    ok, bad = (dict(s.attributes or {}) for s in spans)
    assert ok["mcp.server"] == "faulty"
    assert ok["mcp.tool"] == "echo"
    assert ok["mcp.status"] == "ok"
    assert isinstance(ok["mcp.result_bytes"], int)
    assert ok["mcp.result_bytes"] > 0
    assert ok["aiserve.tenant"] == "default"
    assert bad["mcp.status"] == "invalid"
