"""The running gateway: every long-lived part built in one place, opened and closed in one.

:func:`build_gateway` constructs the worker's parts from the first config, in
dependency order, each given what it uses when it is made: telemetry (metrics,
tracing, the request observer), the session bus and its write-back, the audit
log and its usage reads, the spend ledger, the admin, debug and console
handlers, the per-request entry (``entry.py``), the runtime builder and the
first :class:`~.runtime.Runtime`, the recorder and the reloader. Nothing is
opened there.

:func:`open_gateway` is the gateway's lifetime: an async context manager over
one :class:`~contextlib.AsyncExitStack`. Each part is opened in order and its
close is pushed on the stack as soon as it is open, so leaving -- at shutdown,
or when a part fails to open half-way through start-up -- closes what was
opened and nothing else, in reverse order, by construction (:data:`ORDER`).

The ASGI app (``asgi.App``) is a frozen shell over a :class:`Gateway`; its
lifespan (``runtime/lifespan.py``) opens it with :func:`opened`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import trio
from opentelemetry.trace import TracerProvider

from .. import server
from ..adapters import Adapter, build_adapters
from ..audit.log import AuditLog, build_audit
from ..audit.usage import UsageEndpoints, period_spend
from ..cache.service import Cache
from ..config import Config, ConfigError
from ..console import sla
from ..console.handlers import WINDOW_S, Console, static_files
from ..endpoints.admin import Admin
from ..mcp.hub import McpHub
from ..observability.debug import DebugEndpoints
from ..observability.metrics import Metrics
from ..observability.observer import RequestObserver
from ..record.recorder import Recorder, build_recorder, recorded_routes
from ..reload import Reloader
from ..security.gate import Gate, build_ledger
from ..security.keystore.service import KeyService, build_keys
from ..sessions import build_bus
from ..sessions.bus import SessionBus
from ..sessions.outbox import WriteBack
from ..spend.ledger import LedgerMetrics
from ..spend.metrics import SpendMetrics
from ..spend.prices import unpriced_models
from ..stages.types import Route
from ..util import fdlimit, gctune
from .builder import RuntimeBuilder, open_cache
from .entry import Entry
from .generation import Closer, Generations, Runtime, carry_adapters, close_all
from .startup import hypercorn_process, refuse_to_start, unusable_tls_files
from .telemetry import Telemetry

log = logging.getLogger("aiserve_trio")

#: What :func:`opened` opens, in this order (it closes them in the reverse one).
ORDER = (
    "nursery",  # the parts' tasks run in it; cancelled last
    "adapters",  # connection pools (at close: every live runtime's)
    "bus",  # the session bus
    "gate",  # rate limiter, spend ledger, logged-out tokens
    "recorder",  # its writer (closing writes what is queued)
    "audit",  # its writer (likewise)
    "keys",  # the database keys' table, loaded (at close: their last uses written)
    "cache",  # the response cache's backend (at close: every live runtime's)
    "background",  # baseline, reload watcher, ledger merge, console, lag, write-back
    "ready",  # /readyz; closing ends live session event streams first
)


@dataclass(eq=False)
class Running:
    """The gateway's state while it is open (what :func:`opened` sets)."""

    #: Started and not shutting down (``/readyz``).
    ready: bool = False
    #: hypercorn's config, when hypercorn's lifespan opened the gateway (its TOML's keys).
    server_config: object | None = None
    #: The nursery the parts' tasks run in (a reload opens new adapters there).
    nursery: trio.Nursery | None = None
    #: The background tasks' nursery (a retired runtime drains there).
    tasks: trio.Nursery | None = None
    #: What ``App.startup`` opened, for ``App.shutdown`` to close.
    stack: AsyncExitStack | None = None
    #: Names of the parts opened, then closed, in order (what start-up and shutdown did).
    opened: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)


