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

import functools
import logging
import secrets
import time
from typing import Any

import trio
from opentelemetry.trace import TracerProvider

from .adapters import Adapter, build_adapters
from .admin import Admin
from .apis import CODECS
from .audit.log import build_audit
from .audit.usage import UsageEndpoints, period_spend
from .budgets import TIMEOUT_HEADER, effective_timeout_ms, plan
from .builder import RuntimeBuilder
from .cache.service import Cache
from .config import Config, load_config
from .console.handlers import Console
from .errors import (
    BadRequest,
    GatewayError,
    PayloadTooLarge,
)
from .http.disconnect import server_call
from .http.endpoints import Admission, Auth, Endpoint, EndpointTable, Request
from .http.responder import Responder
from .http.sse import SHUTTING_DOWN, shutdown_event
from .http.types import Receive, Scope, Send
from .lifespan import Lifespan
from .observability.annotate import TASK_LABEL, TaskLabel
from .observability.debug import DebugEndpoints
from .observability.metrics import status_label
from .pipeline import Pipeline
from .record.recorder import build_recorder
from .reload import Reloader
from .runtime import Generations, Parts, Runtime
from .security.auth import Principal
from .sessions import build_bus
from .sessions.bus import SessionBus, check_session_id
from .sessions.outbox import WriteBack
from .spend.ledger import LedgerMetrics
from .spend.metrics import SpendMetrics
from .stages.outcome import Outcome
from .stages.types import RequestInfo, Route
from .telemetry import Telemetry

log = logging.getLogger("aiserve_trio")


class App(Lifespan):
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
        self.telemetry = t = Telemetry(config, tracer_provider)
        self.metrics, self.tracing, self.baseline = t.metrics, t.tracing, t.baseline
        self.observer, self.sched_lag = t.observer, t.sched_lag
        self.bus = bus if bus is not None else build_bus(config, self.metrics)
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
        self.admin = Admin(self.metrics, self.observer, self.bus, self.usage, lambda: self.ready)
        #: Builds a runtime from a config, with the parts above.
        self.builder = RuntimeBuilder(
            bus=self.bus,
            writeback=self.writeback,
            observer=self.observer,
            closing=self.closing,
            admin=self.admin,
            debug=self.debug,
            console=self.console,
            usage=self.usage,
            chat=self._chat,
            embed=self._embed,
        )
        built = build_adapters(config.adapters, self.observer, adapters)
        #: The current runtime and the retired ones still serving their requests.
        self.generations = Generations(self.builder.build(config, built, None))
        t.watch(lambda: self.generations.current)
        #: ``[record]``: finished requests go to it through the observer.
        self.recorder = build_recorder(config, self.routes, self.metrics)
        self.observer.recorder = self.recorder
        #: ``aiserve_spend_total``, ``aiserve_spend_saved_total``.
        self.observer.sinks.append(SpendMetrics(self.metrics.registry, config.pricing.currency))
        self.gate.ledger.metrics = LedgerMetrics(self.metrics.registry)
        if self.audit is not None:  # a lost (Redis) or forgotten (restart) period's spend
            self.gate.ledger.seed_from(
                functools.partial(period_spend, self.audit),
                [*self.gate.budgets.keys.values(), *self.gate.budgets.tenants.values()],
            )
        #: Reloads the config without a restart (``reload.py``).
        reloads = self.metrics.config_reloads
        self.reloader = Reloader(self, lambda result: reloads.labels(result).inc())
        self.console.reloader = self.reloader
        self.admin.reloader = self.reloader
        self.ready = False

    # --- the current runtime (what a new request uses) --------------------------

    @property
    def pipeline(self) -> Pipeline:
        return self.runtime.pipeline

    @property
    def cache(self) -> Cache | None:
        return self.runtime.cache

    @property
    def endpoints(self) -> EndpointTable:
        return self.runtime.endpoints

    # --- ASGI ----------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

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
                # A wrong key's address: the audit log counts those per address.
                client = rt.gate.client_address(scope, hdrs) if err.status == 401 else None
                self._refused(rt, endpoint, principal, hdrs, err, arrival, client)
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
        client: str | None = None,
    ) -> None:
        """A chat request the gate refused (key, rate, budget): the audit log's row
        (``client``: a wrong key's address)."""
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
                client=client,
            )
        )

    async def _chat(self, rt: Parts, route: Route, request: Request) -> None:
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

    async def _embed(self, rt: Parts, route: Route, request: Request) -> None:
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

#: A reply's id (and the request's ``X-Request-Id``) as each client API spells it.
_ID_PREFIX = {"responses": "resp_", "messages": "msg_"}


def create_app(config: Config | None = None, **kwargs: Any) -> App:
    """Build the app; ``config`` defaults to ``$AISERVE_CONFIG`` or the embedded default."""
    return App(config if config is not None else load_config(), **kwargs)
