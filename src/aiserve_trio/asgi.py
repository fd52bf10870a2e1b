"""The ASGI application: lifespan, the endpoint table, the per-request entry.

``App`` is what hypercorn serves. Every HTTP request resolves to an endpoint
of one table (``http/endpoints.py``), passes the gate (admission, then
authentication), and runs the endpoint's handler; chat requests get their
deadline here and run in the :class:`~.pipeline.Pipeline`. Every error a
client sees is the OpenAI error envelope with a correct status.
"""

from __future__ import annotations

import logging
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import trio
from opentelemetry.trace import TracerProvider

from . import gctune
from .adapters import Adapter, build_adapters
from .adapters.group import GroupAdapter
from .api import Model, ModelList, encoder
from .budgets import TIMEOUT_HEADER, effective_timeout_ms, plan
from .cache.service import build_cache
from .config import Config, load_config, route_label
from .embeddings import Embeddings
from .errors import BadRequest, GatewayError, Overloaded, PayloadTooLarge
from .http import coalesce, idle
from .http.cors import Cors
from .http.endpoints import Admission, Auth, Endpoint, EndpointTable, Request
from .http.responder import Responder
from .http.sse import shutdown_event
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
from .policies.registry import build_policies
from .record.recorder import build_recorder
from .security import edge
from .security.gate import Gate
from .sessions import build_bus
from .sessions.bus import SessionBus, check_session_id
from .sessions.http import SessionEndpoints
from .sessions.outbox import WriteBack
from .stages.outcome import Outcome
from .stages.types import RequestInfo, Route
from .startup import hypercorn_process

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
        self.config = config
        self.metrics = Metrics()
        self._init_observability(tracer_provider)
        self.adapters: dict[str, Adapter] = build_adapters(config.adapters, self.observer, adapters)
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
        self.gate = Gate(config)
        self._background: trio.CancelScope | None = None
        self.routes: dict[str, Route] = {
            rc.path: Route(
                config=rc,
                label=route_label(rc),
                adapter=self.adapters[rc.adapter],
                policies=build_policies(rc.policies, config),
                tenant=rc.tenant or config.server.default_tenant,
            )
            for rc in config.routes
        }
        self.sessions = SessionEndpoints(
            config, self.bus, self.closing, self._session_tenant, self._vars_redactor()
        )
        #: ``[record]``: finished requests go to it through the observer.
        self.recorder = build_recorder(config, self.routes, self.metrics)
        self.observer.recorder = self.recorder
        #: The routes' response caches (None when no route has one).
        self.cache = build_cache(
            config, {path: r.label for path, r in self.routes.items()}, self.observer
        )
        if self.cache is not None:
            cache = self.cache
            self.metrics.watch_cache(cache.held, lambda: len(cache.flights), lambda: cache.server)
        self.pipeline = Pipeline(
            config,
            self.bus,
            writeback=self.writeback,
            admission=self.gate.admission,
            hook=self.observer,
            cache=self.cache,
        )
        self.embeddings = Embeddings(config, self.observer)
        table = self._endpoints()
        self.endpoints = EndpointTable(table, unknown=[("/debug/", Auth.ADMIN)])
        methods = {m for ep in table for m in ep.methods}
        self.cors = Cors(config.cors, methods) if config.cors is not None else None
        self.ready = False
        self._models_body = self._models_json(list(self.routes.values()))
        #: The listing for keys limited to some routes, by their route set.
        self._models_by_key: dict[frozenset[str], bytes] = {}

    def _endpoints(self) -> list[Endpoint]:
        get, req = ("GET",), Admission.REQUEST
        sessions = self.sessions
        table = [
            Endpoint(
                r.config.path,
                ("POST",),
                Auth.CHAT,
                req,
                partial(self._chat if r.config.kind == "chat" else self._embed, r),
                r.label,
            )
            for r in self.routes.values()
        ]
        table += [
            Endpoint("/v1/models", get, Auth.KEY, req, self._models, "models"),
            Endpoint("/healthz", get, Auth.OPEN, Admission.NONE, self._healthz, "healthz"),
            Endpoint("/readyz", get, Auth.OPEN, Admission.NONE, self._readyz, "readyz"),
            Endpoint("/metrics", get, Auth.METRICS, Admission.NONE, self._metrics, "metrics"),
            Endpoint("/v1/sessions/{id}", get, Auth.KEY, req, sessions.get, "session"),
            Endpoint(
                "/v1/sessions/{id}/vars", ("PUT",), Auth.KEY, req, sessions.put_vars, "vars"
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
                Auth.KEY,
                req,
                self.gate.stream_token,
                "stream_token",
            ),
        ]
        # Profiles and run traces of this worker (admin; loopback only when auth is off).
        debug = DebugEndpoints(auth_enabled=self.gate.enabled)
        table += [
            Endpoint("/debug/profile", get, Auth.ADMIN, req, debug.profile, "debug_profile"),
            Endpoint("/debug/trace", get, Auth.ADMIN, req, debug.trace, "debug_trace"),
        ]
        if self.config.observability.debug_requests:
            table.append(
                Endpoint("/debug/requests/recent", get, Auth.ADMIN, req, self._recent, "debug")
            )
        return table

    # --- ASGI ----------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
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
        log.info("hypercorn guard: %s", edge.install())
        log.info("hypercorn write coalescing: %s", coalesce.install())
        log.info("hypercorn keep-alive timer without a lock: %s", idle.install())
        for adapter in self.adapters.values():
            await adapter.aopen(nursery)
        await self.bus.aopen()
        await self.gate.aopen()
        if self.recorder is not None:
            # Outside the background scope: shutdown lets it write what is queued.
            await nursery.start(self.recorder.run)
        if self.cache is not None:
            await self.cache.aopen(nursery)
        await nursery.start(self._run_background)
        if hypercorn_process() is not None:
            log.info("garbage collector: %s", gctune.tune())
        self.ready = True
        log.info(
            "aiserve-trio ready: config %s, routes %s",
            self.config.source,
            ", ".join(self.routes),
        )

    def _init_observability(self, provider: TracerProvider | None) -> None:
        ob = self.config.observability
        if provider is None and ob.otlp_endpoint:
            provider = configure_otlp(ob.otlp_endpoint, ob.service_name)
        self.tracing = Tracing(provider, enabled=ob.tracing)
        self.baseline = BaselineMonitor(
            [route_label(rc) for rc in self.config.routes],
            0.0,
            window_s=ob.baseline_window_s,
            history=ob.baseline_history,
            anomaly_factor=ob.anomaly_factor,
            min_requests=ob.baseline_min_requests,
        )
        keep = ob.debug_keep if ob.debug_requests else 0
        self.observer = RequestObserver(self.metrics, self.baseline, keep_recent=keep)
        self.sched_lag = SchedulerLag(ob.lag_interval_ms / 1000.0) if ob.scheduler_lag else None
        if self.sched_lag is not None:
            self.metrics.registry.register(self.sched_lag)

    def _deployment_states(self) -> Iterator[tuple[str, str, int]]:
        """(group, deployment, state) of every group, at scrape time."""
        now = trio.current_time()
        for adapter in self.adapters.values():
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
                tasks.start_soon(self._baseline_loop)
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
            for adapter in self.adapters.values():
                await adapter.aclose()
        # Not under the shield: the gate's Redis limiter, the bus and a Redis cache exit
        # task groups that startup() entered at this level, and Trio needs cancel scopes
        # closed in the reverse order they opened -- the cache opened after the bus.
        if self.cache is not None:
            await self.cache.aclose()
        await self.gate.aclose()
        await self.bus.aclose()

    # --- HTTP ----------------------------------------------------------------

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrival = trio.current_time()  # the deadline counts from here, auth included
        path: str = scope["path"]
        endpoint, params = self.endpoints.resolve(scope["method"], path)
        # For /debug/trace and /debug/profile: what this task serves (its own context copy).
        TASK_LABEL.set(TaskLabel(None, endpoint.name))
        # Chat streams are watched by the sse stage's keep-alive task instead
        # of a cancel scope around every write.
        chat = endpoint.auth is Auth.CHAT
        write_timeout = None if chat else self.config.limits.write_timeout_ms / 1000.0
        hdrs = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        cors = self.cors
        extra = cors.response_headers(hdrs.get("origin")) if cors is not None else None
        responder = Responder(send, write_timeout, extra)
        if cors is not None and cors.is_preflight(scope["method"], hdrs):
            # Before the gate: a browser sends no key with a preflight.
            try:
                await responder.start(204, cors.preflight(hdrs))
                await responder.body(b"", more=False)
            except GatewayError as err:
                await responder.error(err)
            return
        try:
            # A fast 503 (429) before any body is read.
            with self.gate.admit(endpoint, scope, hdrs):
                request = Request(
                    scope, scope["method"], path, hdrs, receive, responder, arrival, params
                )
                request.principal = await self.gate.authenticate(endpoint, request)
                with self.gate.stream_slot(endpoint):
                    await endpoint.handler(request)
        except GatewayError as err:
            if not responder.started:
                await responder.error(err)
        except BaseException:
            # Cancelled by hypercorn after its graceful_timeout: end an open stream
            # with a final event instead of tearing the connection.
            if responder.started and not responder.finished:
                with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                    last = shutdown_event(session_stream=endpoint.admission is Admission.STREAM)
                    await responder.body(last, more=False)
            raise

    async def _healthz(self, request: Request) -> None:
        await request.responder.complete(200, JSON_HEADERS, b'{"status":"ok"}')

    async def _models(self, request: Request) -> None:
        """Every model of every route the caller may use."""
        p = request.principal
        body = self._models_body
        if p is not None and "*" not in p.routes:
            cached = self._models_by_key.get(p.routes)
            if cached is None:
                mine = [r for path, r in self.routes.items() if path in p.routes]
                cached = self._models_by_key[p.routes] = self._models_json(mine)
            body = cached
        await request.responder.complete(200, JSON_HEADERS, body)

    async def _metrics(self, request: Request) -> None:
        await request.responder.complete(200, METRICS_HEADERS, self.metrics.render())

    async def _recent(self, request: Request) -> None:
        body = encoder.encode(self.observer.slowest())
        await request.responder.complete(200, JSON_HEADERS, body)

    async def _readyz(self, request: Request) -> None:
        problems: list[str] = []
        if not self.ready:
            problems.append("not started")
        for name, adapter in self.adapters.items():
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

    def _vars_redactor(self) -> Callable[[dict[str, str]], dict[str, str]] | None:
        """What ``PUT /v1/sessions/{id}/vars`` applies: the data protection of every
        chat route, since every route reads the same sessions."""
        policies = [p for r in self.routes.values() for p in r.policies]
        if not any(type(p).redact_text is not Policy.redact_text for p in policies):
            return None
        clear = frozenset(self.config.sessions.clear_vars)

        def redact(values: dict[str, str]) -> dict[str, str]:
            ctx = PolicyContext(route="sessions", channel="api", tenant="", request_id="")
            return redact_values(values, policies, ctx, clear)

        return redact

    def _session_tenant(self, request: Request) -> str:
        return self.gate.tenant(request.principal, self.config.server.default_tenant)

    async def _chat(self, route: Route, request: Request) -> None:
        cfg = self.config
        d = cfg.deadline
        rd = route.config.deadline
        headers = request.headers
        request_id = f"chatcmpl-{secrets.token_hex(12)}"
        try:
            timeout_ms = effective_timeout_ms(
                headers.get(TIMEOUT_HEADER),
                default_ms=rd.default_ms or d.default_ms,
                max_ms=rd.max_ms or d.max_ms,
                reserve_ms=d.reserve_ms,
            )
            channel = self._channel(headers.get("x-channel"))
            sid = headers.get("x-session-id")
            session_id = check_session_id(sid) if sid is not None else None
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
            tenant=self.gate.tenant(request.principal, route.tenant),
            headers=headers,
            trace=self.tracing.start(route.label, headers, request.arrival),
        )
        outcome = await self.pipeline.run(info, request.receive, request.responder)
        await self.gate.after_chat(request.principal, outcome)

    async def _embed(self, route: Route, request: Request) -> None:
        outcome = await self.embeddings.serve(route, request)
        await self.gate.after_chat(request.principal, outcome)

    def _channel(self, value: str | None) -> str:
        channels = self.config.server.channels
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
                seen.setdefault(model, route.adapter.name)
        data = [Model(id=m, created=created, owned_by=owner) for m, owner in seen.items()]
        return encoder.encode(ModelList(data=data))


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