class Stager:
    """What the reloader reloads (``reload.Target``): builds a config's runtime, opens what
    it does not take over, makes it current and drains the one it replaces."""

    def __init__(
        self,
        builder: RuntimeBuilder,
        generations: Generations,
        telemetry: Telemetry,
        recorder: Recorder | None,
        running: Running,
    ) -> None:
        self._builder = builder
        self._generations = generations
        self._telemetry = telemetry
        self._recorder = recorder
        self._running = running

    @property
    def config(self) -> Config:
        return self._generations.current.config

    async def stage(self, config: Config) -> _Staged:
        """Build the runtime of ``config`` and open what it does not take over.

        Adapters whose settings did not change are the current ones (their pools
        carry on); the others are built and opened, and so is a cache backend whose
        ``[cache]`` changed. Nothing serves with it until ``commit()``.

        Raises:
            ConfigError: an adapter or the cache cannot be opened (naming the
                file and the key); whatever was opened is closed again.
        """
        nursery = self._running.nursery
        if nursery is None:
            raise ConfigError(f"{config.source}: the app has not started; nothing to reload")
        current = self._generations.current
        fresh: list[Adapter] = []
        try:
            adapters, fresh = carry_adapters(
                config.adapters, current.adapters, current.config.adapters, self._telemetry.observer
            )
            rt = self._builder.build(config, adapters, current)
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
            await open_cache(rt, nursery)
        except Exception as exc:
            await staged.abandon()
            why = str(exc).removeprefix(f"{config.source}: ")
            raise ConfigError(f"{config.source}: key `{key}`: cannot open: {why}") from exc
        return staged

    def commit(self, rt: Runtime) -> None:
        """Make ``rt`` the current runtime; the old one drains in the background."""
        rt.gate.activate()
        old = self._generations.swap(rt)
        if self._recorder is not None:
            self._recorder.routes = recorded_routes(rt.config)
        self._telemetry.baseline.track([r.label for r in rt.routes.values()], trio.current_time())
        if rt.gate.enabled != old.gate.enabled or len(rt.gate.keys) != len(old.gate.keys):
            rt.gate.announce()
        assert self._running.tasks is not None
        self._running.tasks.start_soon(self._generations.drain, old)

    async def abandon(self, rt: Runtime) -> None:
        await close_all(self._generations.unused(rt))

    def draining(self) -> int:
        """Runtimes replaced by a reload that still finish requests."""
        return len(self._generations.live) - 1


class _Staged:
    """A runtime built for a reload, not serving yet (``reload.Staged``)."""

    def __init__(self, stager: Stager, rt: Runtime) -> None:
        self._stager = stager
        self.runtime = rt

    def commit(self) -> None:
        self._stager.commit(self.runtime)

    async def abandon(self) -> None:
        await self._stager.abandon(self.runtime)


@dataclass(frozen=True, eq=False, kw_only=True)
class Gateway:
    """The worker's long-lived parts around the current runtime (see the module docstring)."""

    telemetry: Telemetry
    bus: SessionBus
    writeback: WriteBack
    #: Set when shutdown begins: live session event streams end cleanly.
    closing: trio.Event
    debug: DebugEndpoints
    audit: AuditLog | None
    usage: UsageEndpoints
    console: Console
    admin: Admin
    entry: Entry
    builder: RuntimeBuilder
    #: The current runtime and the retired ones still serving their requests.
    generations: Generations
    recorder: Recorder | None
    stager: Stager
    reloader: Reloader
    running: Running
    #: The database keys (issue 47); None: auth off or no audit database.
    keys: KeyService | None = None

    # --- the current runtime (what a new request uses) ----------------------------

    @property
    def runtime(self) -> Runtime:
        return self.generations.current

    @property
    def config(self) -> Config:
        return self.generations.current.config

    @property
    def gate(self) -> Gate:
        return self.generations.current.gate

    @property
    def cache(self) -> Cache | None:
        return self.generations.current.cache

    @property
    def adapters(self) -> dict[str, Adapter]:
        return self.generations.current.adapters

    @property
    def routes(self) -> dict[str, Route]:
        return self.generations.current.routes

    @property
    def metrics(self) -> Metrics:
        return self.telemetry.metrics

    @property
    def observer(self) -> RequestObserver:
        return self.telemetry.observer


