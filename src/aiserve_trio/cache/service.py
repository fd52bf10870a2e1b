"""The response cache as the request path uses it: admit, serve, release.

One :class:`Cache` per app. For a request on a route with ``cache``:

- the context stage calls :meth:`Cache.admit` once the upstream request is
  known: it decides (``Cache-Control``, deterministic or not, the route's
  models), computes the key, and returns a :class:`Ticket`: a stored entry
  (*hit*), membership of the flight answering that key (joined or started), or
  *bypass*;
- the inference stage replays the entry, or calls :meth:`Cache.serve`, which
  reads the flight's log as its pieces come; the first member to get there
  launches the flight with a *producer* (the model through the route's output
  filters, built by the stage) that runs in the app's nursery -- not in any one
  request -- so the requests sharing the answer do not depend on the one that
  asked first: its client may go away, or read slowly, and the others still
  get every piece at their own pace;
- the pipeline calls :meth:`Cache.release` when the request ends; the last
  member to leave an unfinished flight cancels it.

A flight that finishes cleanly is stored before it is forgotten, so a request
arriving meanwhile either joins it or finds the entry. That is local single
flight; with a shared backend (Redis) a flight is first handed to
``remote.SharedFlight``, which claims the key across gateways (the entry, a
lease, or another gateway's answer to follow).

On a route with a semantic tier, an exact miss is looked up once more by the
meaning of its question, under a guard of everything else (``semantic.py``).

The backend is never in the way: every call is bounded (``remote.BackendCalls``),
a failure is counted and the request goes on without the cache, and after a
failure the backend is skipped for ``retry_ms``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from ..adapters.retry import is_retryable
from ..core.errors import GatewayError, InternalError, UpstreamError
from ..core.slices import run_sliced
from ..observability.events import NULL_HOOK, CacheHook
from .backend import CacheBackend, MemoryBackend
from .entry import (
    Entry,
    Replayed,
    encode,
    new_entry,
    why_not_stored,
)
from .errors import CacheUnavailable, FlightLate
from .flight import Flight, FlightState, FlightTable, Producer
from .key import (
    RouteScope,
    adapter_version,
    deterministic,
    directives,
    policy_version,
    request_key_steps,
)
from .remote import BackendCalls, SharedFlight, SharedIndex, Storing
from .semantic import Probe, Semantic

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ..adapters.base import Adapter, DeltaSink, InferenceRequest
    from ..config import Config
    from ..routes import RouteConfig
    from .settings import CacheConfig, RouteCache

log = logging.getLogger("aiserve_trio.cache")
PACKS_PACKAGE = "aiserve_trio.policies.packs"


@dataclass(frozen=True, slots=True)
class RouteCachePlan:
    """A route's cache settings and the parts of its keys fixed at start-up."""

    label: str
    settings: RouteCache
    scope: RouteScope
    #: The longest inference budget a request on the route can have (seconds): how
    #: long the backend is told a shared answer may take; the flight itself ends
    #: at the latest deadline of the requests sharing it.
    longest: float
    #: The adapter that embeds questions for the semantic tier (``settings.semantic``).
    embedder: Adapter | None = None


class Member:
    """One request's share of a flight; :meth:`leave` when the request ends."""

    __slots__ = ("_cache", "flight", "launcher", "left")

    def __init__(self, cache: Cache, flight: Flight) -> None:
        self._cache = cache
        self.flight = flight
        self.left = False
        #: It launched :attr:`flight` (the upstream call): the call is billed to it.
        self.launcher = False

    def leave(self) -> None:
        if self.left:
            return
        self.left = True
        flight = self.flight
        if self._cache.flights.leave(flight) and flight.scope is not None:
            flight.scope.cancel(reason="every request sharing the answer went away")

    def move(self, flight: Flight) -> None:
        """Share ``flight`` instead (the one this member had failed)."""
        self._cache.flights.leave(self.flight)
        self.flight = flight
        self._cache.flights.join(flight)


@dataclass(frozen=True, slots=True)
class Ticket:
    """What one request does with the cache (the context stage's decision)."""

    route: str
    #: ``hit`` (``entry`` is set), ``bypass``, or ``flight`` (``member`` is set;
    #: hit, miss or coalesced is known once the first piece arrives).
    result: str
    plan: RouteCachePlan | None = None
    entry: Entry | None = None
    member: Member | None = None
    #: ``semantic-hit``: the cosine similarity of the stored question.
    similarity: float | None = None


