"""Building a :class:`~.runtime.Runtime` whole, from one config.

:class:`RuntimeBuilder` holds what the app keeps across configurations (the
session bus, write-back, the observer, the spend ledger, the admin and debug
handlers, the chat entry) and builds, in order: the gate, the routes with their policies and
chains, the session endpoints, the response cache, the pipeline, the
embeddings; those are a runtime's :class:`~.runtime.Parts`, which the endpoint
table's handlers are bound to; then the table, CORS, and the runtime, in one
constructor call. Nothing is opened here (``gateway.opened`` and a reload's
``stage`` open what is new).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from functools import partial
from typing import TYPE_CHECKING

import trio

from ..adapters import Adapter, route_adapter
from ..apis import CODECS, codec_of
from ..cache.service import Cache, build_cache, cache_plans
from ..chains.run import build_chain
from ..config import Config, build_policies
from ..core.slices import Steps
from ..endpoints.count_tokens import SUFFIX, CountTokens
from ..endpoints.embeddings import Embeddings
from ..http.cors import Cors
from ..http.endpoints import Admission, Auth, Endpoint, EndpointTable, Request
from ..mcp.endpoint import McpEndpoint, mcp_healthz, rpc_error
from ..policies.base import Policy, PolicyContext, redact_values
from ..routes import route_label
from ..security.gate import Gate
from ..security.keystore.http import KeyEndpoints, Routes
from ..sessions.http import EVERYTHING, ReadScope, SessionEndpoints
from ..spend.prices import build_pricing
from ..stages.pipeline import Pipeline
from ..stages.types import Route
from .generation import CacheHold, Held, Lifetime, Models, Parts, Runtime

if TYPE_CHECKING:
    from ..audit.usage import UsageEndpoints
    from ..console.handlers import Console
    from ..endpoints.admin import Admin
    from ..mcp.hub import McpHub
    from ..observability.debug import DebugEndpoints
    from ..observability.observer import RequestObserver
    from ..record.recorder import Recorder
    from ..security.keystore.service import KeyService
    from ..sessions.bus import SessionBus
    from ..sessions.outbox import WriteBack
    from ..spend.ledger import Ledger

#: A database keys' handler, bound to the runtime's gate.
GateHandler = Callable[[Gate, Request], Awaitable[None]]
#: A route's handler: the chat entry (or the embeddings'), bound to a runtime's parts.
RouteHandler = Callable[[Parts, Route, Request], Awaitable[None]]


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeBuilder:
    """What every runtime is built with: the app's long-lived parts."""

    bus: SessionBus
    writeback: WriteBack
    observer: RequestObserver
    #: Set when the app shuts down (ends live session event streams).
    closing: trio.Event
    admin: Admin
    debug: DebugEndpoints
    console: Console
    usage: UsageEndpoints
    #: The worker's spend ledger (every runtime's gate keeps the spend in it).
    ledger: Ledger
    chat: RouteHandler
    embed: RouteHandler
    #: The worker's database keys (issue 47); None: the config's keys only.
    keys: KeyService | None = None
    #: The upstream MCP servers (``[mcp]``), worker-wide; None: no ``/mcp``.
    mcp: McpHub | None = None
    #: ``[record]``'s recorder: ``/mcp`` offers it each tool call; None: not recording.
    recorder: Recorder | None = None

    def build(
        self, config: Config, adapters: dict[str, Adapter], previous: Runtime | None
    ) -> Runtime:
        """The runtime of ``config`` (nothing opened yet).

        Args:
            adapters: built for ``config`` (some may be ``previous``'s objects).
            previous: the runtime this one replaces; its gate's worker-wide state
                and, when ``[cache]`` is the same, its cache backend are carried over.
        """
        gate = (
            Gate(config, ledger=self.ledger, dbkeys=self.keys.table if self.keys else None)
            if previous is None
            else previous.gate.successor(config)
        )
        pricing = build_pricing(config)
        routes = {
            rc.path: Route(
                config=rc,
                label=route_label(rc),
                adapter=route_adapter(rc, route_label(rc), adapters),
                policies=build_policies(rc.policies, config),
                tenant=rc.tenant or config.server.default_tenant,
                chain=build_chain(rc, route_label(rc), adapters, config),
                pricing=pricing,
                codec=codec_of(rc.kind),
            )
            for rc in config.routes
        }
        life = Lifetime()
        sessions = SessionEndpoints(
            config,
            self.bus,
            (self.closing, life.closing),
            partial(_session_tenant, gate, config.server.default_tenant),
            _vars_redactor(config, routes),
            _session_scope(config, routes),
        )
        cache, hold = _cache_for(config, routes, adapters, previous, self.observer)
        parts = Parts(
            config=config,
            adapters=adapters,
            routes=routes,
            gate=gate,
            pipeline=Pipeline(
                config,
                self.bus,
                writeback=self.writeback,
                admission=gate.admission,
                hook=self.observer,
                cache=cache,
            ),
            embeddings=Embeddings(config, self.observer),
            sessions=sessions,
            cache=cache,
            cache_hold=hold,
            models=Models(routes),
            life=life,
        )
        table = self._endpoints(parts)
        admin = [("/debug/", Auth.ADMIN), ("/admin/", Auth.ADMIN)]
        methods = {m for ep in table for m in ep.methods}
        return Runtime(
            **{f.name: getattr(parts, f.name) for f in fields(Parts)},
            endpoints=EndpointTable(table, unknown=admin),
            cors=Cors(config.cors, methods) if config.cors is not None else None,
        )

    def _endpoints(self, parts: Parts) -> list[Endpoint]:
        """The endpoint table of a runtime: its handlers serve with ``parts``."""
        return [
            *self._route_endpoints(parts),
            *self._service_endpoints(parts),
            *_session_endpoints(parts),
            *self._operator_endpoints(parts),
            *self._key_endpoints(parts),
            *self._mcp_endpoints(parts),
        ]

    def _mcp_endpoints(self, parts: Parts) -> list[Endpoint]:
        """``/mcp``, the MCP gateway, when ``[mcp]`` names a server (mcp/endpoint.py)."""
        if self.mcp is None:
            return []
        self.mcp.configure(parts.config.mcp)
        if not parts.config.mcp.servers:
            return []
        mcp = McpEndpoint(parts.config, self.mcp, parts.gate, self.recorder)
        methods, req = ("POST", "DELETE"), Admission.REQUEST
        console = Auth.ADMIN_OR_CONSOLE_TOKEN  # the console's MCP section reads /admin/mcp
        return [
            Endpoint("/mcp", methods, Auth.KEY, req, mcp.handle, "mcp", rpc_error),
            Endpoint("/admin/mcp", ("GET",), console, req, mcp.admin, "admin_mcp"),
        ]

    def _key_endpoints(self, parts: Parts) -> list[Endpoint]:
        """``/admin/keys``, ``/admin/teams``, ``/admin/tenants`` and ``/admin/audit`` (issue
        47, security/keystore/http.py), when the audit database keeps keys; the gate
        checks each path's role (security/roles.py)."""
        if self.keys is None:
            return []
        h = KeyEndpoints(self.keys)
        r = Routes(h)
        gate, req = parts.gate, Admission.REQUEST

        def ep(path: str, methods: tuple[str, ...], handler: GateHandler, name: str) -> Endpoint:
            # The console's keys and audit pages call them with its token (issue 47, 1 and 5).
            auth = Auth.ADMIN_OR_CONSOLE_TOKEN
            return Endpoint(path, methods, auth, req, partial(handler, gate), name)

        return [
            ep("/admin/keys", ("GET", "POST"), r.keys, "admin_keys"),
            ep("/admin/keys/{id}", ("GET", "PATCH"), r.key, "admin_key"),
            ep("/admin/keys/{id}/rotate", ("POST",), h.rotate, "admin_key_rotate"),
            ep("/admin/keys/{id}/revoke", ("POST",), h.revoke, "admin_key_revoke"),
            ep("/admin/teams", ("GET",), h.teams, "admin_teams"),
            ep("/admin/teams/{team}", ("PUT",), h.put_team, "admin_team"),
            ep("/admin/tenants/{tenant}", ("PUT",), h.put_tenant, "admin_tenant"),
            ep("/admin/audit", ("GET",), h.audit, "admin_audit"),
        ]

    def _route_endpoints(self, parts: Parts) -> list[Endpoint]:
        """Each route's own endpoint (chat or embeddings), and Anthropic's token
        counting below each Messages route (count_tokens.py)."""
        req = Admission.REQUEST
        table = [
            Endpoint(
                r.config.path,
                ("POST",),
                Auth.CHAT,
                req,
                partial(self.embed if r.config.kind == "embeddings" else self.chat, parts, r),
                r.label,
                r.codec.error,
            )
            for r in parts.routes.values()
        ]
        table += [
            Endpoint(
                r.config.path + SUFFIX,
                ("POST",),
                Auth.CHAT,
                req,
                CountTokens(r, parts.config),
                "count_tokens",
                CODECS["messages"].error,
                route=r.config.path,  # the route's keys, rate limit and channels
            )
            for r in parts.routes.values()
            if r.config.kind == "messages"
        ]
        return table

    def _service_endpoints(self, parts: Parts) -> list[Endpoint]:
        """What a client or a probe asks of the gateway itself: models, health,
        readiness, metrics, the caller's own usage."""
        get, req, admin = ("GET",), Admission.REQUEST, self.admin
        return [
            Endpoint("/v1/models", get, Auth.KEY, req, partial(admin.models, parts), "models"),
            Endpoint("/healthz", get, Auth.OPEN, Admission.NONE, self._healthz, "healthz"),
            Endpoint(
                "/readyz", get, Auth.OPEN, Admission.NONE, partial(admin.readyz, parts), "readyz"
            ),
            Endpoint("/metrics", get, Auth.METRICS, Admission.NONE, admin.metrics_text, "metrics"),
            Endpoint("/v1/usage", get, Auth.KEY, req, self.usage.own, "usage"),
        ]

    async def _healthz(self, request: Request) -> None:
        if self.mcp is None or not self.mcp.upstreams:
            await self.admin.healthz(request)
        else:
            await mcp_healthz(self.mcp, request)  # each MCP server's state too

    def _operator_endpoints(self, parts: Parts) -> list[Endpoint]:
        """The admin's endpoints (loopback only when auth is off): this worker's
        profiles and run traces, the configuration and its reload, everyone's spend,
        the recent requests when kept, and the operator console."""
        get, req, admin, debug = ("GET",), Admission.REQUEST, self.admin, self.debug
        table = [
            Endpoint("/debug/profile", get, Auth.ADMIN, req, debug.profile, "debug_profile"),
            Endpoint("/debug/trace", get, Auth.ADMIN, req, debug.trace, "debug_trace"),
            Endpoint("/admin/config", get, Auth.ADMIN, req, admin.config, "admin_config"),
            Endpoint(
                "/admin/config/reload",
                ("POST",),
                Auth.ADMIN,
                req,
                partial(admin.config_reload, parts),
                "admin_config_reload",
            ),
            Endpoint(
                "/admin/usage",
                get,
                Auth.ADMIN,
                req,
                partial(admin.usage_admin, parts),
                "admin_usage",
            ),
        ]
        if parts.config.observability.debug_requests:
            table.append(
                Endpoint("/debug/requests/recent", get, Auth.ADMIN, req, admin.recent, "debug")
            )
        table += self.console.endpoints()  # /admin/: the operator console
        return table


