"""The MCP gateway's pure parts and its timed behaviour on Trio's virtual clock: JSON-RPC
parsing, grants, pages, the result cap, redaction in slices, the settings' checks, and an
upstream's restarts with backoff (issue 52)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio.testing

from aiserve_trio.config import ConfigError, build_policies, parse_config
from aiserve_trio.core.slices import finish
from aiserve_trio.mcp import jsonrpc
from aiserve_trio.mcp.endpoint import _cut, _page, _redact_fields, _redact_result
from aiserve_trio.mcp.grants import EVERYTHING, Grants
from aiserve_trio.mcp.jsonrpc import Message, Reply, RpcError
from aiserve_trio.mcp.settings import McpServerConfig
from aiserve_trio.mcp.upstream import HttpUpstream, _Exchange
from aiserve_trio.policies.base import PolicyContext

from .conftest import config_text, make_config

# --- JSON-RPC ---------------------------------------------------------------------------


def test_parse_one_request_and_a_notification() -> None:
    (m,), batch = jsonrpc.parse(b'{"jsonrpc":"2.0","id":7,"method":"tools/list"}', 32)
    assert not batch
    assert m == Message("tools/list", {}, 7)
    (n,), _ = jsonrpc.parse(b'{"jsonrpc":"2.0","method":"notifications/initialized"}', 32)
    assert isinstance(n, Message)
    assert n.notification


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{nope", jsonrpc.PARSE_ERROR),
        (b"", jsonrpc.PARSE_ERROR),
        (b"[]", jsonrpc.INVALID_REQUEST),
        (b"42", jsonrpc.INVALID_REQUEST),
        (
            b"[" + b",".join([b'{"jsonrpc":"2.0","id":1,"method":"ping"}'] * 3) + b"]",
            jsonrpc.INVALID_REQUEST,
        ),
    ],
)
def test_a_body_that_is_not_jsonrpc_is_refused_whole(body: bytes, code: int) -> None:
    with pytest.raises(RpcError) as info:
        jsonrpc.parse(body, 2)
    assert info.value.code == code


@pytest.mark.parametrize(
    ("message", "code"),
    [
        (b'{"id":1,"method":"ping"}', jsonrpc.INVALID_REQUEST),  # no "jsonrpc"
        (b'{"jsonrpc":"2.0","id":1}', jsonrpc.INVALID_REQUEST),  # no method
        (b'{"jsonrpc":"2.0","id":{"a":1},"method":"ping"}', jsonrpc.INVALID_REQUEST),
        (b'{"jsonrpc":"2.0","id":true,"method":"ping"}', jsonrpc.INVALID_REQUEST),
        (b'{"jsonrpc":"2.0","id":null,"method":"ping"}', jsonrpc.INVALID_REQUEST),
        (b'{"jsonrpc":"2.0","id":1,"method":"ping","params":[1]}', jsonrpc.INVALID_PARAMS),
    ],
)
def test_a_bad_message_in_a_batch_is_its_own_error(message: bytes, code: int) -> None:
    body = b'[{"jsonrpc":"2.0","id":9,"method":"ping"},' + message + b"]"
    (good, bad), batch = jsonrpc.parse(body, 32)
    assert batch
    assert good == Message("ping", {}, 9)
    assert isinstance(bad, RpcError)
    assert bad.code == code


def test_a_clients_response_is_recognised_and_ignored() -> None:
    (r,), _ = jsonrpc.parse(b'{"jsonrpc":"2.0","id":3,"result":{}}', 32)
    assert r == Reply(3)


# --- grants -----------------------------------------------------------------------------


def test_deny_by_default() -> None:
    g = Grants((), None, "k", "t")
    assert not g.tool("everything", "echo")
    assert not g.server("everything")


def test_exact_and_glob_grants() -> None:
    g = Grants(("everything/echo", "tickets/*", "files/read-?"), None, "k", "t")
    assert g.tool("everything", "echo")
    assert not g.tool("everything", "get-env")
    assert not g.tool("everything", "echo2")  # exact means exact
    assert g.tool("tickets", "create")
    assert g.server("tickets")
    assert g.tool("files", "read-a")
    assert not g.tool("files", "read-ab")
    assert not g.server("everything")  # one tool is not the whole server


def test_a_key_never_widens_its_tenants_grant() -> None:
    g = Grants(("*",), ("everything/echo",), "k", "bank-b")
    assert g.tool("everything", "echo")
    assert not g.tool("everything", "get-env")
    assert "tenant 'bank-b'" in g.refusal("everything", "get-env")
    assert "API key 'k'" in Grants((), ("*",), "k", "t").refusal("a", "b")


def test_auth_off_grants_everything() -> None:
    assert EVERYTHING.tool("any", "thing")


# --- pages, cap, redaction ----------------------------------------------------------------


def test_pages_walk_every_item_once_and_a_bad_cursor_is_invalid_params() -> None:
    items = [{"name": f"t{i}"} for i in range(250)]
    seen: list[dict[str, Any]] = []
    params: dict[str, Any] = {}
    for _ in range(5):
        page = _page(items, params, "tools")
        seen += page["tools"]
        if "nextCursor" not in page:
            break
        params = {"cursor": page["nextCursor"]}
    assert seen == items
    for bad in ("zzz", 5, "b306OTk5", ""):
        with pytest.raises(RpcError) as info:
            _page(items, {"cursor": bad}, "tools")
        assert info.value.code == jsonrpc.INVALID_PARAMS


def test_a_big_result_is_cut_with_a_marker() -> None:
    result = {"content": [{"type": "text", "text": "é" * 5000}], "structuredContent": {"x": 1}}
    size = len(jsonrpc.encode(result))
    cut = finish(_cut(result, 1000, size))
    texts = [c["text"] for c in cut["content"]]
    assert texts[-1] == f"\n[aiserve: result cut to 1000 bytes of {size} by [mcp] max_result_bytes]"
    assert len(texts[0].encode()) <= 1000
    assert texts[0] == "é" * len(texts[0])
    assert "structuredContent" not in cut


def test_redaction_reaches_every_string_and_yields_between_slices() -> None:
    (policy,) = build_policies(["gdpr-redact"], make_config())
    ctx = PolicyContext(route="/mcp", channel="mcp", tenant="t", request_id="1")
    args = {
        "note": "card 4111 1111 1111 1111 " + "word " * 20_000,  # one long string
        "items": [{"mail": "ann@example.com"}] * 200,
        "card": 4111111111111111,  # a number, by its digits
        "n": 3,
    }
    steps = _redact_fields({"arguments": args}, [policy], ctx)
    yields = 0
    with contextlib.suppress(StopIteration):
        while True:
            next(steps)
            yields += 1
    assert yields > 100  # in slices, never one hold of the loop
    out, changed = finish(_redact_fields({"arguments": args}, [policy], ctx))
    assert changed
    red = out["arguments"]
    assert "4111" not in red["note"]
    assert red["note"].endswith("word " * 10)
    assert "ann@example.com" not in str(red["items"])
    assert "4111" not in str(red["card"])
    assert red["n"] == 3
    result = {
        "content": [
            {"type": "text", "text": "mail ann@example.com"},
            {"type": "image", "data": "x"},
        ],
        "structuredContent": {"mail": "bob@example.com"},
    }
    red_result, changed = finish(_redact_result(result, [policy], ctx))
    assert changed
    assert "ann@example.com" not in red_result["content"][0]["text"]
    assert "bob@example.com" not in str(red_result["structuredContent"])
    assert red_result["content"][1] == {"type": "image", "data": "x"}  # data is not text


# --- settings -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("table", "why"),
    [
        ('[mcp.servers.a]\ncommand = ["x"]\nurl = "http://h/mcp"\n', "exactly one"),
        ("[mcp.servers.a]\n", "exactly one"),
        ('[mcp.servers.a_b]\nurl = "http://h/mcp"\n', "prefixes the tools"),
        ('[mcp.servers.a]\nurl = "ftp://h/mcp"\n', "http:// or https://"),
        ('[mcp.servers.a]\ncommand = ["x"]\nheaders = { a = "b" }\n', "only an HTTP server"),
        (
            '[mcp.servers.a]\nurl = "http://h/mcp"\nheaders = { Mcp-Session-Id = "x" }\n',
            "set by the gateway",
        ),
        ('[mcp.servers.a]\nurl = "http://h/mcp"\ntimeout_ms = 0\n', "positive"),
        ('[mcp]\npolicies = ["no-such-policy"]\n', "no-such-policy"),
        (
            '[mcp.servers.a]\ncommand = ["x"]\n[mcp.servers.a.tenants.t]\nheaders = {}\n',
            "only an HTTP",
        ),
        ('[mcp.servers.a]\nurl = "http://h/mcp"\n[mcp.servers.a.tenants."a b"]\n', "must match"),
    ],
)
def test_bad_mcp_tables_are_config_errors(table: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        parse_config(config_text() + "\n" + table, source="<test>")


def test_a_tenants_mcp_tools_are_read() -> None:
    cfg = parse_config(config_text() + '\n[tenants.acme]\nmcp_tools = ["a/*"]\n', source="<t>")
    assert cfg.tenants["acme"].mcp_tools == ["a/*"]


# --- an upstream's restarts, on the virtual clock ------------------------------------------


class _Down:
    """An HTTP upstream that refuses every connection, counting when it was tried."""

    def __init__(self) -> None:
        self.tries: list[float] = []

    @contextlib.asynccontextmanager
    async def exchange(self, body: bytes, headers: dict[str, str]) -> AsyncIterator[_Exchange]:
        self.tries.append(trio.current_time())
        raise OSError("connection refused")
        yield  # pragma: no cover

    async def aclose(self) -> None:
        pass


async def test_an_unreachable_upstream_is_tried_again_with_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = McpServerConfig(url="http://127.0.0.1:9/mcp", restart_ms=100, restart_max_ms=800)
    up = HttpUpstream("t", cfg)
    down = _Down()
    up._http = down  # type: ignore[assignment]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(up.run)
        await trio.sleep(3.0)
        nursery.cancel_scope.cancel()
    gaps = [round(b - a, 3) for a, b in zip(down.tries, down.tries[1:], strict=False)]
    assert gaps[:5] == [0.1, 0.2, 0.4, 0.8, 0.8]  # doubling to restart_max_ms
    assert up.state == "down"
    assert "cannot be reached" in up.error
    assert up.health()["restarts"] == len(down.tries) - 1


class _Paged:
    """An HTTP upstream answering with JSON: the handshake, then tools/list in pages of 2."""

    def __init__(self, tools: int) -> None:
        self.names = [f"t{i}" for i in range(tools)]
        self.cursors: list[Any] = []

    @contextlib.asynccontextmanager
    async def exchange(self, body: bytes, headers: dict[str, str]) -> AsyncIterator[_Exchange]:
        msg = json.loads(body)
        method = msg.get("method")
        result: Any = {}
        if method == "initialize":
            result = {
                "protocolVersion": "2025-06-18",
                "capabilities": {"tools": {}},
                "serverInfo": {},
            }
        elif method == "tools/list":
            cursor = msg["params"].get("cursor")
            self.cursors.append(cursor)
            start = int(cursor or 0)
            result = {
                "tools": [{"name": n, "inputSchema": {}} for n in self.names[start : start + 2]]
            }
            if start + 2 < len(self.names):
                result["nextCursor"] = str(start + 2)
        if "id" not in msg:
            yield _Exchange(202, {}, _chunks(b""))
            return
        answer = json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result}).encode()
        yield _Exchange(200, {"content-type": "application/json"}, _chunks(answer))

    async def aclose(self) -> None:
        pass


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    if data:
        yield data


async def test_an_upstreams_pages_are_all_fetched(autojump_clock: trio.testing.MockClock) -> None:
    up = HttpUpstream("t", McpServerConfig(url="http://127.0.0.1:9/mcp"))
    paged = _Paged(5)
    up._http = paged  # type: ignore[assignment]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(up.run)
        with trio.fail_after(5):
            await up.wait_ready()
        nursery.cancel_scope.cancel()
    assert [t["name"] for t in up.tools] == paged.names
    assert paged.cursors == [None, "2", "4"]
    assert up.protocol == "2025-06-18"
