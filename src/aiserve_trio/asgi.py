"""The ASGI application: lifespan, the endpoint table, the per-request entry.

``App`` is what hypercorn serves. Every HTTP request resolves to an endpoint
of one table (``http/endpoints.py``), passes the gate (admission, then
authentication), and runs the endpoint's handler; chat requests get their
deadline here and run in the :class:`~.pipeline.Pipeline`. Every error a
client sees is the OpenAI error envelope with a correct status.

The app is a long-lived shell (metrics, observer, tracing, session bus,
write-back, recorder, background tasks) around the current
:class:`~.runtime.Runtime`, everything built from the config; a request takes
the current runtime once, when it arrives, and uses only that one.
"""

from __future__ import annotations

import logging
import re
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import trio
from opentelemetry.trace import TracerProvider

from . import fdlimit, gctune, hypercorn_seam
from .adapters import Adapter, build_adapters, route_adapter
from .adapters.group import GroupAdapter
from .api import Model, ModelList, encoder
from .apis import CODECS
from .audit.log import build_audit
from .audit.usage import UsageEndpoints
from .budgets import TIMEOUT_HEADER, effective_timeout_ms, plan
from .cache.service import Cache, build_cache, cache_plans
from .chains.run import build_chain
from .config import Config, ConfigError, build_policies, load_config, route_label
from .console.handlers import Console
from .embeddings import Embeddings
from .errors import (
    BadRequest,
    GatewayError,
    Overloaded,
    PayloadTooLarge,
    StageDeadlineExceeded,
    Unprocessable,
    UnsupportedMediaType,
)
from .http.body import read_body
from .http.cors import Cors
from .http.disconnect import server_call
from .http.endpoints import Admission, Auth, Endpoint, EndpointTable, Request
from .http.responder import Responder
from .http.sse import SHUTTING_DOWN, shutdown_event
from .http.types import JSON_HEADERS, METRICS_HEADERS, Receive, Scope, Send
from .observability.annotate import TASK_LABEL, TaskLabel
from .observability.baseline import BaselineMonitor
from .observability.debug import DebugEndpoints
from .observability.metrics import Metrics, status_label
from .observability.observer import RequestObserver
from .observability.sched import SchedulerLag
from .observability.tracing import Tracing, configure_otlp
from .pipeline import Pipeline
from .policies.base import Policy, PolicyContext, redact_values
from .record.recorder import build_recorder, recorded_routes
from .reload import Reloader, Staged
from .runtime import Closer, Generations, Held, Runtime, carry_adapters, close_all
from .security.auth import Principal
from .security.gate import Gate
from .sessions import build_bus
from .sessions.bus import SessionBus, check_session_id
from .sessions.http import SessionEndpoints
from .sessions.outbox import WriteBack
from .slices import Steps
from .spend.ledger import LedgerMetrics
from .spend.metrics import SpendMetrics
from .spend.prices import build_pricing, unpriced_models
from .stages.outcome import Outcome
from .stages.types import RequestInfo, Route
from .startup import hypercorn_process, refuse_to_start, unusable_tls_files

log = logging.getLogger("aiserve_trio")


