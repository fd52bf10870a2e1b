"""The worker's upstream MCP servers: started with the gateway, kept across reloads.

:class:`McpHub` is long-lived (one per worker, like the audit log): a runtime's
``/mcp`` endpoint asks it for the upstreams by name. :meth:`McpHub.configure`
(each runtime's build) states which servers the config names; :meth:`McpHub.run`
(a background task of the gateway) starts each one's task, stops those a reload
removed and restarts those whose table changed. It owns the MCP metrics.
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client import CollectorRegistry, Counter, Histogram

from .sessions import Ended
from .settings import McpConfig, McpServerConfig
from .upstream import Upstream, build_upstream

if TYPE_CHECKING:
    from ..audit.log import AuditLog
    from ..observability.tracing import Tracing

log = logging.getLogger("aiserve_trio.mcp")

#: Tool calls ``GET /admin/mcp`` shows.
RECENT = 200
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class McpMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.calls = Counter(
            "aiserve_mcp_calls_total",
            "MCP tools/call requests through /mcp, by upstream server, tool and status",
            ["server", "tool", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "aiserve_mcp_call_seconds",
            "Time of an MCP tools/call through /mcp (the gateway's and the upstream's)",
            ["server"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )


class _Running:
    __slots__ = ("config", "scope", "upstream")

    def __init__(self, upstream: Upstream, scope: trio.CancelScope) -> None:
        self.upstream = upstream
        self.config: McpServerConfig = upstream.config
        self.scope = scope


class McpHub:
    """The upstream servers of the current config, and what they report."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        audit: AuditLog | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.metrics = McpMetrics(registry)
        self.audit = audit
        #: A span per tool call, when tracing records.
        self.tracing = tracing
        #: By (server, tenant): None is the server's own credential, a tenant its own.
        self._wanted: dict[tuple[str, str | None], McpServerConfig] = {}
        self._running: dict[tuple[str, str | None], _Running] = {}
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        #: The last tool calls (``GET /admin/mcp``), newest last.
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT)
        #: ``/mcp``'s client sessions, worker-wide (a reload keeps them).
        #: ``/mcp``'s sessions ended by DELETE here, and the calls running here by
        #: (session, request id) for ``notifications/cancelled``; a reload keeps both.
        self.ended = Ended(McpConfig().max_sessions)
        self.calls: dict[tuple[str, Any], trio.CancelScope] = {}

    def configure(self, config: McpConfig) -> None:
        """The servers ``config`` names are the ones to run (applied by :meth:`run`)."""
        wanted: dict[tuple[str, str | None], McpServerConfig] = {}
        for name, cfg in config.servers.items():
            wanted[name, None] = cfg
            for tenant in cfg.tenants:
                wanted[name, tenant] = cfg.for_tenant(tenant)
        self._wanted = wanted
        self._changed.set()
        if self._nursery is not None:
            self._apply(self._nursery)

    def get(self, name: str, tenant: str | None = None) -> Upstream | None:
        """``name``'s upstream as ``tenant`` reaches it (its own credential, if it has one)."""
        r = self._running.get((name, tenant)) if tenant is not None else None
        if r is None:
            r = self._running.get((name, None))
        return r.upstream if r is not None else None

    def of(self, tenant: str | None) -> dict[str, Upstream]:
        """Every server's upstream as ``tenant`` reaches it, by name."""
        out: dict[str, Upstream] = {}
        for name, _ in self._running:
            up = self.get(name, tenant)
            if up is not None:
                out[name] = up
        return dict(sorted(out.items()))

    @property
    def upstreams(self) -> dict[str, Upstream]:
        return self.of(None)

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for (name, tenant), r in sorted(
            self._running.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")
        ):
            if tenant is None:
                out[name] = r.upstream.health()
            else:
                out.setdefault(name, {}).setdefault("tenants", {})[tenant] = r.upstream.state
        return out

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the configured servers until cancelled (their children end with it)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                self._apply(nursery)
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._nursery = None
                for r in self._running.values():
                    r.upstream.state = "stopped"

    def _apply(self, nursery: trio.Nursery) -> None:
        wanted = self._wanted
        for key in list(self._running):
            r = self._running[key]
            if wanted.get(key) != r.config:
                log.info("mcp: server %s %s", key[0], "changed" if key in wanted else "removed")
                r.scope.cancel()
                r.upstream.state = "stopped"
                del self._running[key]
        for key, cfg in wanted.items():
            if key not in self._running:
                upstream = build_upstream(key[0], cfg)
                scope = trio.CancelScope()
                self._running[key] = _Running(upstream, scope)
                nursery.start_soon(_run_one, upstream, scope)

    async def wait_started(self) -> None:
        """Return once every server has left ``starting`` (tests, the bench)."""
        for r in list(self._running.values()):
            while r.upstream.state == "starting":
                await r.upstream._changed.wait()


async def _run_one(upstream: Upstream, scope: trio.CancelScope) -> None:
    with scope:
        await upstream.run()
