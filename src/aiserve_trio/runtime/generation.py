"""A generation: everything the app builds from one :class:`~.config.Config`.

The gateway (``runtime/gateway.py``) is a long-lived shell -- metrics, the observer, tracing,
the session bus, write-back, the recorder, the background tasks -- around the
*current* :class:`Runtime`: the config, the adapters, the routes with their
policies, the gate's config-dependent parts, the pipeline, the response cache,
the endpoint table, CORS and the models listing. A runtime is not changed once
it serves; a reload builds a new one and swaps it in.

A request takes the current runtime once, when it arrives, and uses only that
one until it ends (:meth:`Runtime.enter` / :meth:`Runtime.leave`, a count, not
a lock). A runtime replaced by a newer one is *retired*: it serves the requests
it already has and, when the last of them ends, it is *drained*. Then the
resources only it used -- an adapter whose settings changed or that was
removed, a cache backend -- are closed (:class:`Generations`); those the
newer runtime took over (the same object) stay open.

A runtime is built whole (``runtime/builder.py``): its handlers are bound to its
:class:`Parts`, built first, so no field of a :class:`Runtime` is assigned after
it exists.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from ..adapters import Adapter, build_adapter, build_adapters
from ..adapters.group import GroupAdapter
from ..adapters.settings import AdapterConfig, GroupAdapterConfig
from ..core.api import Model, ModelList, encoder

if TYPE_CHECKING:
    from ..cache.service import Cache
    from ..config import Config
    from ..endpoints.embeddings import Embeddings
    from ..http.cors import Cors
    from ..http.endpoints import EndpointTable
    from ..observability.events import UpstreamHook
    from ..security.gate import Gate
    from ..sessions.http import SessionEndpoints
    from ..stages.pipeline import Pipeline
    from ..stages.types import Route

log = logging.getLogger("aiserve_trio")

#: Closes one resource a runtime holds.
Closer = Callable[[], Awaitable[None]]


class Lifetime:
    """A runtime's use: who is using it, whether it is retired, drained (the runtime's only
    state that changes; made before the runtime, so its session endpoints can watch it)."""

    __slots__ = ("active", "closing", "drained", "retired")

    def __init__(self) -> None:
        #: Requests using the runtime now.
        self.active = 0
        self.retired = False
        #: Set when the runtime is retired (or the app shuts down): its session
        #: event streams end cleanly and their clients reconnect to the next one.
        self.closing = trio.Event()
        #: Set once retired and its last request has ended.
        self.drained = trio.Event()


class CacheHold:
    """Who closes a cache backend: set once the backend is opened, shared by every
    runtime whose ``[cache]`` is the same (they use the same backend)."""

    __slots__ = ("closer",)

    def __init__(self) -> None:
        self.closer: Closer | None = None


class Models:
    """The ``/v1/models`` listings of a runtime's routes."""

    __slots__ = ("_by_key", "body", "routes")

    def __init__(self, routes: Mapping[str, Route]) -> None:
        self.routes = routes
        #: The listing for keys that may use every route.
        self.body = models_json(list(routes.values()))
        #: The listing for keys limited to some routes, by their route set (filled lazily).
        self._by_key: dict[frozenset[str], bytes] = {}

    def of(self, allowed: frozenset[str]) -> bytes:
        """The listing for a key that may use the routes ``allowed`` (``*``: every one)."""
        if "*" in allowed:
            return self.body
        body = self._by_key.get(allowed)
        if body is None:
            mine = [r for path, r in self.routes.items() if path in allowed]
            body = self._by_key[allowed] = models_json(mine)
        return body


def models_json(routes: list[Route]) -> bytes:
    """The ``/v1/models`` body of ``routes``: each model once, owned by the adapter serving it."""
    created = int(time.time())
    seen: dict[str, str] = {}
    for route in routes:
        for model in route.adapter.models:
            seen.setdefault(model, route.adapter.serving(model).name)
    data = [Model(id=m, created=created, owned_by=owner) for m, owner in seen.items()]
    return encoder.encode(ModelList(data=data))


@dataclass(frozen=True, slots=True, kw_only=True)
class Parts:
    """What a runtime's handlers serve with: built before the endpoint table that
    binds them, so the :class:`Runtime` is built whole."""

    config: Config
    adapters: dict[str, Adapter]
    routes: dict[str, Route]
    gate: Gate
    pipeline: Pipeline
    embeddings: Embeddings
    sessions: SessionEndpoints
    #: The routes' response caches (None when no route has one).
    cache: Cache | None
    #: Closes the cache's backend (shared with the runtimes whose ``[cache]`` is the same).
    cache_hold: CacheHold
    models: Models
    life: Lifetime


@dataclass(frozen=True, slots=True, kw_only=True)
class Runtime(Parts):
    """What the app serves with, built whole from one config by ``builder.RuntimeBuilder``
    (see the module docstring); nothing changes it afterwards but its :class:`Lifetime`
    (:meth:`enter`, :meth:`leave`, :meth:`retire`) and the listings it caches."""

    endpoints: EndpointTable
    cors: Cors | None

    @property
    def closing(self) -> trio.Event:
        return self.life.closing

    @property
    def drained(self) -> trio.Event:
        return self.life.drained

    def enter(self) -> None:
        """A request starts using this runtime (pair with :meth:`leave`)."""
        self.life.active += 1

    def leave(self) -> None:
        life = self.life
        life.active -= 1
        if life.retired and life.active == 0:
            life.drained.set()

    def retire(self) -> None:
        """A newer runtime serves new requests; this one finishes those it has."""
        life = self.life
        life.retired = True
        life.closing.set()
        if life.active == 0:
            life.drained.set()

    def resources(self) -> dict[int, Closer]:
        """What this runtime holds that must be closed once nobody uses it, by identity."""
        held: dict[int, Closer] = {id(a): a.aclose for a in self.adapters.values()}
        closer = self.cache_hold.closer
        if self.cache is not None and closer is not None:
            held[id(self.cache.backend)] = closer
        return held


