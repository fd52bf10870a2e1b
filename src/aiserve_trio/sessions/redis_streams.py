"""The ``redis`` session bus: Redis Streams through coredis (anyio-native).

Keys, for tenant ``t`` and session ``s`` (prefix ``p``)::

    p:{t:s}:turns   stream, one entry per turn, XADD MAXLEN ~ max_turns
    p:{t:s}:vars    hash of session variables
    p:{t:s}:seen    sorted set of request ids already written (dedupe)

The ``{t:s}`` hash tag puts one session's keys in one Cluster slot, so its
pipelines and the append script work on Redis Cluster too. Tenants have no
``:`` (checked at start-up), so ``t:s`` is unambiguous: two tenants never share
a key. Every key expires ``ttl`` seconds after the session's last use.

Round trips: ``load`` is one pipeline (XREVRANGE, HGETALL, 3x EXPIRE),
``append`` one EVALSHA (dedupe + XADD + EXPIRE), ``set_vars`` one EVALSHA
(the per-session caps checked and the merge, atomically).
Followers block in ``XREAD BLOCK`` on a second, separately sized pool so that
long-lived event streams never starve the request path of connections.

Every coredis error becomes a :class:`SessionBusError` here; cancel scopes
apply to every call (coredis drops a connection whose reply was abandoned).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import coredis
import coredis.exceptions
import msgspec

from ..core.messages import ToolCall
from ..util.redisconn import client_for_url
from .bus import Event, Session, SessionBus, SessionBusError, Turn, VarCaps

if TYPE_CHECKING:
    from ..observability.metrics import Metrics
    from .settings import SessionsConfig

_FLAGS = msgspec.json.Encoder()
_FLAGS_DEC = msgspec.json.Decoder(dict[str, str])
_CALLS_DEC = msgspec.json.Decoder(list[ToolCall])

# KEYS: turns, vars, seen. ARGV: ttl, maxlen, request_id, score, n_turns, then per
# turn: n_fields, field, value, ... Returns the new entry ids, or {} if the
# request's turns were written before (a retry from the outbox).
_APPEND_LUA = """
if redis.call('ZADD', KEYS[3], 'NX', ARGV[4], ARGV[3]) == 0 then
  return {}
