"""Per-key rate limits: token buckets on requests and on tokens.

Each API key may have ``rpm`` (requests per minute) and ``tpm`` (prompt +
completion tokens per minute). Both are token buckets holding a minute's worth
and refilling continuously. A request takes one from the request bucket and is
admitted only while the token bucket is not in debt; once the reply is done its
real token count is charged, which may put the bucket into debt (the count is
not known up front), so the next request waits until it is paid back.

:func:`decide` is the arithmetic (sans-IO). :class:`MemoryLimiter` keeps the
buckets in this worker; :class:`RedisLimiter` keeps them in Redis and runs the
same arithmetic in one Lua script (one atomic round trip) so that every worker
and every instance shares them.
"""

from __future__ import annotations

import math
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import trio

from ..core.errors import RateLimited

if TYPE_CHECKING:
    from .auth import Principal

WINDOW_S = 60.0


@dataclass(slots=True)
class Bucket:
    """A token bucket's level at time ``at`` (seconds, any monotonic clock)."""

    level: float
    at: float

    def refill(self, now: float, per_minute: int) -> None:
        rate = per_minute / WINDOW_S
        self.level = min(float(per_minute), self.level + max(0.0, now - self.at) * rate)
        self.at = now


def decide(req_level: float | None, tok_level: float | None, rpm: int, tpm: int) -> float:
    """Seconds to wait before a request may go (0: it may go now).

    Args:
        req_level: the refilled request bucket (``None``: no request limit).
        tok_level: the refilled token bucket (``None``: no token limit).
    """
    wait = 0.0
    if req_level is not None and req_level < 1.0:
        wait = (1.0 - req_level) * WINDOW_S / rpm
    if tok_level is not None and tok_level <= 0.0:
        # Until the debt is paid back and one token is available again.
        wait = max(wait, (1.0 - tok_level) * WINDOW_S / tpm)
    return wait


def limited(wait: float, principal: Principal) -> RateLimited:
    """The 429 for a request that must wait ``wait`` seconds."""
    secs = max(1, math.ceil(wait))
    return RateLimited(
        f"rate limit for API key {principal.key_id!r} reached; retry in {secs} s",
        headers={"Retry-After": str(secs)},
    )


class Limiter(Protocol):
    """Where the buckets live."""

    async def admit(self, principal: Principal) -> None:
        """Take one request; raises RateLimited (429, ``Retry-After``) if it must wait."""

    async def charge(self, principal: Principal, tokens: int) -> None:
        """Charge a finished request's prompt + completion tokens."""


class MemoryLimiter:
    """Buckets in this worker's memory (one pair per configured key: bounded)."""

    def __init__(self) -> None:
        self._req: dict[str, Bucket] = {}
        self._tok: dict[str, Bucket] = {}

    def _bucket(self, table: dict[str, Bucket], key: str, limit: int, now: float) -> Bucket:
        b = table.get(key)
        if b is None:
            b = table[key] = Bucket(float(limit), now)
        b.refill(now, limit)
        return b

    async def admit(self, principal: Principal) -> None:
        now = trio.current_time()
        rpm, tpm = principal.rpm, principal.tpm
        req = self._bucket(self._req, principal.key_id, rpm, now) if rpm else None
        tok = self._bucket(self._tok, principal.key_id, tpm, now) if tpm else None
        wait = decide(req.level if req else None, tok.level if tok else None, rpm, tpm)
        if wait > 0:
            raise limited(wait, principal)
        if req is not None:
            req.level -= 1.0

    async def charge(self, principal: Principal, tokens: int) -> None:
        if principal.tpm and tokens > 0:
            tok = self._bucket(self._tok, principal.key_id, principal.tpm, trio.current_time())
            tok.level = max(-float(principal.tpm), tok.level - tokens)


# KEYS: request bucket, token bucket. ARGV: rpm, tpm, mode ('admit'|'charge'), tokens.
# Returns the wait in ms (0: admitted / charged). Redis's own clock, so that every
# gateway instance agrees on time.
_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local function level(key, limit)
  if limit <= 0 then return nil end
  local v = redis.call('HMGET', key, 'l', 't')
  local l = tonumber(v[1]) or limit
  local at = tonumber(v[2]) or now
  return math.min(limit, l + math.max(0, now - at) * limit / 60)
end
local function save(key, l)
  redis.call('HSET', key, 'l', tostring(l), 't', tostring(now))
  redis.call('PEXPIRE', key, 120000)
end
local tl = level(KEYS[2], tpm)
if ARGV[3] == 'charge' then
  if tl ~= nil then save(KEYS[2], math.max(-tpm, tl - tonumber(ARGV[4]))) end
  return 0
end
local rl = level(KEYS[1], rpm)
local wait = 0
if rl ~= nil and rl < 1 then wait = (1 - rl) * 60 / rpm end
if tl ~= nil and tl <= 0 then wait = math.max(wait, (1 - tl) * 60 / tpm) end
if wait > 0 then return math.ceil(wait * 1000) end
if rl ~= nil then save(KEYS[1], rl - 1) end
return 0
"""


class RedisLimiter:
    """Buckets in Redis: one EVALSHA per admit or charge, shared by every worker.

    A Redis failure or a reply slower than 1 s lets the request through (fail
    open): the limiter protects capacity, it is not what keeps tenants apart,
    and a Redis outage must not become a gateway outage.
    """

    def __init__(self, url: str, prefix: str, pool_size: int = 8) -> None:
        from ..util.redisconn import client_for_url  # late: coredis is optional

        self._client = client_for_url(url, pool_size, 1.0)
        self._script = self._client.register_script(_LUA)
        self._prefix = prefix
        self._stack: AsyncExitStack | None = None

    async def aopen(self) -> None:
        """Enter the client (its pool's tasks live in the calling task)."""
        stack = AsyncExitStack()
        await stack.enter_async_context(self._client)
        self._stack = stack

    async def aclose(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    def _keys(self, key_id: str) -> list[str]:
        base = f"{self._prefix}:rl:{{{key_id}}}"
        return [f"{base}:req", f"{base}:tok"]

    async def _call(self, principal: Principal, mode: str, tokens: int) -> float:
        from coredis.exceptions import RedisError  # late: coredis only with this backend

        args = [principal.rpm, principal.tpm, mode, tokens]
        try:
            with trio.move_on_after(1.0):
                ms = await self._script(keys=self._keys(principal.key_id), args=args)
                return int(ms) / 1000.0
        except (RedisError, OSError, TimeoutError):
            return 0.0
        return 0.0

    async def admit(self, principal: Principal) -> None:
        if not (principal.rpm or principal.tpm):
            return
        wait = await self._call(principal, "admit", 0)
        if wait > 0:
            raise limited(wait, principal)

    async def charge(self, principal: Principal, tokens: int) -> None:
        if principal.tpm and tokens > 0:
            await self._call(principal, "charge", tokens)