class Held:
    """A resource opened, and later closed, in a task of its own in the app's nursery.

    A Redis client (coredis) enters a task group in the task that opens it and
    must be closed by that same task: a cache backend opened by a reload (in a
    request's task) and closed when its last generation drains (in another)
    lives in a holder task instead.
    """

    def __init__(self, open_: Callable[[], Awaitable[None]], close: Closer) -> None:
        self._open = open_
        self._close = close
        self._opened = trio.Event()
        self._error: Exception | None = None
        self._stop = trio.Event()
        self._done = trio.Event()

    async def start(self, nursery: trio.Nursery) -> None:
        """Open it in a new task of ``nursery`` (an error opening it is raised here).

        Not ``nursery.start``: that moves the task to ``nursery`` once it has
        started, and the task groups the opening entered would move with it.
        """
        nursery.start_soon(self._hold)
        await self._opened.wait()
        if self._error is not None:
            raise self._error

    async def _hold(self) -> None:
        try:
            try:
                await self._open()
            except Exception as exc:
                self._error = exc
                return
            finally:
                self._opened.set()
            await self._stop.wait()
        finally:
            # No shield here: a cancel scope opened now would sit inside the task
            # groups the close exits (Trio refuses that); the close is reached by
            # aclose(), not by a cancellation, unless the whole app is cancelled.
            try:
                await self._close()
            finally:
                self._done.set()

    async def aclose(self) -> None:
        """Close it (in its task) and wait until it is closed."""
        self._stop.set()
        await self._done.wait()


class Generations:
    """The runtimes still alive: the current one and the retired ones still draining."""

    def __init__(self) -> None:
        #: Set by :meth:`begin` (the gateway's first runtime), then by :meth:`swap`.
        self.current: Runtime
        self.live: list[Runtime] = []

    def begin(self, first: Runtime) -> None:
        """The first runtime: made before it, its handlers can read the current one."""
        assert not self.live, "a gateway has one first runtime"
        self.current = first
        self.live.append(first)

    def swap(self, new: Runtime) -> Runtime:
        """Make ``new`` current; returns the one it replaces (now retired)."""
        old, self.current = self.current, new
        self.live.append(new)
        old.retire()
        return old

    def unused(self, candidate: Runtime) -> list[Closer]:
        """Closers of what ``candidate`` holds and no live runtime does."""
        kept: set[int] = set()
        for rt in self.live:
            if rt is not candidate:
                kept.update(rt.resources())
        return [close for key, close in candidate.resources().items() if key not in kept]

    async def drain(self, old: Runtime) -> None:
        """Wait for ``old``'s last request, then close what only it used."""
        await old.drained.wait()
        closers = self.unused(old)
        self.live.remove(old)
        await close_all(closers)


async def close_all(closers: Iterable[Closer]) -> None:
    """Run each closer; one that fails is logged and the others still run."""
    for close in closers:
        try:
            await close()
        except Exception:
            log.exception("closing a resource of a retired configuration failed")


def carry_adapters(
    configs: Mapping[str, AdapterConfig],
    previous: Mapping[str, Adapter],
    previous_configs: Mapping[str, AdapterConfig],
    hook: UpstreamHook,
) -> tuple[dict[str, Adapter], list[Adapter]]:
    """The adapters of a new config, reusing each previous one whose settings did not change.

    An adapter is reused -- the same object, so its connection pool and a group's
    health windows carry on -- when its table is equal to the previous one's and,
    for a group, every member and fallback it names was reused too (a group holds
    its members' objects).

    Returns:
        (every adapter by name, the new ones, which still have to be opened).
    """
    out: dict[str, Adapter] = {}
    fresh: list[Adapter] = []
    groups: dict[str, GroupAdapterConfig] = {}
    for name, cfg in configs.items():
        if isinstance(cfg, GroupAdapterConfig):
            groups[name] = cfg
        elif name in previous and previous_configs.get(name) == cfg:
            out[name] = previous[name]
        else:
            out[name] = build_adapter(name, cfg, hook)
            fresh.append(out[name])
    # Groups last (a group may fall back to a group: those first); the config
    # was checked, so a pass always makes progress.
    while groups:
        ready = [n for n, g in groups.items() if all(f in out for f in g.fallbacks)]
        for name in ready:
            cfg = groups.pop(name)
            named = [d.adapter for d in cfg.deployments] + cfg.fallbacks
            same = (
                name in previous
                and isinstance(previous[name], GroupAdapter)
                and previous_configs.get(name) == cfg
                and all(out[m] is previous.get(m) for m in named)
            )
            if same:
                out[name] = previous[name]
            else:
                out[name] = build_adapters({name: cfg, **_members(cfg, configs)}, hook, out)[name]
                fresh.append(out[name])
    return out, fresh


def _members(
    cfg: GroupAdapterConfig, configs: Mapping[str, AdapterConfig]
) -> dict[str, AdapterConfig]:
    """The tables a group names (already built: ``build_adapters`` takes them as given)."""
    named = [d.adapter for d in cfg.deployments] + cfg.fallbacks
    return {n: configs[n] for n in named}
