"""The ``redis`` cache backend: entries, leases and published answers in Redis (coredis).

Keys, for key hash ``k`` (prefix ``p``)::

    p:cache:{k}:e         the entry (JSON: pieces and metadata), PX ttl
    p:cache:{k}:l         the lease: the token of the gateway answering k, PX lease
    p:cache:{k}:s:TOKEN   that gateway's answer as it is released: a stream of
                          records (pieces / done / fail), kept a while after
    p:cache:semantic      the semantic index's inserts (guard, key, vector, question,
                          expiry), capped at about ``[cache] semantic_max_entries``;
                          every worker's index follows it

The ``{k}`` hash tag puts one key's records in one Cluster slot, so the scripts
work on Redis Cluster too. A stream per token: a follower never reads the
pieces of a gateway that died midway as if they were its successor's.

Round trips: :meth:`claim` is one EVALSHA (entry, or lease, or holder);
:meth:`publish` one pipeline (XADD, PEXPIRE); :meth:`close` one EVALSHA (stream
end, entry with its size cap, lease released) -- the entry is written in one
``SET``, value and metadata together. Followers block in ``XREAD BLOCK`` on a
second pool, as the session bus's do.

Every coredis error becomes :class:`~.errors.CacheUnavailable`; cancel scopes
apply to every call (coredis drops a connection whose reply was abandoned).
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any, Literal

import coredis
import coredis.exceptions
from coredis.tokens import PureToken

from ..util.redisconn import client_for_url
from .backend import CacheBackend, Claim, Record
from .entry import Entry, decode
from .errors import CacheUnavailable

if TYPE_CHECKING:
    from .settings import CacheConfig

_ERRORS = (coredis.exceptions.RedisError, OSError, TimeoutError, ValueError)

# KEYS: entry, lease. ARGV: token, lease_ms, fresh.
_CLAIM_LUA = """
if ARGV[3] == '0' then
  local e = redis.call('GET', KEYS[1])
  if e then return {'hit', e} end
end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {'lead', ARGV[1]}
end
local holder = redis.call('GET', KEYS[2])
return {'follow', holder or ''}
"""

# KEYS: lease. ARGV: token, lease_ms.
_RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# KEYS: entry, lease, stream. ARGV: token, outcome, detail, blob, ttl_ms, max_bytes, keep_ms.
_CLOSE_LUA = """
if ARGV[2] == 'done' and #ARGV[4] > 0 and #ARGV[4] <= tonumber(ARGV[6]) then
  redis.call('SET', KEYS[1], ARGV[4], 'PX', ARGV[5])
end
redis.call('XADD', KEYS[3], '*', 'k', ARGV[2], 'd', ARGV[3])
redis.call('PEXPIRE', KEYS[3], ARGV[7])
if redis.call('GET', KEYS[2]) == ARGV[1] then
  redis.call('DEL', KEYS[2])
