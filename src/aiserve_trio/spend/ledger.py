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
"""

from __future__ import annotations

import logging
import math
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client import Counter, Gauge

from ..observability.metrics import label_value

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
    ) -> None:
        self._client: Any = None
        if redis_url is not None:
            from ..sessions.redis_streams import client_for_url  # late: coredis is optional

            self._client = client_for_url(redis_url, 8, REDIS_TIMEOUT_S)
        self._prefix = prefix
        self._stack: AsyncExitStack | None = None
        #: Memory: the spend. Redis: spend not yet in Redis (kept during an outage).
        self._local: dict[str, float] = {}
        #: Redis: the numbers last read, used while Redis cannot be reached.
        self._seen: dict[str, float] = {}
        #: When each kept slot's period ends (for its expiry once merged).
        self._ends: dict[str, float] = {}
        self._down = False
        self._merge_every = merge_every_s
        self.metrics: LedgerMetrics | None = None

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
        charges anything (in the app's background nursery; returns at once without Redis)."""
        if self._client is None:
            return
        while True:
            await trio.sleep(self._merge_every)
            if self._local:
                await self._merge()

    def _key(self, slot: str) -> str:
        return f"{self._prefix}:spend:{slot}"

    async def spent(self, limits: list[Limit], now: float) -> list[float]:
        """The spend of each limit's current period."""
        slots = [limit.slot(now)[0] for limit in limits]
        if self._client is not None:
            values = await self._redis(self._client.mget, [self._key(s) for s in slots])
            if values is not None:
                for slot, value in zip(slots, values, strict=True):
                    self._seen[slot] = float(value) if value is not None else 0.0
        out = [self._seen.get(s, 0.0) + self._local.get(s, 0.0) for s in slots]
        if self.metrics is not None:
            for limit, used in zip(limits, out, strict=True):
                self.metrics.seen(limit, used)
        return out

    async def charge(self, limits: list[Limit], amount: float, now: float) -> None:
        """Add ``amount`` to each limit's current period."""
        if amount <= 0 or not limits:
            return
        for limit in limits:
            slot, w = limit.slot(now)
            if self._client is None or not await self._add(slot, amount, w.resets_at):
                self._local[slot] = self._local.get(slot, 0.0) + amount
                self._ends[slot] = w.resets_at
                if self._client is not None and self.metrics is not None:
                    self.metrics.local.inc()
            used = self._seen.get(slot, 0.0) + self._local.get(slot, 0.0)
            if self.metrics is not None:
                self.metrics.seen(limit, used)
        if self._client is not None and self._local and not self._down:
            await self._merge()

    async def _add(self, slot: str, amount: float, ends: float) -> bool:
        key = self._key(slot)
        value = await self._redis(self._client.incrbyfloat, key, amount)
        if value is None:
            return False
        self._seen[slot] = float(value)
        if not math.isinf(ends):
            await self._redis(self._client.expireat, key, int(ends) + EXPIRE_GRACE_S)
        return True

    async def _merge(self) -> None:
        """Move the spend kept during an outage into Redis."""
        for slot in list(self._local):
            amount = self._local.pop(slot)
            if not await self._add(slot, amount, self._ends.pop(slot, math.inf)):
                self._local[slot] = self._local.get(slot, 0.0) + amount
                return
            if self.metrics is not None:
                self.metrics.merged.inc()
        log.info("spend: the charges kept during the Redis outage are merged back")

    async def _redis(self, call: Any, *args: Any) -> Any:
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