def _session_endpoints(parts: Parts) -> list[Endpoint]:
    """A session's turns and variables, its live events and their stream tokens."""
    get, req, sessions = ("GET",), Admission.REQUEST, parts.sessions
    return [
        Endpoint("/v1/sessions/{id}", get, Auth.SESSION_READ, req, sessions.get, "session"),
        Endpoint(
            "/v1/sessions/{id}/vars", ("PUT",), Auth.SESSION_WRITE, req, sessions.put_vars, "vars"
        ),
        Endpoint(
            "/v1/sessions/{id}/events",
            get,
            Auth.KEY_OR_STREAM_TOKEN,
            Admission.STREAM,
            sessions.events,
            "session_events",
        ),
        Endpoint(
            "/v1/sessions/{id}/stream-token",
            ("POST",),
            Auth.SESSION_READ,
            req,
            parts.gate.stream_token,
            "stream_token",
        ),
    ]


def _cache_for(
    config: Config,
    routes: dict[str, Route],
    adapters: dict[str, Adapter],
    previous: Runtime | None,
    observer: RequestObserver,
) -> tuple[Cache | None, CacheHold]:
    """The routes' cache and who closes its backend: the previous runtime's when nothing
    of it changed, one on the previous backend when only route plans did, else a new one
    (or None)."""
    labels = {path: r.label for path, r in routes.items()}
    prev = previous.cache if previous is not None else None
    if prev is None or previous is None or previous.config.cache != config.cache:
        return build_cache(config, labels, observer, adapters), CacheHold()
    plans = cache_plans(config, labels, adapters)
    if not plans:
        return None, CacheHold()
    cache = prev if plans == prev.routes else prev.successor(plans)
    return cache, previous.cache_hold