class Cache:
    """The routes' response caches and their single flights (see the module docstring)."""

    def __init__(
        self,
        config: CacheConfig,
        routes: dict[str, RouteCachePlan],
        backend: CacheBackend,
        hook: CacheHook = NULL_HOOK,
    ) -> None:
        self.config = config
        #: By route path.
        self.routes = routes
        self.hook = hook
        self.flights = FlightTable()
        self._nursery: trio.Nursery | None = None
        #: The server's counters as last read (Redis ``INFO stats``).
        self.server: dict[str, float] = {}
        self._stats = trio.CancelScope()
        self.semantic = Semantic(
            config.semantic_max_entries, hook, max_bytes=config.semantic_max_bytes
        )
        self.backend = backend

    @property
    def backend(self) -> CacheBackend:
        return self._backend

    @backend.setter
    def backend(self, backend: CacheBackend) -> None:
        self._backend = backend
        # An entry evicted from this worker's memory takes its semantic question along.
        backend.on_evict(self.semantic.evicted)
        #: Every backend call, bounded (and the backend skipped a while after a failure).
        self._call = BackendCalls(backend, self.config, self.hook)
        #: With a shared backend: single flight across gateways, and the semantic
        #: index's log that every worker follows (``remote.py``).
        self.shared = SharedFlight(self._call) if backend.shared else None
        self.index_log = SharedIndex(self._call, self.semantic) if backend.shared else None

    # --- the app's lifetime -----------------------------------------------------

    async def aopen(self, nursery: trio.Nursery) -> None:
        """Connect the backend; flights (and the stats loop) run in ``nursery``."""
        await self.backend.aopen()
        self._nursery = nursery
        if self.backend.shared:
            nursery.start_soon(self._stats_loop)
            if self.index_log is not None and self._needs_follower():
                self.semantic.share = self.index_log.share
                await nursery.start(self.index_log.follow)

    def successor(self, routes: dict[str, RouteCachePlan]) -> Cache:
        """The cache of a reloaded config whose ``[cache]`` did not change: the same
        backend (open already) and its entries -- a key carries its route's adapter
        and policy versions, so an entry is never served for settings that changed
        -- with these route plans and flights of its own."""
        nxt = Cache(self.config, routes, self.backend, self.hook)
        nxt._nursery = self._nursery
        nxt.server = self.server
        nxt._stats = self._stats
        nxt.semantic = self.semantic
        nxt.backend.on_evict(nxt.semantic.evicted)  # the index kept, not the one just made
        nxt.index_log = self.index_log
        if nxt.index_log is not None and nxt._needs_follower() and nxt._nursery is not None:
            # A reload turned the semantic tier on: follow the shared index from now
            # (its catch-up runs in the background; the app is serving already).
            nxt.semantic.share = nxt.index_log.share
            nxt._nursery.start_soon(nxt.index_log.follow)
        return nxt

    async def aclose(self) -> None:
        self._nursery = None
        self._stats.cancel(reason="app shutdown")
        if self.index_log is not None:
            self.index_log.scope.cancel(reason="app shutdown")
        await self.backend.aclose()

    def held(self) -> tuple[int, int]:
        """(bytes, entries) this process holds (0, 0 for a shared backend)."""
        return self.backend.held() or (0, 0)

    def semantic_held(self) -> tuple[int, int]:
        """(bytes, questions) of this worker's semantic index, as it counts them
        (``[cache] semantic_max_bytes`` bounds the bytes; with either backend)."""
        return self.semantic.index.bytes, len(self.semantic.index)

    async def _stats_loop(self) -> None:
        """Read the server's counters (Redis ``INFO stats``) every ``stats_interval_s``."""
        with self._stats:
            while True:
                with contextlib.suppress(CacheUnavailable):
                    # In place: a successor (a reloaded config) shares this dict.
                    self.server.update(await self._call("stats", self.backend.server_stats))
                await trio.sleep(self.config.stats_interval_s)

    # --- the semantic index, shared through the backend ------------------------------

    def _needs_follower(self) -> bool:
        """A shared backend, a route with a semantic tier, and no follower yet."""
        return (
            self.index_log is not None
            and self.semantic.share is None
            and any(p.settings.semantic is not None for p in self.routes.values())
        )

    # --- the context stage --------------------------------------------------------

    async def admit(
        self,
        *,
        path: str,
        tenant: str,
        channel: str,
        cache_control: str | None,
        temperature: float | None,
        request: InferenceRequest,
        deadline: float,
        request_id: str = "",
    ) -> Ticket | None:
        """Decide what ``request`` does with the cache; None when its route has none.

        Args:
            request: as it goes upstream (session context in, input policies
                applied, fitted to the window); its ``deadline`` (the inference
                cut) is how long a flight it shares may last for it.
            deadline: the lookup gives up at this time (the context stage's cut).
        """
        plan = self.routes.get(path)
        if plan is None:
            return None
        s = plan.settings
        asked = directives(cache_control)
        if (
            asked.no_store
            or (s.models and request.model not in s.models)
            or (s.deterministic_only and not deterministic(temperature, request.extra.get("seed")))
        ):
            return Ticket(plan.label, "bypass", plan)
        # Sliced: the material may be a megabyte of tools and messages (issue 51).
        key = await run_sliced(
            request_key_steps(
                plan.scope,
                tenant=tenant,
                channel=channel,
                model=request.model,
                messages=[m.to_raw() for m in request.messages],
                fields=request.extra,
                max_tokens=request.max_tokens,
                variables=request.variables,
            )
        )
        if asked.no_cache:
            return self._member(plan, self.flights.start(key, fresh=True), request.deadline)
        flight = self.flights.find(key)
        if flight is None:
            entry = await self._lookup(key, deadline)
            if entry is not None:
                return Ticket(plan.label, "hit", plan, entry=entry)
            probe: Probe | None = None
            if plan.embedder is not None and s.semantic is not None:
                probe = await self.semantic.probe(
                    s.semantic,
                    plan.embedder,
                    plan.scope,
                    request_id=request_id,
                    tenant=tenant,
                    channel=channel,
                    request=request,
                    deadline=deadline,
                )
                if probe is not None:
                    ticket = await self._semantic(plan, probe, deadline, tenant)
                    if ticket is not None:
                        return ticket
            # Looked again after the wait: another request may have started it.
            flight = self.flights.find(key) or self.flights.start(key)
            if flight.probe is None:
                flight.probe = probe
        if flight.log.state is FlightState.DONE:
            # Finished, and being stored: that is an entry already.
            entry = Entry(pieces=flight.log.pieces, route=plan.label)
            return Ticket(plan.label, "hit", plan, entry=entry)
        return self._member(plan, flight, request.deadline)

    async def _semantic(
        self, plan: RouteCachePlan, probe: Probe, deadline: float, tenant: str
    ) -> Ticket | None:
        """A semantic hit for ``probe``: the nearest question under its guard at or
        above the threshold, whose entry is still there."""
        assert plan.settings.semantic is not None
        found = await self.semantic.search(probe)
        if not self.semantic.observe(plan.label, found, plan.settings.semantic.threshold):
            return None
        assert found is not None
        entry: Entry | None = None
        looked = False
        if deadline > trio.current_time():
            with contextlib.suppress(CacheUnavailable), trio.move_on_at(deadline):
                entry = await self._call("get", partial(self.backend.get, found.key))
                looked = True
        if entry is None:
            if looked:  # gone (TTL, eviction): its question goes too
                self.semantic.forget(probe, found)
            return None
        self.semantic.served(plan.label, probe, found, tenant)
        return Ticket(plan.label, "semantic-hit", plan, entry=entry, similarity=found.similarity)

    def _member(self, plan: RouteCachePlan, flight: Flight, until: float) -> Ticket:
        self.flights.join(flight)
        # It lasts as long as the latest of its members needs, whoever launched it
        # (within what the backend was told when it was).
        flight.deadline = max(flight.deadline, until)
        if flight.scope is not None:
            flight.scope.deadline = min(max(flight.scope.deadline, until), flight.limit)
        return Ticket(plan.label, "flight", plan, member=Member(self, flight))

    async def _lookup(self, key: str, deadline: float) -> Entry | None:
        if deadline <= trio.current_time():
            return None  # no time left to look (a request going on degraded)
        try:
            with trio.move_on_at(deadline):
                return await self._call("get", partial(self.backend.get, key))
        except CacheUnavailable:
            return None
        self.hook.cache_error("get")  # the context stage's time ran out first
        return None

    # --- the inference stage ------------------------------------------------------

    @staticmethod
    async def replay(
        entry: Entry, out: DeltaSink, result: str = "hit", similarity: float | None = None
    ) -> str:
        """Send a stored reply's pieces; the first says ``result`` (``hit`` or
        ``semantic-hit``, with the similarity)."""
        pieces = entry.pieces
        await out.send(msgspec.structs.replace(pieces[0], cache=result, similarity=similarity))
        for piece in pieces[1:]:
            await out.send(piece)
        return result

    async def follow(
        self,
        ticket: Ticket,
        produce: Producer,
        deadline: float,
        out: DeltaSink,
        result: Callable[[str], None],
    ) -> None:
        """Send the answer of the ticket's flight into ``out`` as its pieces come.

        The first member to get here launches the flight with ``produce``, in
        the app's nursery, until the latest inference deadline of its members
        (extended as members join), telling the backend the longest a request
        on the route may take. ``result`` is told this request's cache result (``miss``,
        ``hit``, ``coalesced``, ``bypass``) as soon as it is known -- before the
        first piece is sent, which carries it.

        A flight that fails before this request got any of it is taken over (a
        new flight, launched by the first member to see the failure, joined by
        the others) when it ran out of the time the backend was given while this
        request still has some, or, once, when the upstream failed in a way worth
        another try; otherwise its error is this request's.

        Args:
            deadline: this request's inference deadline.

        Raises:
            GatewayError: the flight failed (its error), or SharedReplyLost.
        """
        member = ticket.member
        assert member is not None
        assert ticket.plan is not None
        told = False
        cursor = 0
        while True:
            flight = member.flight
            launcher = member.launcher = not flight.launched
            if launcher:
                flight.launched = True
                flight.limit = trio.current_time() + ticket.plan.longest
                # Made here, entered by the flight's task: members joining before
                # that task first runs extend it too.
                flight.scope = trio.CancelScope(
                    deadline=min(max(flight.deadline, deadline), flight.limit)
                )
                self._spawn(self._fly, flight, ticket.plan, produce)
            # What it is as long as nothing has arrived (hit once the store answers).
            result(("bypass" if flight.fresh else "miss") if launcher else "coalesced")
            log_ = flight.log
            while True:
                pieces = log_.since(cursor)
                if pieces and not told:
                    told = True
                    first = _result_of(flight, launcher)
                    result(first)
                    pieces = [msgspec.structs.replace(pieces[0], cache=first), *pieces[1:]]
                for piece in pieces:
                    await out.send(piece)
                cursor += len(pieces)
                if log_.state is FlightState.DONE and cursor == len(log_.pieces):
                    return
                if log_.state is FlightState.FAILED:
                    break
                await flight.wait(cursor)
            err = log_.error
            assert err is not None
            if cursor or not _may_take_over(flight, err, deadline):
                raise err
            member.move(self.flights.find(flight.key) or self._successor(flight))

    def _successor(self, failed: Flight) -> Flight:
        new = self.flights.start(failed.key, fresh=failed.fresh)
        new.generation = failed.generation + 1
        return new

    def _spawn(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Start a flight in the nursery the cache was opened with (the app's).

        Spawned from the launching request's task: the flight inherits its context
        (trace span, task label, upstream read counter).

        Raises:
            RuntimeError: the cache was not opened (:meth:`aopen`): a flight would
                have no owner.
        """
        if self._nursery is None:
            raise RuntimeError("the response cache is not open: flights need its nursery (aopen)")
        self._nursery.start_soon(fn, *args)

    # --- the pipeline -------------------------------------------------------------

    @staticmethod
    def release(ticket: Ticket | None) -> None:
        if ticket is not None and ticket.member is not None:
            ticket.member.leave()

    @staticmethod
    async def paid(ticket: Ticket | None) -> list[Replayed] | None:
        """Leave the ticket's flight (as :meth:`release`, if not yet); for the request that
        launched it, what the upstream call produced, the call being billed to it (issue 50,
        item 2): a launcher that leaves while the flight goes on for other members
        waits for its end (shielded, at most until the time the backend was given),
        so that one upstream call is paid once, in full, by the request that asked for
        it. None for any other request (a member that joined pays nothing)."""
        if ticket is None or (member := ticket.member) is None:
            return None
        flight = member.flight
        member.leave()
        if not member.launcher:
            return None
        with trio.CancelScope(shield=True), trio.move_on_at(flight.limit):
            while not flight.log.ended and flight.members > 0:
                await flight.wait(len(flight.log.pieces))
        if flight.log.source != "model":
            return None  # answered from the store or by another gateway: no call made
        return flight.log.pieces

    # --- a flight -----------------------------------------------------------------

    async def _fly(self, flight: Flight, plan: RouteCachePlan, produce: Producer) -> None:
        """Produce (or find, or follow) the answer for every member, then store it."""
        assert flight.scope is not None
        try:
            with flight.scope as scope:
                if flight.members == 0:
                    scope.cancel(reason="every request sharing the answer went away")
                await self._answer(flight, plan, produce, flight.limit)
            if scope.cancelled_caught and not flight.log.ended:
                self._fail(flight, FlightLate())
        except GatewayError as err:
            self._fail(flight, err)
        except Exception as exc:  # a bug: members get a 500, the app goes on
            log.exception("a cache flight failed inside the gateway", exc_info=exc)
            self._fail(flight, InternalError("the gateway failed while serving this request"))
        finally:
            if not flight.log.ended:  # the app is shutting down
                self._fail(flight, InternalError("the gateway is shutting down"))
            self.flights.remove(flight)

    def _fail(self, flight: Flight, err: GatewayError) -> None:
        if flight.log.fail(err):
            # Gone for new requests at once: they start afresh, not with this error.
            self.flights.remove(flight)
            flight.changed()

    async def _answer(
        self, flight: Flight, plan: RouteCachePlan, produce: Producer, until: float
    ) -> None:
        if self.shared is not None and await self.shared.answer(
            flight, produce, until, self._storing(flight, plan)
        ):
            return
        # Alone: no shared backend, or it failed (the other gateways are not asked).
        capped = await produce(partial(flight.publish, source="model"), until)
        flight.finish()
        await self._store(flight, plan, capped)

    def _storing(self, flight: Flight, plan: RouteCachePlan) -> Storing:
        async def stored() -> None:
            self.hook.cache_stored(plan.label, "stored")
            await self._file(flight, plan)

        def blob(capped: str | None) -> bytes | None:
            made = self._entry(flight, plan, capped)
            return made[1] if made is not None else None

        return Storing(
            ttl_s=plan.settings.ttl_s,
            max_bytes=plan.settings.max_entry_bytes,
            blob=blob,
            stored=stored,
            fail=partial(self._fail, flight),
        )

    def _entry(
        self, flight: Flight, plan: RouteCachePlan, capped: str | None
    ) -> tuple[Entry, bytes] | None:
        """The entry to store for a finished flight, and its encoding; None (counted)
        when it must not be stored."""
        pieces = flight.log.pieces
        why = "capped" if capped is not None else why_not_stored(pieces)
        if why is None:
            entry = new_entry(pieces, plan.label)
            blob = encode(entry)
            if len(blob) <= plan.settings.max_entry_bytes:
                return entry, blob
            why = "too_large"
        self.hook.cache_stored(plan.label, why)
        return None

    async def _store(self, flight: Flight, plan: RouteCachePlan, capped: str | None) -> None:
        made = self._entry(flight, plan, capped)
        if made is None:
            return
        entry, blob = made
        ttl = plan.settings.ttl_s
        try:
            await self._call("put", partial(self.backend.put, flight.key, entry, blob, ttl))
        except CacheUnavailable:
            return
        self.hook.cache_stored(plan.label, "stored")
        await self._file(flight, plan)

    async def _file(self, flight: Flight, plan: RouteCachePlan) -> None:
        """File the stored entry's question in the semantic index (and share it)."""
        if isinstance(flight.probe, Probe):
            await self.semantic.insert(flight.probe, flight.key, plan.settings.ttl_s)


def _may_take_over(flight: Flight, err: GatewayError, deadline: float) -> bool:
    """Whether a member that got nothing of a failed flight should try a new one."""
    if trio.current_time() >= deadline:
        return False
    if isinstance(err, FlightLate):
        return True  # it had less time than this request has
    # Once: the adapter has already retried what it could before its first token.
    return flight.generation == 0 and isinstance(err, UpstreamError) and is_retryable(err)


def _result_of(flight: Flight, launcher: bool) -> str:
    source = flight.log.source
    if source == "store":
        return "hit"
    if not launcher or source == "remote":
        return "coalesced"
    return "bypass" if flight.fresh else "miss"


# --- building it ----------------------------------------------------------------------


def _pack_bytes(ref: str, base_dir: str) -> bytes:
    """The bytes of a policy's rule pack, found as ``policies.base.read_pack`` finds it
    (a shipped pack's name, or a file relative to the config). b"" if unreadable:
    the policy has already been built from it, so that does not happen."""
    try:
        if "/" in ref or ref.endswith(".toml"):
            path = Path(ref)
            if not path.is_absolute():
                path = Path(base_dir) / path
            return path.read_bytes()
        return (resources.files(PACKS_PACKAGE) / f"{ref}.toml").read_bytes()
    except OSError:
        return b""


def route_plan(
    route: RouteConfig,
    label: str,
    config: Config,
    adapters: Mapping[str, Adapter] | None = None,
) -> RouteCachePlan | None:
    """The cache plan of a route, or None when it has no cache.

    Args:
        adapters: the app's adapters, by name (the semantic tier's embedder is one).
    """
    settings = route.cache
    if settings is None or not settings.enabled:
        return None
    specs: list[tuple[str, str, Any, bytes]] = []
    for name in route.policies:
        spec = config.policy_specs.get(name)
        if spec is None:
            specs.append((name, name, None, b""))
            continue
        pack = getattr(spec.settings, "pack", None)
        data = _pack_bytes(pack, config.base_dir) if isinstance(pack, str) else b""
        specs.append((name, spec.kind, spec.settings, data))
    scope = RouteScope(
        route=route.path,
        adapter=route.adapter,
        adapter_version=adapter_version(route.adapter, config.adapters[route.adapter]),
        policy_version=policy_version(specs),
        per_channel=bool(route.policies),
    )
    max_ms = route.deadline.max_ms or config.deadline.max_ms
    shares = config.budgets.context + config.budgets.inference
    longest = (max_ms - config.deadline.reserve_ms) / 1000.0 * shares
    sem = settings.semantic
    embedder = adapters.get(sem.embeddings) if sem is not None and adapters else None
    return RouteCachePlan(
        label=label, settings=settings, scope=scope, longest=longest, embedder=embedder
    )


def cache_plans(
    config: Config, labels: dict[str, str], adapters: Mapping[str, Adapter] | None = None
) -> dict[str, RouteCachePlan]:
    """The cache plan of every route that has a cache, by path.

    Args:
        labels: each route's label, by path.
        adapters: the app's adapters, by name.
    """
    plans = {}
    for route in config.routes:
        plan = route_plan(route, labels[route.path], config, adapters)
        if plan is not None:
            plans[route.path] = plan
    return plans


def build_cache(
    config: Config,
    labels: dict[str, str],
    hook: CacheHook = NULL_HOOK,
    adapters: Mapping[str, Adapter] | None = None,
) -> Cache | None:
    """The app's cache, or None when no route has one.

    Args:
        labels: each route's label, by path.
        adapters: the app's adapters, by name (the semantic tier embeds with them).
    """
    plans = cache_plans(config, labels, adapters)
    if not plans:
        return None
    cc = config.cache
    backend: CacheBackend
    if cc.backend == "redis":
        from .redis import RedisBackend  # late: coredis is only needed for this backend

        backend = RedisBackend(cc, cc.url or config.sessions.url)
    else:
        backend = MemoryBackend(cc.max_bytes)
    return Cache(cc, plans, backend, hook)
