"""``/mcp``: the gateway's MCP endpoint (Streamable HTTP), one per runtime.

A client POSTs JSON-RPC (one message or a batch); the answer is JSON (``tools/call``
with a progress token and ``Accept: text/event-stream``: an SSE stream that relays the
upstream's progress, then the result). Handshake-era clients (``initialize``, protocol
2024-11-05 to 2025-11-25) get an ``Mcp-Session-Id`` bound to their key; 2026-07-28
clients (``server/discover``, the version in each request's ``_meta``) need none.
``DELETE`` ends a session.

Tools are listed as ``server__tool``, the upstream's schema and annotations as they
came; the caller sees and calls only what its grants allow (:mod:`.grants`). Each
``tools/call`` runs under its deadline (the client's ``X-Request-Timeout-Ms`` or the
server's ``timeout_ms``, whichever ends first), the key's ``rpm``, the ``[mcp]
policies``' redaction (arguments out, text results back), a cap on the result's size,
and leaves one audit row and its metrics, and, with ``[record]`` on, one recorded line
(:class:`~aiserve_trio.record.mcpcall.ToolCall`, offered without waiting).
"""

from __future__ import annotations

import base64
import contextlib
import logging
import secrets
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import trio

from ..audit.row import Unredacted
from ..audit.schema import COLUMNS
from ..core.budgets import TIMEOUT_HEADER, effective_timeout_ms
from ..core.errors import BadRequest, GatewayError, PayloadTooLarge, RateLimited
from ..core.slices import ITEM_UNITS, Meter, Steps, finish, run_sliced
from ..http.body import read_body
from ..policies.base import Policy, PolicyContext
from ..record.mcpcall import REPLAY_HEADER, ToolCall
from ..server import server_call
from . import jsonrpc
from .grants import EVERYTHING, Grants
from .jsonrpc import Message, Reply, RpcError
from .sessions import Session, SessionIds
from .upstream import BIG_MESSAGE, Upstream, UpstreamError

if TYPE_CHECKING:
    from ..config import Config
    from ..http.endpoints import Request
    from ..security.gate import Gate
    from .hub import McpHub
    from .settings import McpConfig

log = logging.getLogger("aiserve_trio.mcp")

#: What the gateway answers ``initialize`` with when the client's version is not one of
#: these (the client then decides whether it can go on).
HANDSHAKE_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
MODERN_VERSIONS = ("2026-07-28",)
VERSIONS = HANDSHAKE_VERSIONS + MODERN_VERSIONS
VERSION_META = "io.modelcontextprotocol/protocolVersion"
SERVER_INFO = {"name": "aiserve-trio", "version": "0.1.0"}
SEP = "__"
#: Items of a list page.
PAGE = 100
CAPABILITIES: dict[str, Any] = {
    "tools": {"listChanged": False},
    "prompts": {"listChanged": False},
    "resources": {"listChanged": False},
}
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-store")]
_CUT_MARKER = "\n[aiserve: result cut to {cap} bytes of {size} by [mcp] max_result_bytes]"


class CallRecorder(Protocol):
    """Where each tool call goes to be recorded (``record.recorder.Recorder``)."""

    def offer_call(self, call: ToolCall) -> None:
        """Queue ``call`` if ``/mcp`` is recorded; never blocks."""
        ...