def _redacts(policy: Policy) -> bool:
    return type(policy).redact_text is not Policy.redact_text


def _vars_redactor(
    config: Config, routes: dict[str, Route]
) -> Callable[[dict[str, str]], Steps[dict[str, str]]] | None:
    """What ``PUT /v1/sessions/{id}/vars`` applies: the data protection of every
    chat route, since every route reads the same sessions."""
    policies = [p for r in routes.values() for p in r.policies]
    if not any(_redacts(p) for p in policies):
        return None
    clear = frozenset(config.sessions.clear_vars)

    def redact(values: dict[str, str]) -> Steps[dict[str, str]]:
        ctx = PolicyContext(route="sessions", channel="api", tenant="", request_id="")
        return redact_values(values, policies, ctx, clear)

    return redact


#: A key's routes or channels that mean every one (``security.auth.WILDCARD``).
_ANY = "*"


def _session_scope(config: Config, routes: dict[str, Route]) -> Callable[[Request], ReadScope]:
    """What a key sees of its tenant's sessions (issue 51, item 5): turns of the channels
    it may use only; and, when every route it may call (one at least, none ``*``) redacts,
    the turns' texts and the variables through those routes' redacting policies, so that
    a turn another key stored raw on a route without them reaches it as its own routes
    would have let it through. Auth off, a key of every channel and route, or one of no
    channel or route (a tool's, with an explicit ``sessions`` grant): all, as stored."""
    clear = frozenset(config.sessions.clear_vars)
    protecting = {
        path: [p for p in r.policies if _redacts(p)]
        for path, r in routes.items()
        if any(_redacts(p) for p in r.policies)
    }

    def scope(request: Request) -> ReadScope:
        key = request.principal
        if key is None:
            return EVERYTHING
        # No channel at all: a tool's key, whose explicit `sessions` grant is the tenant's.
        every = _ANY in key.channels or not key.channels
        channels = None if every else key.channels
        redact = None
        if key.routes and _ANY not in key.routes and key.routes <= protecting.keys():
            policies = list({id(p): p for r in sorted(key.routes) for p in protecting[r]}.values())

            def redact(values: dict[str, str]) -> Steps[dict[str, str]]:
                # A context per call: the scope lasts as long as the runtime, and what
                # the policies record is one read's.
                ctx = PolicyContext(route="sessions", channel="api", tenant="", request_id="")
                return redact_values(values, policies, ctx, clear)

        return ReadScope(channels, redact)

    return scope


def _session_tenant(gate: Gate, default: str, request: Request) -> str:
    return gate.tenant(request.principal, default)


async def open_cache(rt: Runtime, nursery: trio.Nursery) -> None:
    """Open ``rt``'s cache backend if it is a new one, in a task of its own in ``nursery``
    (``runtime.Held``); its closer goes into the runtime's :class:`~.runtime.CacheHold`."""
    cache = rt.cache
    if cache is None or rt.cache_hold.closer is not None:
        return
    held = Held(partial(cache.aopen, nursery), cache.aclose)
    await held.start(nursery)
    rt.cache_hold.closer = held.aclose
