"""The ASGI application: a frozen shell over a :class:`~.gateway.Gateway`.

``App`` is what hypercorn serves. It only dispatches: an HTTP request goes to
the per-request entry (``entry.py``: the endpoint table, the gate, the chat
deadline and pipeline) with the gateway's current runtime, the lifespan to
``runtime/lifespan.py``, which opens and closes the gateway (``gateway.opened``).
Everything it serves with is built by :func:`~.gateway.build_gateway`.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any, NoReturn

from ..config import Config, load_config
from .gateway import Gateway, build_gateway, start
from .lifespan import lifespan

if TYPE_CHECKING:
    import trio
    from opentelemetry.trace import TracerProvider

    from ..adapters import Adapter
    from ..audit.log import AuditLog
    from ..cache.service import Cache
    from ..console.handlers import Console
    from ..endpoints.admin import Admin
    from ..http.endpoints import EndpointTable
    from ..http.types import Receive, Scope, Send
    from ..observability.metrics import Metrics
    from ..observability.observer import RequestObserver
    from ..observability.tracing import Tracing
    from ..record.recorder import Recorder
    from ..reload import Reloader
    from ..security.gate import Gate
    from ..sessions.bus import SessionBus
    from ..sessions.outbox import WriteBack
    from ..stages.pipeline import Pipeline
    from ..stages.types import Route
    from .generation import Generations, Runtime
    from .telemetry import Telemetry


class App:
    """The gateway as an ASGI 3 application (the parts are :attr:`gateway`'s)."""

    __slots__ = ("gateway",)

    gateway: Gateway

    def __init__(
        self,
        config: Config,
        *,
        adapters: dict[str, Adapter] | None = None,
        bus: SessionBus | None = None,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        """Build the gateway of a validated config (:func:`~.gateway.build_gateway`).

        Args:
            config: from :func:`~.config.load_config`.
            adapters: adapters by name, replacing those the config would build
                (tests pass fakes here).
            bus: the session bus; default: the one ``[sessions]`` configures.
            tracer_provider: an OpenTelemetry provider for the spans; default:
                the global one, or OTLP export when ``[observability]`` names an endpoint.
        """
        gw = build_gateway(config, adapters=adapters, bus=bus, tracer_provider=tracer_provider)
        object.__setattr__(self, "gateway", gw)

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(f"the app is frozen: set {name!r} on its gateway's parts")

    # --- ASGI ----------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        gw = self.gateway
        if kind == "http":
            await gw.entry.serve(gw.generations, scope, receive, send)
        elif kind == "lifespan":
            await lifespan(gw, receive, send)

    # --- without the lifespan (tests drive the app in a nursery of their own) -----

    async def startup(self, nursery: trio.Nursery) -> None:
        """Open the gateway's parts with ``nursery`` (the lifespan opens its own);
        :meth:`shutdown` closes them in reverse order."""
        stack = AsyncExitStack()
        try:
            await start(self.gateway, stack, nursery)
        except BaseException:
            await stack.aclose()
            raise
        self.gateway.running.stack = stack

    async def shutdown(self) -> None:
        running = self.gateway.running
        stack, running.stack = running.stack, None
        if stack is not None:
            await stack.aclose()

    # --- the gateway's parts, by their usual names ----------------------------------

    @property
    def config(self) -> Config:
        return self.gateway.config

    @property
    def runtime(self) -> Runtime:
        return self.gateway.runtime

    @property
    def gate(self) -> Gate:
        return self.gateway.gate

    @property
    def cache(self) -> Cache | None:
        return self.gateway.cache

    @property
    def adapters(self) -> dict[str, Adapter]:
        return self.gateway.adapters

    @property
    def routes(self) -> dict[str, Route]:
        return self.gateway.routes

    @property
    def pipeline(self) -> Pipeline:
        return self.gateway.runtime.pipeline

    @property
    def endpoints(self) -> EndpointTable:
        return self.gateway.runtime.endpoints

    @property
    def metrics(self) -> Metrics:
        return self.gateway.metrics

    @property
    def observer(self) -> RequestObserver:
        return self.gateway.observer

    @property
    def telemetry(self) -> Telemetry:
        return self.gateway.telemetry

    @property
    def tracing(self) -> Tracing:
        return self.gateway.telemetry.tracing

    @property
    def bus(self) -> SessionBus:
        return self.gateway.bus

    @property
    def writeback(self) -> WriteBack:
        return self.gateway.writeback

    @property
    def closing(self) -> trio.Event:
        return self.gateway.closing

    @property
    def audit(self) -> AuditLog | None:
        return self.gateway.audit

    @property
    def recorder(self) -> Recorder | None:
        return self.gateway.recorder

    @property
    def console(self) -> Console:
        return self.gateway.console

    @property
    def admin(self) -> Admin:
        return self.gateway.admin

    @property
    def reloader(self) -> Reloader:
        return self.gateway.reloader

    @property
    def generations(self) -> Generations:
        return self.gateway.generations

    @property
    def ready(self) -> bool:
        return self.gateway.running.ready


def create_app(config: Config | None = None, **kwargs: Any) -> App:
    """Build the app; ``config`` defaults to ``$AISERVE_CONFIG`` or the embedded default."""
    return App(config if config is not None else load_config(), **kwargs)
