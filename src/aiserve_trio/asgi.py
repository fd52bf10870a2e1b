"""The ASGI application: lifespan, routing, and the per-request entry.

``App`` is what hypercorn serves. It routes by path, checks the request head
(timeout, channel, session id, declared body size), fixes the request's
deadline, and hands chat requests to the :class:`~.pipeline.Pipeline`. Every
error a client sees is the OpenAI error envelope with a correct status.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import secrets
import time
from collections.abc import Iterator, MutableMapping
from typing import Any

import trio
from opentelemetry.trace import TracerProvider

from .adapters import Adapter, build_adapter
from .api import Model, ModelList, encoder
from .budgets import TIMEOUT_HEADER, effective_timeout_ms, plan
from .config import Config, load_config, route_label
from .errors import (
    BadRequest,
    GatewayError,
    MethodNotAllowed,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    UpstreamError,
)
from .observability.baseline import BaselineMonitor
from .observability.metrics import Metrics, status_label
from .observability.observer import RequestObserver
from .observability.sched import SchedulerLag
from .observability.tracing import Tracing, configure_otlp, upstream_attempt
from .pipeline import Pipeline
from .policies.base import build_policies
from .security import edge
from .security.auth import Principal
from .security.gate import TOKEN_SUFFIX, Gate, shutdown_event
from .sessions import build_bus
from .sessions.bus import SessionBus, check_session_id
from .sessions.http import PREFIX as SESSIONS_PREFIX
from .sessions.http import SessionEndpoints
from .sessions.outbox import WriteBack
from .stages.request import JSON_HEADERS, Receive, RequestState, Responder, Route, Send

log = logging.getLogger("aiserve_trio")
Scope = MutableMapping[str, Any]
edge.install()  # contain hostile HTTP/2 clients to their connection (security/edge.py)
_METRICS_HEADERS = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]


class _UpstreamHook:
    """The adapters' upstream hook, until the request observer takes it over.

    Counts retries and final errors, and makes each try a span under the inference span.
    """

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    @contextlib.contextmanager
    def attempt(self, adapter: str, number: int) -> Iterator[None]:
        with upstream_attempt(number) as span:
            try:
                yield
            except UpstreamError as err:
                span.set_attribute("aiserve.error_code", err.code or err.type)
                raise

    def retrying(self, adapter: str, error: UpstreamError) -> None:
        self._metrics.upstream_retries.labels(adapter).inc()

    def failed(self, adapter: str, error: UpstreamError) -> None:
        self._metrics.upstream_errors.labels(adapter, error.code or "upstream_error").inc()


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
        hook = _UpstreamHook(self.metrics)
        built = {name: build_adapter(name, c, hook) for name, c in config.adapters.items()}
        self.adapters: dict[str, Adapter] = {**built, **(adapters or {})}
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
        self.sessions = SessionEndpoints(config, self.bus, self.closing)
        self._background: trio.CancelScope | None = None
        self.routes: dict[str, Route] = {}
        for rc in config.routes:
            self.routes[rc.path] = Route(
                config=rc,
                label=route_label(rc),
                adapter=self.adapters[rc.adapter],
                policies=build_policies(rc.policies, config),
                tenant=rc.tenant or config.server.default_tenant,
            )
        self.pipeline = Pipeline(config, self.metrics, self.bus, self.writeback)
        self._init_observability(tracer_provider)
        self.gate = Gate(config)
        self.pipeline.admission = self.gate.admission
        self.ready = False
        self._models_body = self._models_json()

    # --- ASGI ----------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        # The app's lifetime nursery: the adapters' pool tasks and the background
        # tasks (the session outbox) run in it. Shutdown runs inside it, so the
        # task groups that startup() entered close before the nursery does.
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
        """Open adapters' pools and the session bus (in the task that later calls shutdown).

        Args:
            nursery: the app's lifetime nursery, open until :meth:`shutdown` has
                returned: the adapters' pool tasks and the background tasks
                (see :meth:`start_background`) run in it.
        """
        for adapter in self.adapters.values():
            await adapter.aopen(nursery)
        await self.bus.aopen()
        await self.gate.aopen()
        await self.start_background(nursery)
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
            [r.label for r in self.routes.values()],
            0.0,
            window_s=ob.baseline_window_s,
            history=ob.baseline_history,
            anomaly_factor=ob.anomaly_factor,
            min_requests=ob.baseline_min_requests,
        )
        keep = ob.debug_keep if ob.debug_requests else 0
        self.observer = RequestObserver(self.metrics, self.baseline, keep_recent=keep)
        self.pipeline.observer = self.observer
        self.sched_lag = SchedulerLag(ob.lag_interval_ms / 1000.0) if ob.scheduler_lag else None
        if self.sched_lag is not None:
            self.metrics.registry.register(self.sched_lag)

    async def _baseline_loop(self) -> None:
        """Close a baseline window every ``baseline_window_s`` and publish it."""
        self.baseline.restart(trio.current_time())
        while True:
            await trio.sleep_until(self.baseline.next_roll)
            for route, assessment in self.baseline.roll(trio.current_time()).items():
                self.metrics.publish_baseline(route, assessment)

    async def start_background(self, nursery: trio.Nursery) -> None:
        """Start the app-lifetime tasks (session outbox drain, baseline) in ``nursery``."""
        await nursery.start(self._run_background)

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
            for adapter in self.adapters.values():
                await adapter.aclose()
            await self.gate.aclose()
        # Not under the shield: the bus exits task groups that startup() entered at
        # this level, and Trio needs cancel scopes closed in the order they opened.
        await self.bus.aclose()

    # --- HTTP ----------------------------------------------------------------

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrival = trio.current_time()  # the deadline counts from here, auth included
        path: str = scope["path"]
        method: str = scope["method"]
        route = self.routes.get(path)
        # Chat streams get the pipeline's keep-alive watchdog instead of a
        # cancel scope around every write.
        write_timeout = None if route is not None else self.config.limits.write_timeout_ms / 1000.0
        responder = Responder(send, write_timeout)
        slot = False
        try:
            slot = self.gate.enter(scope)  # a fast 503 before any body is read
            hdrs = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            principal = await self.gate.authenticate(scope, hdrs, chat=route is not None)
            if route is not None:
                if method != "POST":
                    raise MethodNotAllowed(
                        f"{method} is not allowed on {path}; use POST", headers={"Allow": "POST"}
                    )
                await self._chat(route, hdrs, arrival, receive, responder, principal)
            elif path == "/v1/models":
                self._only(method, "GET", path)
                await responder.complete(200, JSON_HEADERS, self._models_body)
            elif path == "/healthz":
                self._only(method, "GET", path)
                await responder.complete(200, JSON_HEADERS, b'{"status":"ok"}')
            elif path == "/readyz":
                self._only(method, "GET", path)
                await self._readyz(responder)
            elif path.startswith(SESSIONS_PREFIX) and path.endswith(TOKEN_SUFFIX):
                await self.gate.stream_token(principal, method, path, responder)
            elif path.startswith(SESSIONS_PREFIX):
                sessions = copy.copy(self.sessions)  # acting for the key's tenant only
                sessions.tenant = self.gate.tenant(principal, sessions.tenant)
                events = path.endswith("/events")
                with self.gate.admission.stream() if events else contextlib.nullcontext():
                    await sessions.handle(method, path, hdrs, receive, responder)
            elif path == "/metrics":
                self._only(method, "GET", path)
                await responder.complete(200, _METRICS_HEADERS, self.metrics.render())
            elif path == "/debug/requests/recent" and self.config.observability.debug_requests:
                self._only(method, "GET", path)
                body = encoder.encode(self.observer.slowest())
                await responder.complete(200, JSON_HEADERS, body)
            else:
                raise NotFound(f"no route serves {method} {path[:200]}")
        except GatewayError as err:
            if not responder.started:
                await responder.error(err)
        except BaseException:
            # Cancelled by hypercorn after its graceful_timeout: end an open stream
            # with a final event instead of tearing the connection.
            if responder.started and not responder.finished:
                with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                    await responder.body(shutdown_event(path), more=False)
            raise
        finally:
            self.gate.leave(slot)

    @staticmethod
    def _only(method: str, allowed: str, path: str) -> None:
        if method != allowed:
            raise MethodNotAllowed(
                f"{method} is not allowed on {path}; use {allowed}", headers={"Allow": allowed}
            )

    async def _readyz(self, responder: Responder) -> None:
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
        await responder.complete(200, JSON_HEADERS, b'{"status":"ready"}')

    async def _chat(
        self,
        route: Route,
        headers: dict[str, str],
        arrival: float,
        receive: Receive,
        responder: Responder,
        principal: Principal | None = None,
    ) -> None:
        cfg = self.config
        d = cfg.deadline
        rd = route.config.deadline
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
            extra = [(b"x-request-id", request_id.encode())]
            await responder.error(err, extra)
            m = self.metrics
            m.child(m.requests, route.label, "none", "none", status_label(err.status)).inc()
            return
        budget = plan(
            arrival,
            timeout_ms,
            reserve_ms=d.reserve_ms,
            min_inference_ms=d.min_inference_ms,
            context=cfg.budgets.context,
            inference=cfg.budgets.inference,
        )
        state = RequestState(
            request_id=request_id,
            route=route,
            budget=budget,
            created=int(time.time()),
            channel=channel,
            session_id=session_id,
            tenant=self.gate.tenant(principal, route.tenant),
            headers=headers,
            trace=self.tracing.start(route.label, headers, arrival),
        )
        await self.pipeline.run(state, receive, responder)
        await self.gate.after_chat(principal, state)

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

    def _models_json(self) -> bytes:
        created = int(time.time())
        seen: dict[str, str] = {}
        for route in self.routes.values():
            for model in route.adapter.models:
                seen.setdefault(model, route.adapter.name)
        data = [Model(id=m, created=created, owned_by=owner) for m, owner in seen.items()]
        return encoder.encode(ModelList(data=data))


def create_app(config: Config | None = None, **kwargs: Any) -> App:
    """Build the app; ``config`` defaults to ``$AISERVE_CONFIG`` or the embedded default."""
    return App(config if config is not None else load_config(), **kwargs)