class _Current:
    """The console's view of the gateway (``console.handlers.Host``): the current runtime's
    parts, read when asked."""

    def __init__(self, telemetry: Telemetry, generations: Generations) -> None:
        self._telemetry = telemetry
        self._generations = generations

    @property
    def config(self) -> Config:
        return self._generations.current.config

    @property
    def gate(self) -> Gate:
        return self._generations.current.gate

    @property
    def metrics(self) -> Metrics:
        return self._telemetry.metrics

    @property
    def observer(self) -> RequestObserver:
        return self._telemetry.observer

    @property
    def cache(self) -> Cache | None:
        return self._generations.current.cache


def build_gateway(
    config: Config,
    *,
    adapters: dict[str, Adapter] | None = None,
    bus: SessionBus | None = None,
    tracer_provider: TracerProvider | None = None,
) -> Gateway:
    """Build every part of the gateway from a validated config; nothing is opened.

    Args:
        config: from :func:`~.config.load_config`.
        adapters: adapters by name, replacing those the config would build
            (tests pass fakes here).
        bus: the session bus; default: the one ``[sessions]`` configures.
        tracer_provider: an OpenTelemetry provider for the spans; default: the global
            one, or OTLP export when ``[observability]`` names an endpoint.

    Raises:
        ConfigError: a part cannot be built from the config.
    """
    metrics = Metrics()
    #: ``[audit]``: a row per finished request, through the observer.
    audit = build_audit(config, metrics.registry)
    #: ``aiserve_spend_total``, ``aiserve_spend_saved_total``.
    spend = SpendMetrics(metrics.registry, config.pricing.currency)
    #: ``[record]``: finished requests go to it through the observer.
    recorder = build_recorder(config, metrics)
    #: The current runtime and the retired ones still serving their requests (the first
    #: is built below; the gauges read at scrape time and the console read the current one).
    generations = Generations()
    t = Telemetry(
        config,
        tracer_provider,
        metrics=metrics,
        current=lambda: generations.current,
        recorder=recorder,
        sinks=[spend] if audit is None else [audit, spend],
    )
    observer = t.observer
    bus = bus if bus is not None else build_bus(config, metrics)
    sc = config.sessions
    writeback = WriteBack(
        bus,
        metrics,
        outbox_max=sc.outbox_max,
        retry_ms=sc.outbox_retry_ms,
        retry_max_ms=sc.outbox_retry_max_ms,
    )
    closing = trio.Event()
    running = Running()
    # Profiles and run traces of this worker (one of each at a time, whatever the config).
    debug = DebugEndpoints()
    usage = UsageEndpoints(audit, config.pricing.currency)
    # Virtual keys, teams and the admin audit trail, in the audit database (issue 47).
    keys = build_keys(config, metrics.registry)
    # The spend, worker-wide: a lost (Redis) or forgotten (restart) period's spend is
    # read back from the audit log.
    ledger = build_ledger(
        config,
        LedgerMetrics(metrics.registry),
        functools.partial(period_spend, audit) if audit is not None else None,
    )
    console = Console(_Current(t, generations), static_files(), sla.Window(WINDOW_S), usage=usage)
    admin = Admin(metrics, observer, bus, usage, lambda: running.ready)
    entry = Entry(observer, t.tracing)
    metrics.watch_turns(entry.turns_now)
    builder = RuntimeBuilder(
        bus=bus,
        writeback=writeback,
        observer=observer,
        closing=closing,
        admin=admin,
        debug=debug,
        console=console,
        usage=usage,
        ledger=ledger,
        chat=entry.chat,
        embed=entry.embed,
        keys=keys,
        mcp=McpHub(metrics.registry, audit, t.tracing),
        recorder=recorder,
    )
    built = build_adapters(config.adapters, observer, adapters)
    generations.begin(builder.build(config, built, None))
    stager = Stager(builder, generations, t, recorder, running)
    reloads = metrics.config_reloads
    reloader = Reloader(stager, lambda result: reloads.labels(result).inc())
    # The one link made afterwards: the reloader reaches the runtimes, whose endpoint
    # tables (the admin's and the console's handlers) reach the reloader.
    admin.reloader = console.reloader = reloader
    admin.keys = console.keys = keys
    return Gateway(
        telemetry=t,
        bus=bus,
        writeback=writeback,
        closing=closing,
        debug=debug,
        audit=audit,
        usage=usage,
        console=console,
        admin=admin,
        entry=entry,
        builder=builder,
        generations=generations,
        recorder=recorder,
        stager=stager,
        reloader=reloader,
        running=running,
        keys=keys,
    )


