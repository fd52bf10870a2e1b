"""Spend per budget period: in this worker, or shared by every worker and host in Redis.

:class:`Ledger` keeps one number per budget period (``key:alice:2026-12``).
With Redis (the session bus's, ``[sessions] backend = "redis"``) each charge is
an ``INCRBYFLOAT`` that expires with its period, and each check reads the
numbers back (one ``MGET``), so every gateway sees every gateway's spend.

A Redis outage never fails a request: a charge that cannot reach Redis is
kept in this worker (``aiserve_spend_ledger_local_total``), checks use the
last numbers read plus what is kept here, and the next charge that reaches
Redis -- or the background task, every few seconds -- merges the kept spend back
(``aiserve_spend_ledger_merged_total``).
While Redis is away, gateways do not see each other's new spend: the
overshoot bound then grows by what the other gateways charge meanwhile.

A lost period is re-seeded from the audit log (issue 55: Redis restarted without
persistence, a ``FLUSHALL``, a failover to a replica that missed writes, and a spent
key spent its budget again -- 0.0042 USD against 0.002). With a :attr:`Ledger.seed`
(the app sets it when ``[audit]`` is on), a charge reaches Redis only through a script
that adds to a key that exists; a period's key found missing -- by a check's ``MGET``,
a charge, or the merge after an outage -- is queued for :meth:`Ledger.run`, which sums
the period's ``cost`` from the audit database (one bounded query in the usage reads'
own limiter: ``audit/usage.py``) and writes it back with ``SET NX``: of two workers
that both noticed, one seeds, the other's charges then add to it. Nothing waits for the
database on the request path: until the seed is written, a check uses the last number
this worker read for the period (never lowered to 0 by a missing key), so a key known
spent stays refused; a worker that never read it admits for the reseed's lag (one
query). A charge made while the period is being re-seeded is kept here and merged
after; one whose audit row the sum already holds is then counted twice -- the spend
reads high by the requests of those milliseconds, never low. The memory ledger (no
Redis) seeds every budget's period from the audit log when the worker starts -- the
config's and the database keys' (:meth:`Ledger.seed_also`) -- so a restart does not
forget budgets either. A key's period is its tenant's key's (``key:TENANT/KEY:PERIOD``,
:attr:`~.budget.Limit.who`): a key id given again in another tenant inherits nothing.

Workers without Redis share spend through the audit database (issue 50, item 3): the
memory ledger re-reads every budget's period from it every :data:`SYNC_EVERY_S` (one
grouped query per scope and period, this worker's queued rows written first), and
keeps on top of the sum only the charges it made while the query ran. So a worker sees
another worker's spend at most ``[audit] flush_ms`` (the other's rows wait that long to
be written) + ``SYNC_EVERY_S`` + one query late -- 2 s and a query with the defaults;
meanwhile it admits as if the other had not charged. A read sums the whole period's
rows (about 2 s per million rows on SQLite): the next one waits :data:`SYNC_SHARE`
times as long as the last took when that is longer than ``SYNC_EVERY_S``, so the
database is read a tenth of the time at most, and the bound grows with the period's rows
(a million rows: 20 s). A charge made during the query
whose row the sum already holds is counted twice until the next read (high, never low);
a row this worker's flush could not write in time (a slow database) is missing from the
sum until the next read. Workers of several hosts share it the same way on PostgreSQL.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client import Counter, Gauge

from ..observability.metrics import label_value
from .budget import Window, window

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from .budget import Limit

log = logging.getLogger("aiserve_trio.spend")

#: Seconds a Redis call may take before the ledger goes on without it.
REDIS_TIMEOUT_S = 1.0
#: Kept a day past the end of its period (a late charge of the old period still lands).
EXPIRE_GRACE_S = 86_400
#: Seconds between two tries to merge spend kept during an outage (besides each charge).
MERGE_EVERY_S = 5.0
#: Seconds before a period whose re-seed failed (the audit database away or busy) is
#: tried again.
SEED_RETRY_S = 5.0
#: Seconds between two reads of every budget's spend from the audit log (the memory
#: ledger with a seed: how workers without Redis see each other's spend).
SYNC_EVERY_S = 1.0
#: ...or this many times as long as the last read took, if that is longer: a period's sum
#: costs about 2 s per million rows on SQLite, and reading stays a tenth of the time.
SYNC_SHARE = 10.0
#: Periods waiting for a re-seed at most (more are noticed again on a later read).
MAX_SEEDS_PENDING = 1024

#: ``(scope, who or None for every one, start, end) -> {who: cost}``: a period's spend
#: as the audit log holds it (:func:`aiserve_trio.audit.usage.period_spend`), ``who``
#: a :attr:`Limit.who` (a key as ``tenant/key``).
Seed = Callable[[str, "str | None", float, float], Awaitable[dict[str, float]]]

#: Add to a period's key only if it exists: a missing key is a lost period (or a new
#: one), to be seeded from the audit log first -- an INCRBYFLOAT would start it at 0.
_ADD_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 'absent' end
local v = redis.call('INCRBYFLOAT', KEYS[1], ARGV[1])
if ARGV[2] ~= '' then redis.call('EXPIREAT', KEYS[1], ARGV[2]) end
return v
"""


class LedgerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.used = Gauge(
            "aiserve_budget_used_ratio",
            "Share of the current period's budget spent (key or tenant, as last seen).",
            ["scope", "name"],
            registry=registry,
        )
        self.alert_at = Gauge(
            "aiserve_budget_alert_ratio",
            "budget_alert_at of each budget: aiserve_budget_used_ratio alerts from here.",
            ["scope", "name"],
            registry=registry,
        )
        self.local = Counter(
            "aiserve_spend_ledger_local",
            "Charges kept in this worker because Redis could not be reached.",
            registry=registry,
        )
        self.merged = Counter(
            "aiserve_spend_ledger_merged",
            "Charges kept in this worker during a Redis outage, merged back into Redis.",
            registry=registry,
        )

    def seen(self, limit: Limit, spent: float) -> None:
        ratio = spent / limit.amount if limit.amount > 0 else (1.0 if spent > 0 else 0.0)
        name = label_value(limit.name)  # tenant names may have dashes
        self.used.labels(limit.scope, name).set(ratio)
        self.alert_at.labels(limit.scope, name).set(limit.alert_at)


class Ledger:
    """Spend per budget period (see the module docstring)."""

    def __init__(
        self, redis_url: str | None = None, prefix: str = "aiserve", *,
        merge_every_s: float = MERGE_EVERY_S,
        metrics: LedgerMetrics | None = None,
        seed: Seed | None = None,
        limits: list[Limit] | None = None,
        sync_every_s: float = SYNC_EVERY_S,
    ) -> None:
        """Args:
        metrics: the ledger's gauges and counters (None: not counted).
        seed, limits: as :meth:`seed_from` sets them.
        """
        self._client: Any = None
        if redis_url is not None:
            from ..util.redisconn import client_for_url  # late: coredis is optional

            self._client = client_for_url(redis_url, 8, REDIS_TIMEOUT_S)
        self._prefix = prefix
        self._stack: AsyncExitStack | None = None
        #: Memory: the spend. Redis: spend not yet in Redis (kept during an outage).
        self._local: dict[str, float] = {}
        #: Redis: the numbers last read, used while Redis cannot be reached.
        self._seen: dict[str, float] = {}
        #: When each kept slot's period ends (for its expiry once merged).
        self._ends: dict[str, float] = {}
        #: Each kept slot's budget (a slot found missing at the merge is re-seeded).
        self._kept: dict[str, Limit] = {}
        self._down = False
        self._merge_every = merge_every_s
        self.metrics = metrics
        #: Where a lost period's spend is read from (the audit log); None: nowhere.
        self.seed = seed
        #: The budgets the memory ledger seeds at start (the gate's, set with the seed).
        self.limits: list[Limit] = limits if limits is not None else []
        #: More budgets to seed and re-read, as they are when read (the database keys').
        self._more: Callable[[], Iterable[Limit]] | None = None
        #: Periods to re-seed, by slot (Redis), and when each may be tried again.
        self._pending: dict[str, Limit] = {}
        self._retry_at: dict[str, float] = {}
        self._wake = trio.Event()
        #: Set once the memory ledger's start-up seed is done (or there is none).
        self.seeded = trio.Event()
        #: What the requests in flight in this worker hold against each slot (their
        #: maximum cost), and how many hold it.
        self._held: dict[str, float] = {}
        self._holders: dict[str, int] = {}
        #: The memory ledger: seconds between two reads of the audit log's sums.
        self.sync_every_s = sync_every_s
        #: Set (and replaced) each time a read of the audit log's sums is done.
        self._synced = trio.Event()
        self._script: Any = None
        if self._client is not None:
            self._script = self._client.register_script(_ADD_LUA)

    def seed_from(self, seed: Seed, limits: list[Limit]) -> None:
        """Re-seed lost periods with ``seed`` (the audit log's sums); the memory ledger
        also seeds ``limits`` (every budget of the config) when :meth:`run` starts."""
        self.seed = seed
        self.limits = limits

    def seed_also(self, more: Callable[[], Iterable[Limit]]) -> None:
        """Seed and re-read the budgets ``more()`` gives as well, whatever they are at each
        read: the database keys' (``security/keystore``), which come and go at runtime."""
        self._more = more

    def _all_limits(self) -> list[Limit]:
        return self.limits if self._more is None else [*self.limits, *self._more()]

    @property
    def shared(self) -> bool:
        return self._client is not None

    async def aopen(self) -> None:
        if self._client is not None:
            stack = AsyncExitStack()
            await stack.enter_async_context(self._client)
            self._stack = stack

    async def aclose(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    async def run(self) -> None:
        """Merge spend kept during an outage once Redis is back, also when no request
        charges anything, and re-seed lost periods from the audit log (in the app's
        background nursery; returns at once with neither Redis nor a seed)."""
        async with trio.open_nursery() as tasks:
            if self._client is not None:
                tasks.start_soon(self._merge_loop)
            if self.seed is not None:
                tasks.start_soon(self._seed_loop, self.seed)
            else:
                self.seeded.set()

    async def _merge_loop(self) -> None:
        while True:
            await trio.sleep(self._merge_every)
            if self._local:
                await self._merge()

    async def _seed_loop(self, seed: Seed) -> None:
        """The memory ledger's start-up seed, then (Redis) each lost period in turn."""
        if self._client is None:
            while True:  # the audit database may not be reached yet
                if await self._seed_all(seed, first=True):
                    break
                await trio.sleep(SEED_RETRY_S)
            self.seeded.set()
            took = 0.0
            while self.limits or self._more is not None:  # the others' spend, as written
                # Reading never takes more than a tenth of the time (a big period's sum).
                await trio.sleep(max(self.sync_every_s, SYNC_SHARE * took))
                began = trio.current_time()
                await self._seed_all(seed)  # a failed read: the next one
                took = trio.current_time() - began
                self._synced.set()
                self._synced = trio.Event()
            return
        self.seeded.set()
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            for slot, limit in list(self._pending.items()):
                del self._pending[slot]
                if not await self._reseed(seed, slot, limit):
                    now = trio.current_time()
                    if len(self._retry_at) >= MAX_SEEDS_PENDING:  # bounded: past waits go
                        self._retry_at = {s: t for s, t in self._retry_at.items() if t > now}
                    self._retry_at[slot] = now + SEED_RETRY_S

    def _lost(self, slot: str, limit: Limit) -> None:
        """Queue ``slot`` (missing in Redis) for a re-seed; never waits."""
        if self.seed is None or slot in self._pending or len(self._pending) >= MAX_SEEDS_PENDING:
            return
        if self._retry_at.get(slot, -math.inf) > trio.current_time():
            return
        self._retry_at.pop(slot, None)
        self._pending[slot] = limit
        self._wake.set()

    async def _read(self, seed: Seed, scope: str, name: str | None, period: Window) -> (
        dict[str, float] | None
    ):
        try:
            return await seed(scope, name, period.starts_at, period.resets_at)
        except Exception as exc:  # the database away, busy or slow: tried again later
            log.warning("spend: cannot read the %s spend from the audit log: %s", scope, exc)
            return None

    async def _reseed(self, seed: Seed, slot: str, limit: Limit) -> bool:
        """Write ``slot``'s spend back to Redis from the audit log, unless another worker
        did first (``SET NX``); False when the audit log or Redis did not answer."""
        now = time.time()
        w = window(limit.period, now)
        if limit.slot(now)[0] != slot:
            return True  # its period is over: the next read asks for the new one
        before = self._local.get(slot, 0.0)  # kept here: its rows are in the sum below
        found = await self._read(seed, limit.scope, limit.who, w)
        if found is None:
            return False
        total = found.get(limit.who, 0.0)
        from coredis.tokens import PureToken  # late: coredis only with Redis

        args: list[Any] = [self._key(slot), repr(total)]
        kwargs: dict[str, Any] = {"condition": PureToken.NX}
        if not math.isinf(w.resets_at):
            kwargs["exat"] = int(w.resets_at) + EXPIRE_GRACE_S
        done = await self._redis(lambda: self._client.set(*args, **kwargs))
        if self._down:
            return False
        if done:
            left = self._local.get(slot, 0.0) - before
            if left > 0:
                self._local[slot] = left
            else:
                self._local.pop(slot, None)
                self._ends.pop(slot, None)
                self._kept.pop(slot, None)
            self._seen[slot] = total
            log.warning(
                "spend: %s was missing in Redis (lost data?): re-seeded from the audit log, "
                "%.6f", slot, total,
            )  # fmt: skip
        if self._local and not self._down:
            await self._merge()
        return True

    async def synced(self) -> None:
        """Wait for the memory ledger's next read of the audit log's sums to be done."""
        await self._synced.wait()

    async def _seed_all(self, seed: Seed, *, first: bool = False) -> bool:
        """The memory ledger's start (``first``) and each read after it: every budget's
        current period from the audit log, one grouped query per scope and period, plus
        what this worker charged while it ran; False when the audit log did not answer."""
        now = time.time()
        groups: dict[tuple[str, str], list[Limit]] = {}
        for limit in self._all_limits():
            groups.setdefault((limit.scope, limit.period), []).append(limit)
        for (scope, period), limits in groups.items():
            w = window(limits[0].period, now)
            before = dict(self._local)
            found = await self._read(seed, scope, None, w)
            if found is None:
                return False
            for limit in limits:
                slot = limit.slot(now)[0]
                kept = self._local.get(slot, 0.0) - before.get(slot, 0.0)
                if (total := found.get(limit.who, 0.0) + kept) > 0:
                    self._local[slot] = total
            if first:
                log.info("spend: %d %s budgets (%s) seeded from the audit log", len(limits),
                         scope, period)  # fmt: skip
        return True

    def _key(self, slot: str) -> str:
        return f"{self._prefix}:spend:{slot}"

    async def spent(self, limits: list[Limit], now: float) -> list[float]:
        """The spend of each limit's current period."""
        slots = [limit.slot(now)[0] for limit in limits]
        if self._client is not None:
            values = await self._redis(self._client.mget, [self._key(s) for s in slots])
            if values is not None:
                for slot, value, limit in zip(slots, values, limits, strict=True):
                    if value is not None:
                        self._seen[slot] = float(value)
                    elif self.seed is not None:
                        # Lost (or new): keep the last number read -- a key known
                        # spent stays refused -- until the audit log's sum is back.
                        self._lost(slot, limit)
                    else:
                        self._seen[slot] = 0.0
        out = [self._seen.get(s, 0.0) + self._local.get(s, 0.0) for s in slots]
        if self.metrics is not None:
            for limit, used in zip(limits, out, strict=True):
                self.metrics.seen(limit, used)
        return out

    def held(self, limits: list[Limit], now: float) -> list[float]:
        """What this worker's requests in flight hold against each limit's period."""
        return [self._held.get(limit.slot(now)[0], 0.0) for limit in limits]

    def hold(self, limits: list[Limit], amount: float, now: float) -> Hold:
        """Hold ``amount`` against each limit's current period until the returned
        :class:`Hold` is let go (the request's real cost is charged meanwhile)."""
        slots = [limit.slot(now)[0] for limit in limits] if amount > 0 else []
        for slot in slots:
            self._held[slot] = self._held.get(slot, 0.0) + amount
            self._holders[slot] = self._holders.get(slot, 0) + 1
        return Hold(self, slots, amount)

    def _let_go(self, slots: list[str], amount: float) -> None:
        for slot in slots:
            left = self._holders.get(slot, 0) - 1
            if left > 0:
                self._holders[slot] = left
                self._held[slot] = max(0.0, self._held.get(slot, 0.0) - amount)
            else:  # the last one: no float dust left behind
                self._holders.pop(slot, None)
                self._held.pop(slot, None)

    async def charge(self, limits: list[Limit], amount: float, now: float) -> None:
        """Add ``amount`` to each limit's current period."""
        if amount <= 0 or not limits:
            return
        for limit in limits:
            slot, w = limit.slot(now)
            added = self._client is not None and await self._add(slot, amount, w.resets_at)
            if not added:
                self._local[slot] = self._local.get(slot, 0.0) + amount
                self._ends[slot] = w.resets_at
                self._kept[slot] = limit
                if self._client is not None and self._down and self.metrics is not None:
                    self.metrics.local.inc()
                if self._client is not None and not self._down:
                    self._lost(slot, limit)  # reached Redis, and the period's key is missing
            used = self._seen.get(slot, 0.0) + self._local.get(slot, 0.0)
            if self.metrics is not None:
                self.metrics.seen(limit, used)
        if self._client is not None and self._local and not self._down:
            await self._merge()

    async def _add(self, slot: str, amount: float, ends: float) -> bool:
        """Add ``amount`` to ``slot`` in Redis; False when Redis is away or (with a seed)
        the key is missing -- :attr:`_down` tells which."""
        key = self._key(slot)
        if self.seed is not None:
            expire = "" if math.isinf(ends) else str(int(ends) + EXPIRE_GRACE_S)
            value = await self._redis(
                lambda: self._script(keys=[key], args=[repr(amount), expire])
            )
            if value is None or value in ("absent", b"absent"):
                return False
            self._seen[slot] = float(value)
            return True
        value = await self._redis(self._client.incrbyfloat, key, amount)
        if value is None:
            return False
        self._seen[slot] = float(value)
        if not math.isinf(ends):
            await self._redis(self._client.expireat, key, int(ends) + EXPIRE_GRACE_S)
        return True

    async def _merge(self) -> None:
        """Move the spend kept during an outage into Redis."""
        merged = 0
        for slot in list(self._local):
            amount = self._local.pop(slot)
            ends = self._ends.pop(slot, math.inf)
            if not await self._add(slot, amount, ends):
                self._local[slot] = self._local.get(slot, 0.0) + amount
                self._ends[slot] = ends
                if self._down:
                    return
                if (limit := self._kept.get(slot)) is not None:
                    self._lost(slot, limit)  # Redis came back without it
                continue  # missing in Redis: merged once it is re-seeded
            merged += 1
            self._kept.pop(slot, None)
            if self.metrics is not None:
                self.metrics.merged.inc()
        if merged:
            log.info("spend: the charges kept during the Redis outage are merged back")

    async def _redis(self, call: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """``call(*args)``, or None when Redis fails or is slower than the timeout."""
        from coredis.exceptions import RedisError  # late: coredis only with Redis

        try:
            with trio.move_on_after(REDIS_TIMEOUT_S):
                result = await call(*args)
                if self._down:
                    log.info("spend: Redis answers again")
                self._down = False
                return result
        except (RedisError, OSError, TimeoutError) as exc:
            if not self._down:
                log.warning("spend: Redis cannot be reached, spend is kept locally: %s", exc)
            self._down = True
            return None
        self._down = True
        return None


class Hold:
    """A request's reservation against its budgets (:meth:`Ledger.hold`), let go once
    when the request ends: ``with hold: ...`` or :meth:`release`."""

    __slots__ = ("_amount", "_ledger", "_slots")

    def __init__(self, ledger: Ledger | None, slots: list[str], amount: float) -> None:
        self._ledger = ledger
        self._slots = slots
        self._amount = amount

    def release(self) -> None:
        ledger, self._ledger = self._ledger, None
        if ledger is not None and self._slots:
            ledger._let_go(self._slots, self._amount)

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


#: The hold of a request that holds nothing (no budget, or not a chat request).
NO_HOLD = Hold(None, [], 0.0)