class HttpStatus(Exception):
    """The whole POST is refused with this HTTP status and JSON-RPC error."""

    def __init__(
        self, status: int, err: RpcError, headers: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        super().__init__(err.message)
        self.status = status
        self.err = err
        self.headers = headers or []


@dataclass(slots=True)
class Call:
    """What one ``tools/call`` did: its audit row's and metrics' facts."""

    server: str
    tool: str
    status: str = "ok"
    error_code: str | None = None
    args: str = ""
    size: int = 0
    redacted: bool = False
    #: The arguments went through ``[mcp] policies``.
    policies: bool = False
    #: The upstream lists the tool (else it is ``other`` in the metrics).
    known: bool = True
    #: Its OpenTelemetry span (when tracing records).
    span: Any = None
    #: The arguments as the upstream got them (after ``[mcp] policies``), for the
    #: recording; None while the call has not got that far.
    arguments: dict[str, Any] | None = None


class McpEndpoint:
    """The ``/mcp`` handler of one runtime (its config's grants, policies and limits)."""

    def __init__(
        self, config: Config, hub: McpHub, gate: Gate, recorder: CallRecorder | None = None
    ) -> None:
        self.settings: McpConfig = config.mcp
        self.hub = hub
        self.gate = gate
        policies = config.build_policies(config.mcp.policies)
        self.policies = [p for p in policies if type(p).redact_text is not Policy.redact_text]
        self.tenants = {n: t.mcp_tools for n, t in config.tenants.items()}
        self.default_tenant = config.server.default_tenant
        #: Session ids are signed with the gate's secret, so every worker reads them.
        self.ids = SessionIds(gate.derived_key("mcp session"))
        self._grants: dict[str, Grants] = {}
        #: ``[record]``: each tool call is offered to it (None: not recording).
        self.recorder = recorder

    # --- HTTP -------------------------------------------------------------------------

    async def handle(self, request: Request) -> None:
        if request.method == "DELETE":
            sid = request.headers.get("mcp-session-id", "")
            s = self._known(request, sid)
            if s is None:
                raise_404 = HttpStatus(404, RpcError(jsonrpc.INVALID_REQUEST, "unknown session"))
                await self._refuse(request, raise_404)
                return
            for call, scope in list(self.hub.calls.items()):
                if call[0] == sid:
                    scope.cancel()
            self.hub.ended.limit = self.settings.max_sessions  # a reload may have changed it
            self.hub.ended.add(sid)
            await request.responder.complete(200, _JSON, b"{}")
            return
        try:
            await self._post(request)
        except HttpStatus as refused:
            await self._refuse(request, refused)

    async def _refuse(self, request: Request, refused: HttpStatus) -> None:
        body = jsonrpc.encode(jsonrpc.error(refused.err))
        await request.responder.complete(refused.status, [*_JSON, *refused.headers], body)

    async def _post(self, request: Request) -> None:
        cfg = self.settings
        version = request.headers.get("mcp-protocol-version")
        if version is not None and version not in VERSIONS:
            raise HttpStatus(
                400,
                RpcError(
                    jsonrpc.INVALID_REQUEST,
                    f"unsupported MCP-Protocol-Version {version[:40]!r}; supported: "
                    + ", ".join(VERSIONS),
                ),
            )
        try:
            body = await read_body(request.receive, cfg.max_message_bytes)
        except PayloadTooLarge:
            limit = cfg.max_message_bytes
            why = f"invalid request: the body exceeds [mcp] max_message_bytes ({limit})"
            err = RpcError(jsonrpc.INVALID_REQUEST, why)
            raise HttpStatus(413, err) from None
        if body is None:
            return  # the client left
        try:
            messages, batch = jsonrpc.parse(body, cfg.max_batch)
        except RpcError as err:
            raise HttpStatus(400, err) from None
        sid = request.headers.get("mcp-session-id")
        session = self._session(request, sid, messages)
        accept = request.headers.get("accept", "")
        if (
            not batch
            and isinstance(m := messages[0], Message)
            and m.method == "tools/call"
            and "text/event-stream" in accept
            and isinstance(m.params.get("_meta"), dict)
            and "progressToken" in m.params["_meta"]
        ):
            await self._stream_call(request, m, session)
            return
        answers: list[dict[str, Any]] = []
        headers = list(_JSON)
        for m in messages:
            if isinstance(m, Reply):
                continue
            if isinstance(m, RpcError):
                answers.append(jsonrpc.error(m))
                continue
            if m.method == "initialize":
                answer, new_sid = self._initialize(request, m)
                if new_sid is not None:
                    headers.append((b"mcp-session-id", new_sid.encode()))
                answers.append(answer)
                continue
            one = await self._one(request, m, session)
            if one is not None:
                answers.append(one)
        if not answers:
            await request.responder.complete(202, [], b"")
            return
        body_out = jsonrpc.encode(answers if batch else answers[0])
        await request.responder.complete(200, headers, body_out)

    def _session(self, request: Request, sid: str | None, messages: list[Any]) -> Session | None:
        """The request's session (None: a stateless 2026-07-28 request or the handshake).

        Raises:
            HttpStatus: 404 for a session this worker does not know (or another key's):
                the client starts a new one; 400 for a handshake-era request without one.
        """
        if sid is not None:
            s = self._known(request, sid)
            if s is None:
                raise HttpStatus(
                    404, RpcError(jsonrpc.INVALID_REQUEST, "session not found: initialize again")
                )
            return s
        for m in messages:
            if not isinstance(m, Message) or m.method in ("initialize", "server/discover", "ping"):
                continue
            if _modern(m) is None and not m.method.startswith("notifications/"):
                raise HttpStatus(
                    400,
                    RpcError(
                        jsonrpc.INVALID_REQUEST,
                        "invalid request: Mcp-Session-Id is missing (send initialize first, "
                        "or the protocol version in _meta)",
                    ),
                )
        return None

    def _known(self, request: Request, sid: str) -> Session | None:
        """The session ``sid`` names, if this gateway signed it for the caller's key
        and it was not ended here."""
        s = self.ids.read(sid)
        if s is None or s.key_id != _key_id(request) or sid in self.hub.ended:
            return None
        return s

    def _initialize(self, request: Request, m: Message) -> tuple[dict[str, Any], str | None]:
        if m.notification:
            return jsonrpc.error(RpcError(jsonrpc.INVALID_REQUEST, "initialize is a request")), None
        asked = m.params.get("protocolVersion")
        if not isinstance(asked, str):
            err = RpcError(
                jsonrpc.INVALID_PARAMS, "invalid params: protocolVersion is missing", id=m.id
            )
            return jsonrpc.error(err), None
        version = asked if asked in HANDSHAKE_VERSIONS else HANDSHAKE_VERSIONS[-1]
        sid = self.ids.issue(_key_id(request), version)
        result = {
            "protocolVersion": version,
            "capabilities": CAPABILITIES,
            "serverInfo": SERVER_INFO,
            "instructions": "Tools of the MCP servers behind aiserve-trio, named server__tool.",
        }
        return jsonrpc.result(m.id, result), sid

    # --- one message --------------------------------------------------------------------

    async def _one(
        self, request: Request, m: Message, session: Session | None
    ) -> dict[str, Any] | None:
        if m.notification:
            if m.method == "notifications/cancelled" and session is not None:
                scope = self.hub.calls.get((session.sid, m.params.get("requestId")))
                if scope is not None:
                    scope.cancel()
            return None
        modern = _modern(m)
        try:
            value = await self._method(request, m, session)
        except RpcError as err:
            return jsonrpc.error(err, m.id)
        if modern is not None and isinstance(value, dict):
            value = {**value, "resultType": value.get("resultType", "complete")}
            if m.method in _CACHEABLE:  # required on the 2026-07-28 wire; per key: private
                value.setdefault("ttlMs", 0)
                value.setdefault("cacheScope", "private")
        return jsonrpc.result(m.id, value)

    async def _method(self, request: Request, m: Message, session: Session | None) -> Any:
        method, params = m.method, m.params
        grants = self.grants(request)
        tenant = self._tenant(request)
        ups = self.hub.of(tenant)  # each server as this tenant reaches it
        if method == "ping":
            return {}
        if method == "server/discover":
            return {
                "supportedVersions": list(VERSIONS),
                "capabilities": CAPABILITIES,
                "resultType": "complete",
                "ttlMs": 0,
                "cacheScope": "private",
                "_meta": {"io.modelcontextprotocol/serverInfo": SERVER_INFO},
            }
        if method == "tools/list":
            tools = [
                {**t, "name": f"{name}{SEP}{t['name']}"}
                for name, up in ups.items()
                for t in up.tools
                if grants.tool(name, t["name"])
            ]
            return _page(tools, params, "tools")
        if method == "tools/call":
            return await self.call(request, m, session)
        if method in ("prompts/list", "resources/list", "resources/templates/list"):
            key = _LISTS[method]
            items = [
                _prefixed(name, i, key)
                for name, up in ups.items()
                if grants.server(name)
                for i in getattr(up, _ATTR[key])
            ]
            return _page(items, params, key)
        if method == "prompts/get":
            server, name = self._split(params.get("name"), "prompt")
            if not grants.server(server):
                raise RpcError(jsonrpc.NOT_GRANTED, grants.refusal(server, "*"))
            return await self._forward(server, tenant, "prompts/get", {**params, "name": name})
        if method == "resources/read":
            uri = params.get("uri")
            if not isinstance(uri, str):
                raise RpcError(jsonrpc.INVALID_PARAMS, "invalid params: `uri` must be a string")
            server = self._resource_server(uri, grants, ups)
            return await self._forward(server, tenant, "resources/read", params)
        if method == "logging/setLevel":
            return {}
        if method == "completion/complete":
            return {"completion": {"values": [], "hasMore": False}}
        raise RpcError(jsonrpc.METHOD_NOT_FOUND, f"method not found: {method!r}")

    def grants(self, request: Request) -> Grants:
        """The caller's grants (compiled once per key and runtime)."""
        p = request.principal
        if p is None:
            return EVERYTHING
        known = self._grants.get(p.key_id)
        if known is not None and known.key == p.mcp_tools and known.tenant_name == p.tenant:
            return known
        tenant = self.tenants.get(p.tenant)
        grants = Grants(
            p.mcp_tools,
            None if tenant is None else tuple(tenant),
            key_id=p.key_id,
            tenant_name=p.tenant,
        )
        if len(self._grants) >= 10_000:
            self._grants.clear()
        self._grants[p.key_id] = grants
        return grants

    def _split(self, name: Any, what: str) -> tuple[str, str]:
        if not isinstance(name, str) or SEP not in name:
            raise RpcError(
                jsonrpc.INVALID_PARAMS,
                f"invalid params: `name` must name a {what} as server{SEP}{what}",
            )
        server, _, tool = name.partition(SEP)
        if self.hub.get(server) is None or server not in self.settings.servers:
            raise RpcError(jsonrpc.INVALID_PARAMS, f"invalid params: no MCP server {server!r}")
        return server, tool

    def _resource_server(self, uri: str, grants: Grants, ups: dict[str, Upstream]) -> str:
        granted = [(n, up) for n, up in ups.items() if grants.server(n)]
        for name, up in granted:
            if any(r.get("uri") == uri for r in up.resources):
                return name
        with_templates = [n for n, up in granted if up.templates]
        if len(with_templates) == 1:
            return with_templates[0]
        raise RpcError(
            jsonrpc.INVALID_PARAMS, f"invalid params: no granted server has {uri[:200]!r}"
        )

    async def _forward(self, server: str, tenant: str, method: str, params: dict[str, Any]) -> Any:
        up = self.hub.get(server, tenant)
        assert up is not None
        timeout = self.settings.servers[server].timeout_ms / 1000
        with trio.move_on_after(timeout):
            try:
                return await up.request(method, _plain(params))
            except UpstreamError as exc:
                raise RpcError(exc.code, exc.message, exc.data) from None
        raise RpcError(jsonrpc.REQUEST_TIMEOUT, f"MCP server {server!r} did not answer in time")

    # --- tools/call ---------------------------------------------------------------------

    async def call(
        self, request: Request, m: Message, session: Session | None, note: Any = None
    ) -> Any:
        """One ``tools/call``: grants, rate, deadline, redaction, cap, audit, metrics."""
        started = trio.current_time()
        name = m.params.get("name")
        server, tool = self._split(name, "tool")
        up = self.hub.get(server, self._tenant(request))
        assert up is not None
        # A tool the upstream does not list is "other" in the metrics: a client's names
        # are not labels.
        known = any(t.get("name") == tool for t in up.tools)
        record = Call(server, tool, known=known)
        args = m.params.get("arguments")
        if not self.policies and isinstance(args, dict):
            record.arguments = args  # what the upstream gets (no policy rewrites it)
        tracing = self.hub.tracing
        if tracing is not None and tracing.enabled:
            record.span = tracing.start("/mcp", request.headers, request.arrival).span
            record.span.update_name(f"mcp tools/call {server}{SEP}{tool}"[:200])
        try:
            result = await self._admitted(request, m, session, note, up, record, started)
        except RpcError as err:
            record.status = "error" if record.status == "ok" else record.status
            record.error_code = record.error_code or str(err.code)
            self._done(request, record, started)
            self._record(request, m, record, started)
            raise
        self._done(request, record, started)
        self._record(request, m, record, started)
        return result

    def _record(self, request: Request, m: Message, record: Call, started: float) -> None:
        """Offer the call to the recording (a ``send_nowait``: the call never waits)."""
        recorder = self.recorder
        if recorder is None:
            return
        recorder.offer_call(
            ToolCall(
                arrival=started,
                ended=trio.current_time(),
                server=record.server,
                tool=record.tool,
                known=record.known,
                message_id=m.id,
                arguments=record.arguments,
                status=record.status,
                error_code=record.error_code,
                result_bytes=record.size,
                timeout=request.headers.get(TIMEOUT_HEADER),
                replayed=REPLAY_HEADER in request.headers,
            )
        )

    async def _admitted(
        self, request: Request, m: Message, session: Session | None, note: Any, up: Any,
        record: Call, started: float,
    ) -> Any:  # fmt: skip
        """The call once its server is known: refused (grant, arguments, rate) or made."""
        server, tool = record.server, record.tool
        grants = self.grants(request)
        if not grants.tool(server, tool):
            record.status = "denied"
            raise RpcError(
                jsonrpc.NOT_GRANTED,
                grants.refusal(server, tool),
                {"grant": f"{server}/{tool}"},
            )
        args = m.params.get("arguments", {})
        if args is None:
            args = {}
        if not isinstance(args, dict):
            record.status = "invalid"
            raise RpcError(jsonrpc.INVALID_PARAMS, "invalid params: `arguments` must be an object")
        if not record.known and up.state == "ready":
            record.status = "invalid"
            raise RpcError(
                jsonrpc.INVALID_PARAMS, f"invalid params: unknown tool {m.params.get('name')!r}"
            )
        cfg = self.settings.servers[server]
        try:
            ms = effective_timeout_ms(
                request.headers.get(TIMEOUT_HEADER),
                default_ms=cfg.timeout_ms, max_ms=cfg.timeout_ms, reserve_ms=0,
            )  # fmt: skip
        except BadRequest as exc:
            record.status = "invalid"
            raise RpcError(jsonrpc.INVALID_REQUEST, exc.message) from None
        p = request.principal
        if p is not None and p.rpm:
            try:
                await self.gate.limiter.admit(p)
            except RateLimited as exc:
                record.status = "rate_limited"
                raise RpcError(
                    jsonrpc.RATE_LIMITED,
                    f"rate limited: API key {p.key_id!r} is over its rpm ({p.rpm} calls a minute)",
                    {"retry_after": exc.headers.get("Retry-After")},
                ) from None
        deadline = min(request.arrival, started) + ms / 1000
        return await self._call(request, up, record, args, deadline, ms, m, session, note)

    async def _call(
        self, request: Request, up: Any, record: Call, args: dict[str, Any], deadline: float,
        ms: int, m: Message, session: Session | None, note: Any,
    ) -> Any:  # fmt: skip
        ctx = PolicyContext(
            route="/mcp", channel="mcp", tenant=self._tenant(request), request_id=str(m.id)
        )
        if self.policies:
            try:
                redacted, changed = await run_sliced(
                    _redact_fields({"arguments": args}, self.policies, ctx)
                )
            except GatewayError as exc:  # a policy refuses what it cannot read
                record.status = "refused"
                raise RpcError(jsonrpc.INVALID_PARAMS, exc.message) from None
            args = redacted["arguments"]
            record.arguments = args
            record.redacted = changed
            record.policies = True
        record.args = jsonrpc.encode(args).decode()[:4096]
        params: dict[str, Any] = {"name": record.tool, "arguments": args}
        sized: list[int] = []
        # A client that goes away cancels its call, upstream too (the server calls).
        gone = server_call(request.scope)
        with trio.move_on_at(deadline) as scope:
            if session is not None and m.id is not None:
                self.hub.calls[session.sid, m.id] = scope
            if gone is not None:
                gone.set(scope.cancel)
            try:
                await _ready(up, record)
                result = await up.request("tools/call", params, note, sized)
            except UpstreamError as exc:
                record.status = (
                    "upstream_error" if exc.code != jsonrpc.UPSTREAM_FAILED else "failed"
                )
                record.error_code = str(exc.code)
                raise RpcError(exc.code, exc.message, exc.data) from None
            finally:
                if gone is not None:
                    gone.clear()
                if session is not None:
                    self.hub.calls.pop((session.sid, m.id), None)
        if scope.cancelled_caught:
            if trio.current_time() >= deadline:
                record.status = "timeout"
                raise RpcError(
                    jsonrpc.REQUEST_TIMEOUT,
                    f"MCP tool {record.server}{SEP}{record.tool} did not answer within its "
                    f"deadline of {ms} ms (cancelled upstream)",
                )
            record.status = "cancelled"
            raise RpcError(jsonrpc.REQUEST_TIMEOUT, "the call was cancelled by the client")
        big = bool(sized) and sized[0] > BIG_MESSAGE
        if not isinstance(result, dict):
            record.status = "failed"
            raise RpcError(
                jsonrpc.UPSTREAM_FAILED, "the upstream answered tools/call with no object"
            )
        cap = self.settings.max_result_bytes
        if big:  # decoded off the loop: redacted, encoded, cut -- and freed -- off it too
            owned = [result]
            del result  # the thread holds the last reference: the answer dies there
            result, changed, record.size = await trio.to_thread.run_sync(
                _finish_big, owned, self.policies, ctx, cap
            )
        else:
            changed = False
            if self.policies:
                result, changed = await run_sliced(_redact_result(result, self.policies, ctx))
            record.size = len(jsonrpc.encode(result))
            if record.size > cap:
                result = await run_sliced(_cut(result, cap, record.size))
        record.redacted = record.redacted or changed
        if result.get("isError") is True:
            record.status = "tool_error"
        return result

    def _tenant(self, request: Request) -> str:
        p = request.principal
        return p.tenant if p is not None else self.default_tenant

    def _done(self, request: Request, record: Call, started: float) -> None:
        elapsed = trio.current_time() - started
        metrics = self.hub.metrics
        tool = record.tool[:64] if record.known else "other"
        metrics.calls.labels(record.server, tool, record.status).inc()
        metrics.latency.labels(record.server).observe(elapsed)
        p = request.principal
        self.hub.recent.append(
            {
                "ts": round(time.time() - elapsed, 3),
                "key_id": p.key_id if p is not None else None,
                "tenant": self._tenant(request),
                "server": record.server,
                "tool": record.tool[:200],
                "status": record.status,
                "ms": round(elapsed * 1000, 3),
                "bytes": record.size,
            }
        )
        span = record.span
        if span is not None:
            p = request.principal
            span.set_attributes(
                {
                    "mcp.server": record.server,
                    "mcp.tool": tool,
                    "mcp.status": record.status,
                    "mcp.result_bytes": record.size,
                    "aiserve.tenant": self._tenant(request),
                    "aiserve.key_id": p.key_id if p is not None else "",
                }
            )
            span.end()
        audit = self.hub.audit
        if audit is not None:
            writer = audit.builder.redactor is not None
            audit.offer_row(audit_row(request, record, elapsed, self._tenant(request), writer))

    async def admin(self, request: Request) -> None:
        """``GET /admin/mcp``: each server's state and tools, and the recent tool calls
        (an admin of one tenant sees its tenant's calls only)."""
        health = self.hub.health()  # with each tenant's own upstream session
        servers = {
            name: {
                **health.get(name, {}),
                **up.health(),
                "tool_names": [t["name"] for t in up.tools],
            }
            for name, up in sorted(self.hub.upstreams.items())
        }
        p = request.principal
        only = p.admin_tenant if p is not None else None
        calls = [c for c in self.hub.recent if only is None or c["tenant"] == only]
        body = jsonrpc.encode({"servers": servers, "calls": calls[::-1]})
        await request.responder.complete(200, _JSON, body)

    async def _stream_call(self, request: Request, m: Message, session: Session | None) -> None:
        """A ``tools/call`` answered as SSE: the upstream's progress, then the result."""
        token = m.params["_meta"]["progressToken"]
        send, receive = trio.open_memory_channel[dict[str, Any]](64)
        responder = request.responder
        headers = list(_SSE)

        def note(msg: dict[str, Any]) -> None:
            params = dict(msg.get("params") or {})
            params["progressToken"] = token
            # A client that does not read its progress loses some.
            with contextlib.suppress(trio.WouldBlock):
                send.send_nowait(
                    {"jsonrpc": "2.0", "method": "notifications/progress", "params": params}
                )

        async def relay() -> None:
            async for msg in receive:
                await responder.body(b"event: message\ndata: " + jsonrpc.encode(msg) + b"\n\n")

        await responder.start(200, headers)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(relay)
            answer = await self._one_call(request, m, session, note)
            send.close()
        await responder.body(
            b"event: message\ndata: " + jsonrpc.encode(answer) + b"\n\n", more=False
        )

    async def _one_call(
        self, request: Request, m: Message, session: Session | None, note: Any
    ) -> dict[str, Any]:
        try:
            value = await self.call(request, m, session, note)
        except RpcError as err:
            return jsonrpc.error(err, m.id)
        if _modern(m) is not None:
            value = {**value, "resultType": value.get("resultType", "complete")}
        return jsonrpc.result(m.id, value)


_LISTS = {
    "prompts/list": "prompts",
    "resources/list": "resources",
    "resources/templates/list": "resourceTemplates",
}
_CACHEABLE = frozenset(
    {"tools/list", "prompts/list", "resources/list", "resources/templates/list", "resources/read"}
)
_ATTR = {"prompts": "prompts", "resources": "resources", "resourceTemplates": "templates"}


def _key_id(request: Request) -> str | None:
    return request.principal.key_id if request.principal is not None else None


def _modern(m: Message) -> str | None:
    meta = m.params.get("_meta")
    if isinstance(meta, dict):
        v = meta.get(VERSION_META)
        if isinstance(v, str):
            if v not in MODERN_VERSIONS:
                raise HttpStatus(
                    400,
                    RpcError(
                        -32022,
                        f"unsupported protocol version {v[:40]!r}",
                        {"supported": list(VERSIONS)},
                        id=m.id,
                    ),
                )
            return v
    return None


def _plain(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` without the client's per-request envelope (the upstream has its own)."""
    meta = params.get("_meta")
    if not isinstance(meta, dict):
        return params
    rest = {k: v for k, v in meta.items() if not k.startswith("io.modelcontextprotocol/")}
    out = {k: v for k, v in params.items() if k != "_meta"}
    if rest:
        out["_meta"] = rest
    return out


def _prefixed(server: str, item: dict[str, Any], key: str) -> dict[str, Any]:
    if key == "prompts":
        return {**item, "name": f"{server}{SEP}{item['name']}"}
    return item  # a resource's URI is the upstream's: unchanged


def _page(items: list[dict[str, Any]], params: dict[str, Any], key: str) -> dict[str, Any]:
    """One page of ``items`` from the client's ``cursor`` (-32602 for a bad one)."""
    cursor = params.get("cursor")
    start = 0
    if cursor is not None:
        try:
            assert isinstance(cursor, str)
            assert len(cursor) < 32
            start = int(base64.urlsafe_b64decode(cursor.encode()).decode().removeprefix("o:"))
            assert 0 <= start <= len(items)
        except (AssertionError, ValueError, UnicodeDecodeError):
            raise RpcError(jsonrpc.INVALID_PARAMS, "invalid params: unknown cursor") from None
    out: dict[str, Any] = {key: items[start : start + PAGE]}
    if start + PAGE < len(items):
        out["nextCursor"] = base64.urlsafe_b64encode(f"o:{start + PAGE}".encode()).decode()
    return out


async def _ready(up: Any, record: Call) -> None:
    if up.state == "ready":
        return
    if up.state in ("down", "stopped"):
        record.status = "unavailable"
        why = f": {up.error}" if up.error else ""
        raise UpstreamError(jsonrpc.UPSTREAM_FAILED, f"MCP server {up.name!r} is {up.state}{why}")
    await up.wait_ready()  # starting: within the call's deadline


def _redact_fields(
    fields: dict[str, Any], policies: list[Policy], ctx: PolicyContext
) -> Steps[tuple[dict[str, Any], bool]]:
    """``fields`` (JSON values by name) through each policy's redaction, in slices.

    A policy that rewrites a request's fields (``gdpr-redact``: every string, key, number
    and URL, a JSON text inside a string, a long text in slices) does so here; one that
    only redacts text (:meth:`Policy.redact_text`) gets each string.
    """
    meter = Meter()
    changed = False
    raw = {k: msgspec.Raw(jsonrpc.encode(v)) for k, v in fields.items()}
    if meter.charge(sum(len(r) for r in raw.values()) // 400 + ITEM_UNITS):
        yield
    plain: dict[str, Any] | None = None
    for p in policies:
        if type(p).fields_steps is not Policy.fields_steps:
            if plain is not None:
                raw = {k: msgspec.Raw(jsonrpc.encode(v)) for k, v in plain.items()}
                plain = None
            new = yield from p.fields_steps(raw, ctx)
            changed = changed or any(bytes(new[k]) != bytes(raw[k]) for k in raw)
            raw = new
        else:
            if plain is None:
                plain = {k: jsonrpc.decode(bytes(r)) for k, r in raw.items()}
            plain, c = yield from _redact_tree(plain, [p], ctx, meter)
            changed = changed or c
    if plain is None:
        plain = {}
        for k, r in raw.items():
            plain[k] = jsonrpc.decode(bytes(r))
            if meter.charge(len(r) // 400 + ITEM_UNITS):
                yield
    return plain, changed


def _redact_tree(
    value: Any, policies: list[Policy], ctx: PolicyContext, meter: Meter | None = None
) -> Steps[tuple[Any, bool]]:
    """``value`` (JSON) with every string put through the policies' ``redact_text``."""
    meter = meter if meter is not None else Meter()
    changed = False

    def walk(v: Any) -> Generator[None, None, Any]:
        nonlocal changed
        if isinstance(v, str):
            out = v
            for p in policies:
                out = p.redact_text(out, ctx)
            if meter.charge(ITEM_UNITS + len(v)):
                yield
            changed = changed or out != v
            return out
        if isinstance(v, dict):
            d = {}
            for k, item in v.items():
                d[k] = yield from walk(item)
            return d
        if isinstance(v, list):
            lst = []
            for item in v:
                lst.append((yield from walk(item)))
            return lst
        if meter.charge():
            yield
        return v

    result = yield from walk(value)
    return result, changed


def _redact_result(
    result: dict[str, Any], policies: list[Policy], ctx: PolicyContext
) -> Steps[tuple[dict[str, Any], bool]]:
    """A ``CallToolResult`` with its text content and structured content redacted (an
    image's or audio's data is not text: left as it is)."""
    out = dict(result)
    content = result.get("content")
    texts: dict[str, Any] = {}
    if isinstance(content, list):
        for i, item in enumerate(content):
            is_text = isinstance(item, dict) and item.get("type") == "text"
            if is_text and isinstance(item.get("text"), str):
                texts[f"text{i}"] = item["text"]
    if "structuredContent" in result:
        texts["structuredContent"] = result["structuredContent"]
    if not texts:
        return out, False
    new, changed = yield from _redact_fields(texts, policies, ctx)
    if isinstance(content, list):
        out["content"] = [
            {**item, "text": new[f"text{i}"]} if f"text{i}" in new else item
            for i, item in enumerate(content)
        ]
    if "structuredContent" in new:
        out["structuredContent"] = new["structuredContent"]
    return out, changed


def _finish_big(
    owned: list[dict[str, Any]], policies: list[Policy], ctx: PolicyContext, cap: int
) -> tuple[dict[str, Any], bool, int]:
    """A big answer (``owned``'s one item, taken out) redacted, measured and cut, on a
    worker thread: its walk, its encoding and the freeing of its tens of thousands of
    objects would each hold the event loop for milliseconds. The answer as sent, whether
    a policy changed it, and its size before the cut."""
    result = owned.pop()
    changed = False
    if policies:
        result, changed = finish(_redact_result(result, policies, ctx))
    size = len(jsonrpc.encode(result))
    if size > cap:
        result = finish(_cut(result, cap, size))
    return result, changed, size


def _cut(result: dict[str, Any], cap: int, size: int) -> Steps[dict[str, Any]]:
    """``result`` cut to about ``cap`` bytes: text kept from the start, a marker at the end,
    other content and structured content dropped once the cap is reached."""
    left = cap
    new: list[dict[str, Any]] = []
    content = result.get("content")
    for item in content if isinstance(content, list) else []:
        yield
        if not isinstance(item, dict):
            continue
        if item.get("type") == "text" and isinstance(item.get("text"), str):
            text: str = item["text"]
            raw = text.encode()
            if len(raw) > left:
                text = raw[: max(left, 0)].decode("utf-8", "ignore")
            left -= len(text.encode())
            new.append({**item, "text": text})
        else:
            n = len(jsonrpc.encode(item))
            if n <= left:
                new.append(item)
                left -= n
        if left <= 0:
            break
    new.append({"type": "text", "text": _CUT_MARKER.format(cap=cap, size=size)})
    out = {k: v for k, v in result.items() if k not in ("content", "structuredContent")}
    out["content"] = new
    return out


async def mcp_healthz(hub: McpHub, request: Request) -> None:
    """``/healthz`` with each MCP server's state (``ready``, ``starting``, ``down``)."""
    body = jsonrpc.encode({"status": "ok", "mcp": hub.health()})
    await request.responder.complete(200, _JSON, body)


def rpc_error(err: GatewayError) -> tuple[int, bytes]:
    """How ``/mcp`` says what the gate refused (401, 403, 429, 503): JSON-RPC's envelope,
    the gateway's error code in ``data``."""
    code = {401: -32001, 403: jsonrpc.NOT_GRANTED, 429: jsonrpc.RATE_LIMITED}.get(err.status)
    refusal = RpcError(
        code if code is not None else jsonrpc.INTERNAL_ERROR,
        err.message,
        {"status": err.status, "type": err.type, "code": err.code},
    )
    return err.status, jsonrpc.encode(jsonrpc.error(refusal))


def audit_row(
    request: Request, record: Call, elapsed: float, tenant: str, writer_redacts: bool
) -> tuple[Any, ...]:
    """The ``audit_requests`` row of one tool call (api ``mcp``; the model column names the
    tool, the deployment its server; ``prompt`` the arguments as the upstream got them:
    redacted by ``[mcp] policies``, or, when none redact, by the audit writer's default
    detectors (``[audit] content = "redacted"``) -- else not stored; ``reply_chars`` the
    result's size in bytes)."""
    p = request.principal
    args_cell: Any = None
    if record.redacted or record.policies:
        args_cell = record.args
    elif writer_redacts:
        args_cell = Unredacted(record.args, False)
    status = "ok" if record.status == "ok" else "error"
    ms = int(elapsed * 1_000_000 + 0.5) / 1000
    cells: dict[str, Any] = {
        "request_id": f"mcp-{secrets.token_hex(8)}",
        "ts": time.time() - elapsed,
        "tenant": tenant,
        "key_id": p.key_id if p is not None else None,
        "route": "/mcp",
        "api": "mcp",
        "channel": "mcp",
        "model": f"{record.server}/{record.tool}"[:200],
        "served_model": record.tool[:200],
        "deployment": record.server,
        "status": status,
        "error_code": None
        if record.status == "ok"
        else f"{record.status}:{record.error_code or ''}",
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "cost": 0.0,
        "saved": 0.0,
        "total_ms": ms,
        "policy_actions": "mcp:redacted" if record.redacted else None,
        "prompt": args_cell,
        "reply_chars": record.size,
        "requests": 1,
        "cache_read_tokens": 0,
        "cache_write_tokens": 0,
        "cache_cost": 0.0,
    }
    return tuple(cells.get(c) for c in COLUMNS)