@asynccontextmanager
async def open_gateway(
    config: Config,
    *,
    adapters: dict[str, Adapter] | None = None,
    bus: SessionBus | None = None,
    tracer_provider: TracerProvider | None = None,
    server_config: object | None = None,
) -> AsyncIterator[Gateway]:
    """Build the gateway of ``config`` and open it (:func:`opened`); leaving closes it."""
    gw = build_gateway(config, adapters=adapters, bus=bus, tracer_provider=tracer_provider)
    async with opened(gw, server_config) as gateway:
        yield gateway


@asynccontextmanager
async def opened(gw: Gateway, server_config: object | None = None) -> AsyncIterator[Gateway]:
    """Open ``gw``'s parts in :data:`ORDER`; leaving closes those opened, in reverse.

    Args:
        server_config: hypercorn's config, when hypercorn's lifespan opens it.

    Raises:
        Exception: whatever stopped a part from opening, after the parts opened
            before it were closed.
    """
    failure: Exception | None = None
    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        _step(gw, stack, "nursery", _cancelled(nursery))
        try:
            await start(gw, stack, nursery, server_config)
        except Exception as exc:
            # Raised once the stack has closed what opened and the nursery has
            # ended (raised in it, the failure would reach the caller in a group).
            failure = exc
        if failure is None:
            yield gw
    if failure is not None:
        raise failure


def _cancelled(nursery: trio.Nursery) -> Closer:
    async def cancel() -> None:
        nursery.cancel_scope.cancel(reason="gateway closed")

    return cancel


def _step(gw: Gateway, stack: AsyncExitStack, name: str, close: Closer) -> None:
    """``name`` is open: ``close`` runs when the stack unwinds (in reverse order)."""
    running = gw.running
    running.opened.append(name)

    async def closer() -> None:
        running.closed.append(name)
        await close()

    stack.push_async_callback(closer)


async def start(
    gw: Gateway, stack: AsyncExitStack, nursery: trio.Nursery, server_config: object | None = None
) -> None:
    """Open ``gw``'s parts after the nursery, in :data:`ORDER`, each one's close on ``stack``.

    Args:
        nursery: lives as long as the gateway: adapters' connection tasks and the
            background tasks run in it.
    """
    running = gw.running
    running.server_config = server_config
    _install_seam(server_config)
    running.nursery = nursery
    first = list(gw.adapters.values())
    opening: set[int] = set()
    _step(gw, stack, "adapters", functools.partial(_close_adapters, gw.generations, first, opening))
    for adapter in first:
        await adapter.aopen(nursery)
        opening.add(id(adapter))
    # Not shielded: the bus and the gate's Redis clients exit task groups entered here,
    # and Trio needs cancel scopes closed in the reverse order they opened.
    await gw.bus.aopen()
    _step(gw, stack, "bus", gw.bus.aclose)
    gate = gw.gate
    await gate.aopen()
    _step(gw, stack, "gate", gw.gate.aclose)
    if gw.recorder is not None:
        # Outside the background scope: closing lets it write what is queued.
        await nursery.start(gw.recorder.run)
        _step(gw, stack, "recorder", _shielded(gw.recorder.aclose))
    if gw.audit is not None:
        await nursery.start(gw.audit.run)  # likewise
        _step(gw, stack, "audit", _shielded(gw.audit.aclose))
    if gw.keys is not None:
        await nursery.start(gw.keys.run)  # the table loaded (or given up on) first
    _step(gw, stack, "keys", gw.keys.aclose if gw.keys is not None else _nothing)
    await open_cache(gw.runtime, nursery)
    _step(gw, stack, "cache", functools.partial(_close_caches, gw.generations))
    background = await nursery.start(_run_background, gw)
    _step(gw, stack, "background", functools.partial(_end_background, gw, background))
    config = gw.config
    if hypercorn_process() is not None:
        said, enough = fdlimit.raise_soft(config.limits.max_inflight)
        log.log(logging.INFO if enough else logging.WARNING, "%s", said)
        log.info("garbage collector: %s", gctune.tune())
    running.ready = True
    _step(gw, stack, "ready", functools.partial(_not_ready, gw))
    if config.pricing.models and (unpriced := unpriced_models(config)):
        log.warning("no price in [pricing] (these cost 0): %s", ", ".join(unpriced))
    log.info("aiserve-trio ready: config %s, routes %s", config.source, ", ".join(gw.routes))