end
redis.call('ZREMRANGEBYRANK', KEYS[3], 0, -(tonumber(ARGV[2]) + 1))
local ids = {}
local i = 6
for _ = 1, tonumber(ARGV[5]) do
  local n = tonumber(ARGV[i])
  local args = {KEYS[1], 'MAXLEN', '~', ARGV[2], '*'}
  for j = 1, n do args[#args + 1] = ARGV[i + j] end
  i = i + n + 1
  ids[#ids + 1] = redis.call('XADD', unpack(args))
end
for k = 1, 3 do redis.call('EXPIRE', KEYS[k], ARGV[1]) end
return ids
"""

# KEYS: turns, vars, seen. ARGV: ttl, max count, max bytes, then name, value, ...
# Merges the variables unless the result passes a cap: returns {} when written,
# else {"count" | "bytes", the size the session would have had}. Lua's # is bytes.
_SET_VARS_LUA = """
local cur = redis.call('HGETALL', KEYS[2])
local size = {}
local count, bytes = 0, 0
for i = 1, #cur, 2 do
  size[cur[i]] = #cur[i] + #cur[i + 1]
  count = count + 1
  bytes = bytes + size[cur[i]]
end
for i = 4, #ARGV, 2 do
  local old = size[ARGV[i]]
  if old then bytes = bytes - old else count = count + 1 end
  size[ARGV[i]] = #ARGV[i] + #ARGV[i + 1]
  bytes = bytes + size[ARGV[i]]
end
if count > tonumber(ARGV[2]) then return {'count', count} end
if bytes > tonumber(ARGV[3]) then return {'bytes', bytes} end
local args = {KEYS[2]}
for i = 4, #ARGV do args[#args + 1] = ARGV[i] end
redis.call('HSET', unpack(args))
for k = 1, 3 do redis.call('EXPIRE', KEYS[k], ARGV[1]) end
return {}
"""

_ERRORS = (coredis.exceptions.RedisError, OSError, TimeoutError)


def session_keys(prefix: str, tenant: str, session_id: str) -> tuple[str, str, str]:
    """The (turns, vars, seen) keys of one session."""
    base = f"{prefix}:{{{tenant}:{session_id}}}"
    return f"{base}:turns", f"{base}:vars", f"{base}:seen"


def turn_fields(turn: Turn) -> list[str]:
    """A turn as flat stream-entry fields (readable with ``redis-cli XRANGE``)."""
    out = [
        "role", turn.role,
        "content", turn.content,
        "channel", turn.channel,
        "request_id", turn.request_id,
        "ts", repr(turn.ts),
    ]  # fmt: skip
    if turn.truncated:
        out += ["truncated", "1"]
    if turn.flags:
        out += ["flags", _FLAGS.encode(turn.flags).decode()]
    if turn.tool_calls:
        out += ["tool_calls", _FLAGS.encode(turn.tool_calls).decode()]
    if turn.tool_call_id is not None:
        out += ["tool_call_id", turn.tool_call_id]
    return out


def turn_from_fields(fields: Any) -> Turn:
    """The inverse of :func:`turn_fields`.

    Raises:
        SessionBusError: the entry is not a turn written by this gateway.
    """
    try:
        flags = fields.get("flags")
        calls = fields.get("tool_calls")
        return Turn(
            role=fields["role"],
            content=fields["content"],
            channel=fields["channel"],
            request_id=fields["request_id"],
            ts=float(fields["ts"]),
            truncated=fields.get("truncated") == "1",
            flags=_FLAGS_DEC.decode(flags) if flags else {},
            tool_calls=_CALLS_DEC.decode(calls) if calls else None,
            tool_call_id=fields.get("tool_call_id"),
        )
    except (KeyError, ValueError, msgspec.DecodeError) as exc:
        raise SessionBusError("a session stream entry is not a turn") from exc


class RedisBus(SessionBus):
    """Sessions in Redis (Streams for turns, hashes for variables)."""

    kind = "redis"

    def __init__(self, config: SessionsConfig, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics
        timeout = config.connect_timeout_ms / 1000.0
        self._client = client_for_url(config.url, config.pool_size, timeout)
        self._follow_client = client_for_url(config.url, config.follow_pool_size, timeout)
        self._append = self._client.register_script(_APPEND_LUA)
        self._set_vars = self._client.register_script(_SET_VARS_LUA)
        self.caps = VarCaps(config.max_vars_per_session, config.max_var_bytes_per_session)
        self._stack: AsyncExitStack | None = None

    async def aopen(self) -> None:
        # Entering a coredis client starts its pool's task group in this task;
        # it connects lazily, so a gateway can start while Redis is down.
        stack = AsyncExitStack()
        await stack.enter_async_context(self._client)
        await stack.enter_async_context(self._follow_client)
        self._stack = stack

    async def aclose(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    @contextlib.contextmanager
    def _translate(self, op: str) -> Iterator[None]:
        try:
            yield
        except _ERRORS as exc:
            if self.metrics is not None:
                self.metrics.session_errors.labels(op).inc()
            raise SessionBusError(f"the session bus failed during {op}") from exc

    def _keys(self, tenant: str, session_id: str) -> tuple[str, str, str]:
        return session_keys(self.config.key_prefix, tenant, session_id)

    async def ping(self) -> bool:
        try:
            with self._translate("ping"):
                await self._client.ping()
        except SessionBusError:
            return False
        return True

    async def load(self, tenant: str, session_id: str, history_turns: int, ttl: int) -> Session:
        turns_key, vars_key, seen_key = self._keys(tenant, session_id)
        with self._translate("load"):
            async with self._client.pipeline(transaction=False) as pipe:
                entries = pipe.xrevrange(turns_key, count=max(history_turns, 1))
                variables = pipe.hgetall(vars_key)
                for key in (turns_key, vars_key, seen_key):
                    pipe.expire(key, ttl)
            got_entries = await entries
            got_vars = await variables
        kept = list(got_entries or ())[:history_turns] if history_turns > 0 else []
        return Session(
            turns=[turn_from_fields(e.field_values) for e in reversed(kept)],
            variables=dict(got_vars or {}),
        )

    async def append(self, tenant: str, session_id: str, turns: list[Turn], ttl: int) -> list[str]:
        if not turns:
            return []
        args: list[str | int] = [
            ttl,
            self.config.max_turns,
            turns[0].request_id,
            int(time.time() * 1000),
            len(turns),
        ]
        for turn in turns:
            fields = turn_fields(turn)
            args += [len(fields), *fields]
        with self._translate("append"):
            ids = await self._append(keys=list(self._keys(tenant, session_id)), args=args)
        return [str(i) for i in ids or ()]

    async def set_vars(
        self, tenant: str, session_id: str, values: dict[str, str], ttl: int
    ) -> None:
        if not values:
            return
        args: list[str | int] = [ttl, self.caps.count, self.caps.bytes]
        for name, value in values.items():
            args += [name, value]
        with self._translate("set_vars"):
            refused = await self._set_vars(keys=list(self._keys(tenant, session_id)), args=args)
        if refused:
            which, size = (x.decode() if isinstance(x, bytes) else x for x in refused)
            # The script checked both caps the same way; raise the one it names.
            if which == "count":
                self.caps.check(int(size), 0)
            self.caps.check(0, int(size))

    async def read(
        self, tenant: str, session_id: str, after: str | None, *, limit: int, block_ms: int
    ) -> list[Event]:
        turns_key = self._keys(tenant, session_id)[0]
        with self._translate("read"):
            if after is None:
                entries = await self._client.xrevrange(turns_key, count=limit)
                if entries:
                    return [_event(e) for e in reversed(entries)]
                after = "0-0"
            if block_ms <= 0:
                found = await self._client.xread({turns_key: after}, count=limit)
            else:
                found = await self._follow_client.xread(
                    {turns_key: after}, count=limit, block=block_ms
                )
        if not found:
            return []
        return [_event(e) for e in next(iter(found.values()))]


def _event(entry: Any) -> Event:
    return Event(id=str(entry.identifier), turn=turn_from_fields(entry.field_values))