end
return 1
"""


class RedisBackend(CacheBackend):
    """Entries shared by every gateway on one Redis, and single flight across them."""

    kind = "redis"
    shared = True

    def __init__(self, config: CacheConfig, url: str) -> None:
        self.prefix = f"{config.key_prefix}:cache"
        timeout = config.connect_timeout_ms / 1000.0
        self._client = client_for_url(url, config.pool_size, timeout)
        self._follow = client_for_url(url, config.follow_pool_size, timeout)
        self._claim = self._client.register_script(_CLAIM_LUA)
        self._renew = self._client.register_script(_RENEW_LUA)
        self._close = self._client.register_script(_CLOSE_LUA)
        self._stack: AsyncExitStack | None = None

    async def aopen(self) -> None:
        stack = AsyncExitStack()
        await stack.enter_async_context(self._client)
        await stack.enter_async_context(self._follow)
        self._stack = stack

    async def aclose(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    def _keys(self, key: str) -> tuple[str, str]:
        base = f"{self.prefix}:{{{key}}}"
        return f"{base}:e", f"{base}:l"

    def _stream(self, key: str, token: str) -> str:
        return f"{self.prefix}:{{{key}}}:s:{token}"

    async def get(self, key: str) -> Entry | None:
        try:
            blob = await self._client.get(self._keys(key)[0])
        except _ERRORS as exc:
            raise CacheUnavailable("the cache failed during get") from exc
        return decode(blob) if blob is not None else None

    async def put(self, key: str, entry: Entry, blob: bytes, ttl_s: float) -> None:
        try:
            await self._client.set(self._keys(key)[0], blob, px=max(int(ttl_s * 1000), 1))
        except _ERRORS as exc:
            raise CacheUnavailable("the cache failed during put") from exc

    async def claim(self, key: str, token: str, lease_ms: int, *, fresh: bool) -> Claim:
        try:
            got = await self._claim(keys=list(self._keys(key)), args=[token, lease_ms, int(fresh)])
        except _ERRORS as exc:
            raise CacheUnavailable("the cache failed during claim") from exc
        kind, value = str(got[0]), got[1]
        if kind == "hit":
            entry = decode(value)
            # An entry this version cannot read: answer anew, without a lease.
            return Claim("hit", entry) if entry is not None else Claim("lead", token=token)
        if kind == "lead":
            return Claim("lead", token=token)
        return Claim("follow", token=str(value) or None)

    async def renew(self, key: str, token: str, lease_ms: int) -> bool:
        try:
            return bool(await self._renew(keys=[self._keys(key)[1]], args=[token, lease_ms]))
        except _ERRORS as exc:
            raise CacheUnavailable("the cache failed during renew") from exc

    async def publish(self, key: str, token: str, pieces: bytes, keep_ms: int) -> None:
        stream = self._stream(key, token)
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.xadd(stream, {"k": "pieces", "d": pieces})
                pipe.pexpire(stream, keep_ms)
        except _ERRORS as exc:
            raise CacheUnavailable("the cache failed during publish") from exc

    async def close(
        self,
        key: str,
        token: str,
        *,
        outcome: Literal["done", "fail"],
        detail: str,
        blob: bytes | None,
        ttl_s: float,
        max_bytes: int,
        keep_ms: int,
    ) -> None:
        entry_key, lease = self._keys(key)
        args: list[Any] = [
            token,
            outcome,
            detail,
            blob or b"",
            max(int(ttl_s * 1000), 1),
            max_bytes,
            keep_ms,
        ]
        try:
            await self._close(keys=[entry_key, lease, self._stream(key, token)], args=args)
        except _ERRORS as exc:
            raise CacheUnavailable("the cache failed during close") from exc

    async def holder(self, key: str) -> str | None:
        try:
            token = await self._client.get(self._keys(key)[1])
        except _ERRORS as exc:
            raise CacheUnavailable("the cache failed during holder") from exc
        return str(token) if token else None

    async def read(self, key: str, token: str, after: str, block_ms: int) -> list[Record]:
        stream = self._stream(key, token)
        try:
            found = await self._follow.xread({stream: after}, count=256, block=block_ms)
        except _ERRORS as exc:
            raise CacheUnavailable("the cache failed during read") from exc
        if not found:
            return []
        out = []
        for entry in next(iter(found.values())):
            fields = entry.field_values
            out.append(Record(str(entry.identifier), str(fields["k"]), str(fields.get("d", ""))))
        return out

    async def index_add(self, fields: dict[str, str], max_len: int) -> None:
        try:
            await self._client.xadd(
                f"{self.prefix}:semantic",
                dict(fields),
                trim_strategy=PureToken.MAXLEN,
                threshold=max_len,
                trim_operator=PureToken.APPROXIMATELY,
            )
        except _ERRORS as exc:
            raise CacheUnavailable("the cache failed during index_add") from exc

    async def index_read(
        self, after: str, count: int, block_ms: int | None
    ) -> list[tuple[str, dict[str, str]]]:
        stream = f"{self.prefix}:semantic"
        try:
            if block_ms is None:
                found = await self._client.xread({stream: after}, count=count)
            else:
                found = await self._follow.xread({stream: after}, count=count, block=block_ms)
        except _ERRORS as exc:
            raise CacheUnavailable("the cache failed during index_read") from exc
        if not found:
            return []
        return [
            (str(e.identifier), {str(k): str(v) for k, v in e.field_values.items()})
            for e in next(iter(found.values()))
        ]

    async def server_stats(self) -> dict[str, float]:
        try:
            info = await self._client.info("stats")
        except _ERRORS as exc:
            raise CacheUnavailable("the cache failed during stats") from exc
        return {
            name: float(info[name]) for name in ("keyspace_hits", "keyspace_misses") if name in info
        }