def _install_seam(server_config: object | None) -> None:
    """The hypercorn seam (``server/``); a hypercorn it does not know refuses
    the start, as a bad config does (unless hypercorn's TOML allows it), and so do TLS
    files hypercorn could not load."""
    role = hypercorn_process()
    if role is not None and (why := unusable_tls_files(server_config)) is not None:
        refuse_to_start(why, role)
    try:
        log.info("hypercorn seam: %s", server.install(server_config))
    except server.SeamRefused as exc:
        if role is None:
            raise
        refuse_to_start(str(exc), role)


async def _nothing() -> None:
    pass


def _shielded(close: Closer) -> Closer:
    async def run() -> None:
        with trio.CancelScope(shield=True):
            await close()

    return run


async def _close_adapters(generations: Generations, first: list[Adapter], opened: set[int]) -> None:
    """Every live runtime's adapters (a retired one may be finishing requests), but not
    those of the first one that start-up did not get to open."""
    unopened = {id(a) for a in first} - opened
    held: dict[int, Closer] = {}
    for rt in generations.live:
        held.update({id(a): a.aclose for a in rt.adapters.values() if id(a) not in unopened})
    with trio.CancelScope(shield=True):
        await close_all(held.values())


async def _close_caches(generations: Generations) -> None:
    """Every live runtime's cache backend."""
    held: dict[int, Closer] = {}
    for rt in generations.live:
        closer = rt.cache_hold.closer
        if rt.cache is not None and closer is not None:
            held[id(rt.cache.backend)] = closer
    with trio.CancelScope(shield=True):
        await close_all(held.values())


async def _run_background(
    gw: Gateway, *, task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED
) -> None:
    # One scope for every background task, so that closing ends them all.
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as tasks:
            gw.running.tasks = tasks
            t = gw.telemetry
            tasks.start_soon(t.baseline_loop)
            tasks.start_soon(gw.reloader.watch)
            tasks.start_soon(gw.gate.ledger.run)  # spend kept in an outage, merged back
            # The OIDC issuers' keys, fetched now and when due, off the request path
            # (one Oidc for every generation's gate; a reload changes what it fetches).
            tasks.start_soon(gw.gate.oidc.run)
            tasks.start_soon(gw.console.sample)
            if gw.builder.mcp is not None:
                await tasks.start(gw.builder.mcp.run)  # the upstream MCP servers
            if t.sched_lag is not None:
                tasks.start_soon(t.sched_lag.run)
            await tasks.start(gw.writeback.run)
            task_status.started(scope)


async def _end_background(gw: Gateway, scope: trio.CancelScope) -> None:
    """End the background tasks; write-back gets 2 s to write what it holds."""
    scope.cancel(reason="app shutdown")
    with trio.CancelScope(shield=True), trio.move_on_after(2.0):
        await gw.writeback.flush()


async def _not_ready(gw: Gateway) -> None:
    gw.running.ready = False
    gw.closing.set()
