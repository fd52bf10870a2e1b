"""The app's lifetime: the ASGI lifespan, start-up, the background tasks, reloads
(staging a runtime, making it current, draining the old one) and shutdown.

:class:`Lifespan` is the part of ``asgi.App`` (the long-lived shell) that opens
and closes things; ``asgi.py`` keeps building the shell and serving requests.
The attributes declared on the class are the shell's, set by ``App.__init__``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from . import fdlimit, gctune, hypercorn_seam
from .adapters import Adapter
from .builder import open_cache
from .config import Config, ConfigError
from .record.recorder import recorded_routes
from .runtime import Closer, carry_adapters, close_all
from .spend.prices import unpriced_models
from .startup import hypercorn_process, refuse_to_start, show_startup_logs, unusable_tls_files

if TYPE_CHECKING:
    from .audit.log import AuditLog
    from .builder import RuntimeBuilder
    from .console.handlers import Console
    from .http.types import Receive, Send
    from .observability.baseline import BaselineMonitor
    from .observability.observer import RequestObserver
    from .observability.sched import SchedulerLag
    from .record.recorder import Recorder
    from .reload import Reloader, Staged
    from .runtime import Generations, Runtime
    from .security.gate import Gate
    from .sessions.bus import SessionBus
    from .sessions.outbox import WriteBack
    from .stages.types import Route
    from .telemetry import Telemetry

log = logging.getLogger("aiserve_trio")


class Lifespan:
    """Opening, reloading and closing the app (a base of ``asgi.App``)."""

    telemetry: Telemetry
    baseline: BaselineMonitor
    observer: RequestObserver
    sched_lag: SchedulerLag | None
    bus: SessionBus
    writeback: WriteBack
    closing: trio.Event
    console: Console
    audit: AuditLog | None
    recorder: Recorder | None
    reloader: Reloader
    builder: RuntimeBuilder
    generations: Generations
    server_config: object | None
    ready: bool
    _nursery: trio.Nursery | None
    _tasks: trio.Nursery | None
    _background: trio.CancelScope | None

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
    def gate(self) -> Gate:
        return self.runtime.gate

    @property
    def routes(self) -> dict[str, Route]:
        return self.runtime.routes

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
            rt = self.builder.build(config, adapters, current)
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

    # --- lifespan ---------------------------------------------------------------

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        # hypercorn's lifespan hands its own receive: its config is the server's.
        self.server_config = getattr(getattr(receive, "__self__", None), "config", None)
        await receive()  # lifespan.startup
        show_startup_logs()
        # The app's pools and background tasks live in this nursery: opened
        # before start-up, closed after shutdown.
        async with trio.open_nursery() as nursery:
            try:
                await self.startup(nursery)
            except Exception as exc:
                if (role := hypercorn_process()) is not None:
                    # Under the hypercorn binary a failed lifespan ends the worker with
                    # a traceback and the server with status 0 (startup.py): whatever
                    # stops the start -- a database migrated by a newer gateway, a port
                    # an adapter cannot open -- is one line and a non-zero exit, as a
                    # bad config is. The traceback is there at debug level.
                    log.debug("start-up failed", exc_info=True)
                    refuse_to_start(self._start_failure(exc), role)
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

    def _start_failure(self, exc: Exception) -> str:
        """What stopped the start, in one line that names the config file."""
        said = str(exc)
        source = str(self.config.source)
        if said.startswith(source):  # a ConfigError names the file and the key itself
            return said
        return f"{source}: start-up failed: {type(exc).__name__}: {said}"

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
        await open_cache(self.runtime, nursery)
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

    async def _run_background(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        # One scope for every background task, so that shutdown() ends them all.
        with trio.CancelScope() as scope:
            self._background = scope
            async with trio.open_nursery() as tasks:
                self._tasks = tasks
                tasks.start_soon(self.telemetry.baseline_loop)
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


class _Staged:
    """A runtime built for a reload, not serving yet (``reload.Staged``)."""

    def __init__(self, app: Lifespan, rt: Runtime) -> None:
        self._app = app
        self.runtime = rt

    def commit(self) -> None:
        self._app._commit(self.runtime)

    async def abandon(self) -> None:
        await close_all(self._app.generations.unused(self.runtime))