class App:
    """The gateway as an ASGI 3 application."""

    def __init__(
        self,
        config: Config,
        *,
        adapters: dict[str, Adapter] | None = None,
        bus: SessionBus | None = None,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        """Build the app from a validated config.

        Args:
            config: from :func:`~.config.load_config`.
            adapters: adapters by name, replacing those the config would build
                (tests pass fakes here).
            bus: the session bus; default: the one ``[sessions]`` configures.
            tracer_provider: an OpenTelemetry provider for the spans; default:
                the global one, or OTLP export when ``[observability]`` names an endpoint.
        """
        self.metrics = Metrics()
        self._init_observability(config, tracer_provider)
        self.metrics.watch_deployments(self._deployment_states)
        self.bus: SessionBus = bus if bus is not None else build_bus(config, self.metrics)
        sc = config.sessions
        self.writeback = WriteBack(
            self.bus,
            self.metrics,
            outbox_max=sc.outbox_max,
            retry_ms=sc.outbox_retry_ms,
            retry_max_ms=sc.outbox_retry_max_ms,
        )
        #: Set when shutdown begins: live session event streams end cleanly.
        self.closing = trio.Event()
        self._background: trio.CancelScope | None = None
        #: The app's lifetime nursery and its background nursery (set by startup).
        self._nursery: trio.Nursery | None = None
        #: hypercorn's config, when hypercorn's lifespan started the app (its TOML's keys).
        self.server_config: object | None = None
        self._tasks: trio.Nursery | None = None
        # Profiles and run traces of this worker (one of each at a time, whatever
        # the config): auth on or off follows the current config.
        self.debug = DebugEndpoints()
        #: ``/admin/``: the operator console (one for the worker, whatever the config).
        self.console = Console.of(self)
        #: ``[audit]``: a row per finished request, through the observer.
        self.audit = build_audit(config, self.metrics.registry)
        if self.audit is not None:
            self.observer.sinks.append(self.audit)
        self.usage = UsageEndpoints(self.audit, config.pricing.currency)
        self.console.usage = self.usage
        built = build_adapters(config.adapters, self.observer, adapters)
        #: The current runtime and the retired ones still serving their requests.
        self.generations = Generations(self._build(config, built, None))
        #: ``[record]``: finished requests go to it through the observer.
        self.recorder = build_recorder(config, self.routes, self.metrics)
        self.observer.recorder = self.recorder
        #: ``aiserve_spend_total``, ``aiserve_spend_saved_total``.
        self.observer.sinks.append(SpendMetrics(self.metrics.registry, config.pricing.currency))
        self.gate.ledger.metrics = LedgerMetrics(self.metrics.registry)
        self.metrics.watch_cache(self._cache_held, self._cache_flights, self._cache_server)
        #: Reloads the config without a restart (``reload.py``).
        reloads = self.metrics.config_reloads
        self.reloader = Reloader(self, lambda result: reloads.labels(result).inc())
        self.console.reloader = self.reloader
        self.ready = False

    # --- the current runtime (what a new request uses) --------------------------

    @property
    def runtime(self) -> Runtime:
        return self.generations.current

    @property
    def config(self) -> Config:
        return self.runtime.config

    @property
    def adapters(self) -> dict[str, Adapter]:
        return self.runtime.adapters

    @property
    def routes(self) -> dict[str, Route]:
        return self.runtime.routes

    @property
    def gate(self) -> Gate:
        return self.runtime.gate

    @property
    def pipeline(self) -> Pipeline:
        return self.runtime.pipeline

    @property
    def cache(self) -> Cache | None:
        return self.runtime.cache

    @property
    def endpoints(self) -> EndpointTable:
        return self.runtime.endpoints

    def _build(
        self, config: Config, adapters: dict[str, Adapter], previous: Runtime | None
    ) -> Runtime:
        """The runtime of ``config`` (nothing opened yet).

        Args:
            adapters: built for ``config`` (some may be ``previous``'s objects).
            previous: the runtime this one replaces; its gate's worker-wide state
                and, when ``[cache]`` is the same, its cache backend are carried over.
        """
        rt = Runtime(config)
        rt.adapters = adapters
        rt.gate = Gate(config) if previous is None else previous.gate.successor(config)
        pricing = build_pricing(config)
        rt.routes = {
            rc.path: Route(
                config=rc,
                label=route_label(rc),
                adapter=route_adapter(rc, route_label(rc), adapters),
                policies=build_policies(rc.policies, config),
                tenant=rc.tenant or config.server.default_tenant,
                chain=build_chain(rc, route_label(rc), adapters, config),
                pricing=pricing,
            )
            for rc in config.routes
        }
        rt.sessions = SessionEndpoints(
            config,
            self.bus,
            (self.closing, rt.closing),
            partial(self._session_tenant, rt),
            self._vars_redactor(rt),
        )
        #: The routes' response caches (None when no route has one).
        rt.cache = self._cache_for(rt, previous)
        rt.pipeline = Pipeline(
            config,
            self.bus,
            writeback=self.writeback,
            admission=rt.gate.admission,
            hook=self.observer,
            cache=rt.cache,
        )
        rt.embeddings = Embeddings(config, self.observer)
        table = self._endpoints(rt)
        admin = [("/debug/", Auth.ADMIN), ("/admin/", Auth.ADMIN)]
        rt.endpoints = EndpointTable(table, unknown=admin)
        methods = {m for ep in table for m in ep.methods}
        rt.cors = Cors(config.cors, methods) if config.cors is not None else None
        rt.models_body = self._models_json(list(rt.routes.values()))
        return rt

    # --- reloading (reload.py calls these) ---------------------------------------

    async def stage(self, config: Config) -> Staged:
        """Build the runtime of ``config`` and open what it does not take over.

        Adapters whose settings did not change are the current ones (their pools
        carry on); the others are built and opened, and so is a cache backend whose
        ``[cache]`` changed. Nothing serves with it until ``commit()``.

        Raises:
            ConfigError: an adapter or the cache cannot be opened (naming the
                file and the key); whatever was opened is closed again.
        """
        nursery = self._nursery
        if nursery is None:
            raise ConfigError(f"{config.source}: the app has not started; nothing to reload")
        current = self.runtime
        fresh: list[Adapter] = []
        try:
            adapters, fresh = carry_adapters(
                config.adapters, current.adapters, current.config.adapters, self.observer
            )
            rt = self._build(config, adapters, current)
        except Exception as exc:
            await close_all(a.aclose for a in fresh)
            raise ConfigError(f"{config.source}: the configuration cannot be built: {exc}") from exc
        staged = _Staged(self, rt)
        key = "cache"
        try:
            for adapter in fresh:
                key = f"adapters.{adapter.name}"
                await adapter.aopen(nursery)
            key = "cache"
            await self._open_cache(rt)
        except Exception as exc:
            await staged.abandon()
            why = str(exc).removeprefix(f"{config.source}: ")
            raise ConfigError(f"{config.source}: key `{key}`: cannot open: {why}") from exc
        return staged

    def _commit(self, rt: Runtime) -> None:
        """Make ``rt`` the current runtime; the old one drains in the background."""
        rt.gate.activate()
        old = self.generations.swap(rt)
        if self.recorder is not None:
            self.recorder.routes = recorded_routes(rt.config, rt.routes)
        self.baseline.track([r.label for r in rt.routes.values()], trio.current_time())
        if rt.gate.enabled != old.gate.enabled or len(rt.gate.keys) != len(old.gate.keys):
            rt.gate.announce()
        assert self._tasks is not None
        self._tasks.start_soon(self.generations.drain, old)

    def draining(self) -> int:
        """Runtimes replaced by a reload that still finish requests."""
        return len(self.generations.live) - 1

    def _cache_for(self, rt: Runtime, previous: Runtime | None) -> Cache | None:
        """``rt``'s cache: the previous one when nothing of it changed, one on the
        previous backend when only route plans did, else a new one (or None)."""
        config = rt.config
        labels = {path: r.label for path, r in rt.routes.items()}
        prev = previous.cache if previous is not None else None
        if prev is None or previous is None or previous.config.cache != config.cache:
            return build_cache(config, labels, self.observer, rt.adapters)
        plans = cache_plans(config, labels, rt.adapters)
        if not plans:
            return None
        rt.cache_closer = previous.cache_closer
        return prev if plans == prev.routes else prev.successor(plans)

    def _endpoints(self, rt: Runtime) -> list[Endpoint]:
        """The endpoint table of ``rt``: its handlers serve with ``rt``."""
        get, req = ("GET",), Admission.REQUEST
        sessions = rt.sessions
        table = [
            Endpoint(
                r.config.path,
                ("POST",),
                Auth.CHAT,
                req,
                partial(self._embed if r.config.kind == "embeddings" else self._chat, rt, r),
                r.label,
                codec.error if (codec := CODECS.get(r.config.kind)) is not None else None,
            )
            for r in rt.routes.values()
        ]
        table += [
            Endpoint("/v1/models", get, Auth.KEY, req, partial(self._models, rt), "models"),
            Endpoint("/healthz", get, Auth.OPEN, Admission.NONE, self._healthz, "healthz"),
            Endpoint(
                "/readyz", get, Auth.OPEN, Admission.NONE, partial(self._readyz, rt), "readyz"
            ),
            Endpoint("/metrics", get, Auth.METRICS, Admission.NONE, self._metrics, "metrics"),
            Endpoint("/v1/sessions/{id}", get, Auth.SESSION_READ, req, sessions.get, "session"),
            Endpoint(
                "/v1/sessions/{id}/vars",
                ("PUT",),
                Auth.SESSION_WRITE,
                req,
                sessions.put_vars,
                "vars",
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
                rt.gate.stream_token,
                "stream_token",
            ),
        ]
        # Profiles and run traces of this worker (admin; loopback only when auth is off).
        debug = self.debug
        table += [
            Endpoint("/debug/profile", get, Auth.ADMIN, req, debug.profile, "debug_profile"),
            Endpoint("/debug/trace", get, Auth.ADMIN, req, debug.trace, "debug_trace"),
        ]
        # The configuration: what is active, and reloading it (admin; loopback only
        # when auth is off).
        table += [
            Endpoint(
                "/admin/config", get, Auth.ADMIN, req, partial(self._config, rt), "admin_config"
            ),
            Endpoint(
                "/admin/config/reload",
                ("POST",),
                Auth.ADMIN,
                req,
                partial(self._config_reload, rt),
                "admin_config_reload",
            ),
        ]
        # Spend read back from the audit log: everyone's (admin), the caller's own.
        table += [
            Endpoint(
                "/admin/usage", get, Auth.ADMIN, req, partial(self._usage, rt), "admin_usage"
            ),
            Endpoint("/v1/usage", get, Auth.KEY, req, self.usage.own, "usage"),
        ]
        if rt.config.observability.debug_requests:
            table.append(
                Endpoint("/debug/requests/recent", get, Auth.ADMIN, req, self._recent, "debug")
            )
        table += self.console.endpoints()  # /admin/: the operator console
        return table

    # --- ASGI ----------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        # hypercorn's lifespan hands its own receive: its config is the server's.
        self.server_config = getattr(getattr(receive, "__self__", None), "config", None)
        await receive()  # lifespan.startup
        _show_startup_logs()
        # The app's pools and background tasks live in this nursery: opened
        # before start-up, closed after shutdown.
        async with trio.open_nursery() as nursery:
            try:
                await self.startup(nursery)
            except Exception as exc:
                log.exception("start-up failed")
                await send({"type": "lifespan.startup.failed", "message": str(exc)})
                nursery.cancel_scope.cancel(reason="start-up failed")
                return
            try:
                await send({"type": "lifespan.startup.complete"})
                await receive()  # lifespan.shutdown
            finally:
                await self.shutdown()
                nursery.cancel_scope.cancel(reason="lifespan shutdown")
        await send({"type": "lifespan.shutdown.complete"})

    async def startup(self, nursery: trio.Nursery) -> None:
        """Guard the server, open the adapters' pools and the session bus, start background tasks.

        Args:
            nursery: lives as long as the app (until after :meth:`shutdown`):
                adapters' connection tasks and the app's background tasks run in it.
        """
        self._install_seam()
        self._nursery = nursery
        for adapter in self.adapters.values():
            await adapter.aopen(nursery)
        await self.bus.aopen()
        await self.gate.aopen()
        if self.recorder is not None:
            # Outside the background scope: shutdown lets it write what is queued.
            await nursery.start(self.recorder.run)
        if self.audit is not None:
            await nursery.start(self.audit.run)  # likewise
        await self._open_cache(self.runtime)
        await nursery.start(self._run_background)
        if hypercorn_process() is not None:
            said, enough = fdlimit.raise_soft(self.config.limits.max_inflight)
            log.log(logging.INFO if enough else logging.WARNING, "%s", said)
            log.info("garbage collector: %s", gctune.tune())
        self.ready = True
        if self.config.pricing.models and (unpriced := unpriced_models(self.config)):
            log.warning("no price in [pricing] (these cost 0): %s", ", ".join(unpriced))
        log.info(
            "aiserve-trio ready: config %s, routes %s",
            self.config.source,
            ", ".join(self.routes),
        )

    def _install_seam(self) -> None:
        """The hypercorn seam (``hypercorn_seam.py``); a hypercorn it does not know refuses
        the start, as a bad config does (unless hypercorn's TOML allows it), and so do TLS
        files hypercorn could not load."""
        role = hypercorn_process()
        if role is not None and (why := unusable_tls_files(self.server_config)) is not None:
            refuse_to_start(why, role)
        try:
            log.info("hypercorn seam: %s", hypercorn_seam.install(self.server_config))
        except hypercorn_seam.SeamRefused as exc:
            if role is None:
                raise
            refuse_to_start(str(exc), role)

    async def _open_cache(self, rt: Runtime) -> None:
        """Open ``rt``'s cache backend if it is a new one (in a task of its own: see ``Held``)."""
        cache = rt.cache
        if cache is None or rt.cache_closer is not None:
            return
        assert self._nursery is not None
        nursery = self._nursery
        held = Held(partial(cache.aopen, nursery), cache.aclose)
        await held.start(nursery)
        rt.cache_closer = held.aclose

    def _init_observability(self, config: Config, provider: TracerProvider | None) -> None:
        ob = config.observability
        if provider is None and ob.otlp_endpoint:
            provider = configure_otlp(ob.otlp_endpoint, ob.service_name)
        self.tracing = Tracing(provider, enabled=ob.tracing)
        self.baseline = BaselineMonitor(
            [route_label(rc) for rc in config.routes],
            0.0,
            window_s=ob.baseline_window_s,
            history=ob.baseline_history,
            anomaly_factor=ob.anomaly_factor,
            min_requests=ob.baseline_min_requests,
        )
        keep = ob.debug_keep  # the console's slow requests; /debug/requests/recent if asked
        self.observer = RequestObserver(self.metrics, self.baseline, keep_recent=keep)
        self.sched_lag = SchedulerLag(ob.lag_interval_ms / 1000.0) if ob.scheduler_lag else None
        if self.sched_lag is not None:
            self.metrics.registry.register(self.sched_lag)

    def _cache_held(self) -> tuple[int, int]:
        cache = self.cache
        return cache.held() if cache is not None else (0, 0)

    def _cache_flights(self) -> int:
        cache = self.cache
        return len(cache.flights) if cache is not None else 0

    def _cache_server(self) -> dict[str, float]:
        cache = self.cache
        return cache.server if cache is not None else {}

    def _deployment_states(self) -> Iterator[tuple[str, str, int]]:
        """(group, deployment, state) of every group of the current config, at scrape time."""
        now = trio.current_time()
        for adapter in self.generations.current.adapters.values():
            if isinstance(adapter, GroupAdapter):
                for deployment, state in adapter.states(now):
                    yield adapter.name, deployment, state

    async def _baseline_loop(self) -> None:
        """Close a baseline window every ``baseline_window_s`` and publish it."""
        self.baseline.restart(trio.current_time())
        while True:
            await trio.sleep_until(self.baseline.next_roll)
            for route, assessment in self.baseline.roll(trio.current_time()).items():
                self.metrics.publish_baseline(route, assessment)

    async def _run_background(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        # One scope for every background task, so that shutdown() ends them all.
        with trio.CancelScope() as scope:
            self._background = scope
            async with trio.open_nursery() as tasks:
                self._tasks = tasks
                tasks.start_soon(self._baseline_loop)
                tasks.start_soon(self.reloader.watch)
                tasks.start_soon(self.gate.ledger.run)  # spend kept in an outage, merged back
                tasks.start_soon(self.console.sample)
                if self.sched_lag is not None:
                    tasks.start_soon(self.sched_lag.run)
                await self.writeback.run(task_status=task_status)

    async def shutdown(self) -> None:
        """End live event streams and background tasks; close the bus and adapters."""
        self.ready = False
        self.closing.set()
        if self._background is not None:
            self._background.cancel(reason="app shutdown")
        with trio.CancelScope(shield=True):
            with trio.move_on_after(2.0):
                await self.writeback.flush()
            if self.recorder is not None:
                await self.recorder.aclose()
            if self.audit is not None:
                await self.audit.aclose()
            # Every runtime still alive (a retired one may be finishing requests).
            held: dict[int, Closer] = {}
            for rt in self.generations.live:
                held.update(rt.resources())
            await close_all(held.values())
        # Not under the shield: the gate's Redis limiter and the bus exit task groups
        # that startup() entered at this level, and Trio needs cancel scopes closed in
        # the reverse order they opened (a Redis cache lives in a task of its own).
        await self.gate.aclose()
        await self.bus.aclose()

    # --- HTTP ----------------------------------------------------------------

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrival = trio.current_time()  # the deadline counts from here, auth included
        # The runtime this request uses from start to end, whatever a reload does meanwhile.
        rt = self.generations.current
        rt.enter()
        try:
            await self._serve(rt, arrival, scope, receive, send)
        finally:
            rt.leave()

    async def _serve(
        self, rt: Runtime, arrival: float, scope: Scope, receive: Receive, send: Send
    ) -> None:
        path: str = scope["path"]
        endpoint, params = rt.endpoints.resolve(scope["method"], path)
        # For /debug/trace and /debug/profile: what this task serves (its own context copy).
        TASK_LABEL.set(TaskLabel(None, endpoint.name))
        # Chat streams are watched by the sse stage's keep-alive task instead
        # of a cancel scope around every write.
        chat = endpoint.auth is Auth.CHAT
        write_timeout = None if chat else rt.config.limits.write_timeout_ms / 1000.0
        hdrs = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        cors = rt.cors
        extra = cors.response_headers(hdrs.get("origin")) if cors is not None else None
        responder = Responder(send, write_timeout, extra, endpoint.errors)
        principal: Principal | None = None
        handled = False
        if cors is not None and cors.is_preflight(scope["method"], hdrs):
            # Before the gate: a browser sends no key with a preflight.
            try:
                await responder.start(204, cors.preflight(hdrs))
                await responder.body(b"", more=False)
            except GatewayError as err:
                await responder.error(err)
            return
        try:
            request = Request(
                scope, scope["method"], path, hdrs, receive, responder, arrival, params
            )
            # The key first: a request without a valid one takes no slot.
            request.principal = principal = p = await rt.gate.authenticate(endpoint, request)
            if chat:  # a spent budget takes no slot either
                await rt.gate.within_budget(p, self._tenant_of(rt, path, p))
            # A fast 503 (429) before any body is read.
            with rt.gate.admit(endpoint, scope, hdrs), rt.gate.stream_slot(endpoint, p):
                handled = True  # from here the handler reports how the request ended
                await endpoint.handler(request)
        except GatewayError as err:
            if not responder.started:
                await responder.error(err)
            if chat and not handled:
                self._refused(rt, endpoint, principal, hdrs, err, arrival)
        except BaseException:
            # Cancelled by hypercorn after its graceful_timeout: end an open stream
            # with a final event instead of tearing the connection.
            if responder.started and not responder.finished:
                with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                    route = rt.routes.get(path)
                    codec = CODECS.get(route.config.kind) if route is not None else None
                    if codec is not None:  # the API's own failure event
                        last = codec.framer("", "", 0, None).fail(SHUTTING_DOWN)
                    else:
                        last = shutdown_event(session_stream=endpoint.admission is Admission.STREAM)
                    await responder.body(last, more=False)
            raise

    @staticmethod
    def _tenant_of(rt: Runtime, path: str, principal: Principal | None) -> str:
        """The tenant a request to ``path`` acts for: the key's, else its route's."""
        route = rt.routes.get(path)
        fallback = route.tenant if route is not None else rt.config.server.default_tenant
        return rt.gate.tenant(principal, fallback)

    def _refused(
        self,
        rt: Runtime,
        endpoint: Endpoint,
        principal: Principal | None,
        headers: dict[str, str],
        err: GatewayError,
        arrival: float,
    ) -> None:
        """A chat request the gate refused (key, rate, budget): the audit log's row."""
        now = trio.current_time()
        self.observer.request_refused(
            Outcome(
                request_id=f"refused-{secrets.token_hex(12)}",
                route=endpoint.name,
                channel=headers.get("x-channel", "none")[:16].strip().lower() or "none",
                arrival=arrival,
                ended=now,
                status=status_label(err.status),
                error=err,
                error_stage="gate",
                tenant=self._tenant_of(rt, endpoint.path, principal),
                key_id=principal.key_id if principal is not None else None,
            )
        )

    async def _healthz(self, request: Request) -> None:
        await request.responder.complete(200, JSON_HEADERS, b'{"status":"ok"}')

    async def _models(self, rt: Runtime, request: Request) -> None:
        """Every model of every route the caller may use."""
        p = request.principal
        body = rt.models_body
        if p is not None and "*" not in p.routes:
            cached = rt.models_by_key.get(p.routes)
            if cached is None:
                mine = [r for path, r in rt.routes.items() if path in p.routes]
                cached = rt.models_by_key[p.routes] = self._models_json(mine)
            body = cached
        await request.responder.complete(200, JSON_HEADERS, body)

    async def _metrics(self, request: Request) -> None:
        await request.responder.complete(200, METRICS_HEADERS, self.metrics.render())

    async def _recent(self, request: Request) -> None:
        body = encoder.encode(self.observer.slowest())
        await request.responder.complete(200, JSON_HEADERS, body)

    @staticmethod
    def _admin_client(rt: Runtime, request: Request) -> str:
        """Who calls an admin endpoint (``<key id>``, or ``loopback`` with auth off)."""
        if request.principal is not None:
            return request.principal.key_id
        # The gate has refused clients off loopback (auth off) and keys that are not admin.
        return "admin" if rt.gate.enabled else "loopback"

    async def _config(self, rt: Runtime, request: Request) -> None:
        """``GET /admin/config``: the active version and the last refused reload."""
        body = encoder.encode(self.reloader.status())
        await request.responder.complete(200, JSON_HEADERS, body)

    async def _config_reload(self, rt: Runtime, request: Request) -> None:
        """``POST /admin/config/reload``: load the config file again, or, with a TOML
        body (``Content-Type: application/toml``), save that as the file and load it.

        Raises:
            Unprocessable: the config was refused (``code`` ``config_refused``,
                ``param`` the key); the running configuration stays.
        """
        by = "api:" + self._admin_client(rt, request)
        candidate = await _toml_body(rt, request)
        result = await self.reloader.reload(by=by, candidate=candidate)
        version = [(b"x-aiserve-config-version", result.version.encode())]
        if result.error is not None:
            key = re.search(r"key `([^`]+)`", result.error)
            raise Unprocessable(
                result.error,
                param=key[1] if key else None,
                code="config_refused",
                headers={"X-Aiserve-Config-Version": result.version},
            )
        body = encoder.encode(
            {
                "applied": result.applied,
                "unchanged": result.unchanged,
                "version": result.version,
                "error": None,
            }
        )
        await request.responder.complete(200, [*JSON_HEADERS, *version], body)

    async def _usage(self, rt: Runtime, request: Request) -> None:
        """``GET /admin/usage`` (audit/usage.py)."""
        self._admin_client(rt, request)
        await self.usage.admin(request)

    async def _readyz(self, rt: Runtime, request: Request) -> None:
        problems: list[str] = []
        if not self.ready:
            problems.append("not started")
        for name, adapter in rt.adapters.items():
            if not await adapter.ready():
                problems.append(f"adapter {name} not ready")
        reachable = False
        with trio.move_on_after(1.0):  # a hung Redis must not hang the probe
            reachable = await self.bus.ping()
        if not reachable:
            problems.append(f"session bus ({self.bus.kind}) unreachable")
        if problems:
            raise Overloaded("not ready: " + "; ".join(problems), code="not_ready")
        await request.responder.complete(200, JSON_HEADERS, b'{"status":"ready"}')

    @staticmethod
    def _vars_redactor(rt: Runtime) -> Callable[[dict[str, str]], Steps[dict[str, str]]] | None:
        """What ``PUT /v1/sessions/{id}/vars`` applies: the data protection of every
        chat route, since every route reads the same sessions."""
        policies = [p for r in rt.routes.values() for p in r.policies]
        if not any(type(p).redact_text is not Policy.redact_text for p in policies):
            return None
        clear = frozenset(rt.config.sessions.clear_vars)

        def redact(values: dict[str, str]) -> Steps[dict[str, str]]:
            ctx = PolicyContext(route="sessions", channel="api", tenant="", request_id="")
            return redact_values(values, policies, ctx, clear)

        return redact

    @staticmethod
    def _session_tenant(rt: Runtime, request: Request) -> str:
        return rt.gate.tenant(request.principal, rt.config.server.default_tenant)

    async def _chat(self, rt: Runtime, route: Route, request: Request) -> None:
        cfg = rt.config
        d = cfg.deadline
        rd = route.config.deadline
        headers = request.headers
        request_id = _ID_PREFIX.get(route.config.kind, "chatcmpl-") + secrets.token_hex(12)
        try:
            timeout_ms = effective_timeout_ms(
                headers.get(TIMEOUT_HEADER),
                default_ms=rd.default_ms or d.default_ms,
                max_ms=rd.max_ms or d.max_ms,
                reserve_ms=d.reserve_ms,
            )
            channel = self._channel(cfg, headers.get("x-channel"))
            sid = headers.get("x-session-id")
            session_id = check_session_id(sid) if sid is not None else None
            if session_id is None and route.config.kind == "responses":
                # A response's turns are stored under its id, for `previous_response_id`.
                session_id = request_id
            declared = headers.get("content-length")
            limit = cfg.limits.max_body_bytes
            if declared is not None and declared.isdigit() and int(declared) > limit:
                # Shed before reading a byte of a body that cannot be accepted.
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        except GatewayError as err:
            await request.responder.error(err, [(b"x-request-id", request_id.encode())])
            now = trio.current_time()
            refused = Outcome(
                request_id=request_id,
                route=route.label,
                channel="none",
                arrival=request.arrival,
                ended=now,
                status=status_label(err.status),
                error=err,
                error_stage="parse",
            )
            self.observer.request_complete(refused)
            return
        budget = plan(
            request.arrival,
            timeout_ms,
            reserve_ms=d.reserve_ms,
            min_inference_ms=d.min_inference_ms,
            context=cfg.budgets.context,
            inference=cfg.budgets.inference,
        )
        info = RequestInfo(
            request_id=request_id,
            route=route,
            budget=budget,
            created=int(time.time()),
            channel=channel,
            session_id=session_id,
            tenant=rt.gate.tenant(request.principal, route.tenant),
            headers=headers,
            trace=self.tracing.start(route.label, headers, request.arrival),
            key_id=request.principal.key_id if request.principal is not None else None,
        )
        outcome = await rt.pipeline.run(
            info, request.receive, request.responder, server_call(request.scope)
        )
        await rt.gate.after_chat(request.principal, outcome)

    async def _embed(self, rt: Runtime, route: Route, request: Request) -> None:
        outcome = await rt.embeddings.serve(route, request)
        await rt.gate.after_chat(request.principal, outcome)

    @staticmethod
    def _channel(cfg: Config, value: str | None) -> str:
        channels = cfg.server.channels
        if value is None:
            return channels[0]
        channel = value.strip().lower()
        if channel not in channels:
            raise BadRequest(
                f"`X-Channel` must be one of {', '.join(channels)}; got {value[:40]!r}",
                param="X-Channel",
                code="invalid_channel",
            )
        return channel

    @staticmethod
    def _models_json(routes: list[Route]) -> bytes:
        created = int(time.time())
        seen: dict[str, str] = {}
        for route in routes:
            for model in route.adapter.models:
                seen.setdefault(model, route.adapter.serving(model).name)
        data = [Model(id=m, created=created, owned_by=owner) for m, owner in seen.items()]
        return encoder.encode(ModelList(data=data))


#: The largest config text ``POST /admin/config/reload`` takes.
MAX_CONFIG_BYTES = 1_048_576
#: A reply's id (and the request's ``X-Request-Id``) as each client API spells it.
_ID_PREFIX = {"responses": "resp_", "messages": "msg_"}


async def _toml_body(rt: Runtime, request: Request) -> str | None:
    """The config text a reload request proposes; None when its body is empty.

    Raises:
        UnsupportedMediaType: a body that is not ``application/toml`` (``text/plain``
            would let a web page send it without a preflight).
        BadRequest: a body that is not UTF-8.
        PayloadTooLarge: more than :data:`MAX_CONFIG_BYTES`.
    """
    limit = rt.config.limits.body_total_timeout_ms / 1000.0
    body: bytes | None = b""
    with trio.move_on_after(limit) as scope:
        body = await read_body(request.receive, MAX_CONFIG_BYTES)
    if scope.cancelled_caught:
        raise StageDeadlineExceeded("parse", "the request body did not arrive in time")
    if not body:
        return None
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/toml":
        raise UnsupportedMediaType(
            "a config to save must be sent as application/toml (no body: read the file again)"
        )
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("the config text is not UTF-8", param="body") from None


class _Staged:
    """A runtime built for a reload, not serving yet (``reload.Staged``)."""

    def __init__(self, app: App, rt: Runtime) -> None:
        self._app = app
        self.runtime = rt

    def commit(self) -> None:
        self._app._commit(self.runtime)

    async def abandon(self) -> None:
        await close_all(self._app.generations.unused(self.runtime))


def _show_startup_logs() -> None:
    """Make the gateway's INFO lines (ready, the hypercorn guard) reach stderr.

    hypercorn configures only its own loggers; without this, an operator would
    see none of the gateway's start-up lines. Logging the operator configured
    (a level or a handler on ``aiserve_trio``) is left alone.
    """
    if log.level != logging.NOTSET or log.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    # hypercorn's own format, so the lines read as one log.
    handler.setFormatter(
        logging.Formatter(
            "%(asctime)s [%(process)d] [%(levelname)s] %(message)s", "[%Y-%m-%d %H:%M:%S %z]"
        )
    )
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def create_app(config: Config | None = None, **kwargs: Any) -> App:
    """Build the app; ``config`` defaults to ``$AISERVE_CONFIG`` or the embedded default."""
    return App(config if config is not None else load_config(), **kwargs)
