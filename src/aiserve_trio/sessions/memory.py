"""The ``memory`` session bus: one process, bounded by count and by bytes, the default.

Sessions live in an LRU map capped at ``max_sessions`` sessions and ``max_bytes``
bytes; a session not used for its ``ttl`` is gone (checked on access, and swept
from the cold end of the LRU when room is made). Each session keeps its last
``max_turns`` events, at most ``max_session_bytes`` bytes of it (its oldest turns
are dropped first), and the request ids of its last writes, so a retried write is
not stored twice -- the same contract as the Redis backend. Stored Responses
(``previous_response_id``) are sessions too, so the same bounds hold them.

**Bytes** are counted, not guessed from counts: a turn is the size of its JSON
encoding (what a Redis stream entry would hold) plus :data:`EVENT_OVERHEAD`; a
variable its name's and value's UTF-8 bytes plus :data:`VAR_OVERHEAD`; a kept
request id its length plus :data:`ID_OVERHEAD`; a session its key plus
:data:`SESSION_OVERHEAD`. The overheads are fixed per entry (the Python objects
that hold it), so ``bytes`` is exact arithmetic over what is stored and a test
can assert it to the byte.

**Tenants share the store.** When it is full (a new session past ``max_sessions``,
or bytes past ``max_bytes``), the session evicted is the least recently used one
*of the tenant holding the most* (sessions for the count, bytes for the bytes).
A tenant may use the whole store while no other needs the room, but once others
do, a tenant that floods it evicts its own sessions before anyone else's: one
tenant's 10,050 new sessions no longer empty another's. Tenants come from the
config (keys and routes), so picking the largest is a walk over a few entries.

Expiry runs on ``trio.current_time()`` so tests drive it with the virtual clock;
event ids use wall-clock milliseconds like Redis stream ids.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import msgspec
import trio

from .bus import (
    Event,
    Session,
    SessionBus,
    Turn,
    VarCaps,
    merged_size,
    parse_event_id,
    var_bytes,
)

_Key = tuple[str, str]

#: Fixed bytes counted per stored piece, besides its encoded size: the Python
#: objects holding it. Measured with ``tracemalloc`` on CPython 3.11: a session of
#: two short turns took 2,512 bytes (counted: 2,464), one turn of
#: 100 KB 102,090 (counted: 101,791); a short variable ~70-130 (counted: 150 + its bytes).
EVENT_OVERHEAD = 512
VAR_OVERHEAD = 150
ID_OVERHEAD = 100
SESSION_OVERHEAD = 1_024

_encoder = msgspec.json.Encoder()


def event_bytes(ev: Event) -> int:
    """What one stored turn counts: its JSON encoding, its id, and the fixed overhead."""
    return len(_encoder.encode(ev.turn)) + len(ev.id) + EVENT_OVERHEAD


def session_bytes(key: _Key) -> int:
    """What an empty session counts: its key and the fixed overhead."""
    return len(key[0].encode()) + len(key[1].encode()) + SESSION_OVERHEAD


@dataclass(slots=True)
class _Entry:
    events: deque[tuple[Event, int]]
    expires: float
    #: Bytes counted for this session (see the module's docstring).
    bytes: int
    variables: dict[str, str] = field(default_factory=dict)
    #: Request ids already written, oldest first (bounded like the events).
    written: OrderedDict[str, None] = field(default_factory=OrderedDict)


@dataclass(slots=True)
class _Tenant:
    """One tenant's sessions, least recently used first, and their bytes."""

    sessions: OrderedDict[str, None] = field(default_factory=OrderedDict)
    bytes: int = 0


class _Waiters:
    """Followers waiting for a session's next append (one Event per waited-on key)."""

    __slots__ = ("_events",)

    def __init__(self) -> None:
        self._events: dict[_Key, tuple[trio.Event, int]] = {}

    async def wait(self, key: _Key, seconds: float) -> None:
        ev, n = self._events.get(key, (trio.Event(), 0))
        self._events[key] = (ev, n + 1)
        try:
            with trio.move_on_after(seconds):
                await ev.wait()
        finally:
            cur = self._events.get(key)
            if cur is not None and cur[0] is ev:
                if cur[1] <= 1:
                    del self._events[key]
                else:
                    self._events[key] = (ev, cur[1] - 1)

    def wake(self, key: _Key) -> None:
        cur = self._events.pop(key, None)
        if cur is not None:
            cur[0].set()


class MemoryBus(SessionBus):
    """Sessions in this process's memory."""

    kind = "memory"

    def __init__(
        self,
        *,
        max_sessions: int = 10_000,
        max_turns: int = 100,
        max_bytes: int = 268_435_456,
        max_session_bytes: int = 4_194_304,
        caps: VarCaps | None = None,
    ) -> None:
        self.max_sessions = max_sessions
        self.max_turns = max_turns
        self.max_bytes = max_bytes
        self.max_session_bytes = max_session_bytes
        self.caps = caps or VarCaps()
        #: Bytes counted for every session held (never above ``max_bytes`` between calls).
        self.bytes = 0
        self._sessions: OrderedDict[_Key, _Entry] = OrderedDict()
        self._tenants: dict[str, _Tenant] = {}
        self._waiters = _Waiters()
        self._last_id = (0, 0)

    def __len__(self) -> int:
        return len(self._sessions)

    def held(self) -> tuple[int, int]:
        """``(bytes, sessions)`` held now (the ``aiserve_session_*`` gauges)."""
        return self.bytes, len(self._sessions)

    def tenant_held(self, tenant: str) -> tuple[int, int]:
        """``(bytes, sessions)`` one tenant holds now."""
        t = self._tenants.get(tenant)
        return (t.bytes, len(t.sessions)) if t is not None else (0, 0)

    async def ping(self) -> bool:
        await trio.lowlevel.checkpoint()
        return True

    # --- the map -------------------------------------------------------------

    def _get(self, key: _Key) -> _Entry | None:
        """The live entry for ``key`` (marked most recently used), or None."""
        entry = self._sessions.get(key)
        if entry is None:
            return None
        if entry.expires <= trio.current_time():
            self._drop(key)
            return None
        self._sessions.move_to_end(key)
        self._tenants[key[0]].sessions.move_to_end(key[1])
        return entry

    def _get_or_create(self, key: _Key, ttl: int) -> _Entry:
        entry = self._get(key)
        now = trio.current_time()
        if entry is None:
            self._sweep(now)
            # Each pass drops one session: at most len(self) passes.
            while len(self._sessions) >= self.max_sessions:
                self._drop(self._victim(by_bytes=False, keep=None))
            entry = _Entry(events=deque(), expires=now + ttl, bytes=0)
            self._sessions[key] = entry
            self._tenants.setdefault(key[0], _Tenant()).sessions[key[1]] = None
            self._grow(key, entry, session_bytes(key))
        entry.expires = now + ttl
        return entry

    def _grow(self, key: _Key, entry: _Entry, delta: int) -> None:
        """Count ``delta`` more bytes for the session ``key`` (its tenant, the store)."""
        entry.bytes += delta
        self._tenants[key[0]].bytes += delta
        self.bytes += delta

    def _drop(self, key: _Key) -> None:
        entry = self._sessions.pop(key)
        tenant = self._tenants[key[0]]
        del tenant.sessions[key[1]]
        tenant.bytes -= entry.bytes
        self.bytes -= entry.bytes
        if not tenant.sessions:
            del self._tenants[key[0]]

    def _sweep(self, now: float) -> None:
        """Drop expired sessions from the cold end of the LRU (each pass drops one)."""
        sessions = self._sessions
        while sessions:
            key, oldest = next(iter(sessions.items()))
            if oldest.expires > now:
                break
            self._drop(key)

    def _victim(self, *, by_bytes: bool, keep: _Key | None) -> _Key:
        """The session to evict: the least recently used of the tenant holding the
        most (bytes or sessions), so a tenant past its share pays first.

        ``keep`` (the session being written, the most recently used of its tenant)
        is chosen only when no other session is left: a session larger than the
        whole store is not kept either.
        """
        best: tuple[int, str] | None = None
        for name, t in self._tenants.items():  # tenants come from the config: a few
            if keep is not None and name == keep[0] and len(t.sessions) == 1:
                continue
            size = t.bytes if by_bytes else len(t.sessions)
            if best is None or size > best[0]:
                best = (size, name)
        if best is None:
            assert keep is not None
            assert keep in self._sessions
            return keep
        return best[1], next(iter(self._tenants[best[1]].sessions))

    def _fit(self, key: _Key, entry: _Entry) -> None:
        """After ``key`` grew: drop its oldest turns past ``max_turns`` and
        ``max_session_bytes``, then evict sessions while the store is past ``max_bytes``.

        Each pass drops one turn or one session, so the loops are bounded by what is held.
        """
        events = entry.events
        while events and (len(events) > self.max_turns or entry.bytes > self.max_session_bytes):
            _, size = events.popleft()
            self._grow(key, entry, -size)
        while self.bytes > self.max_bytes:
            self._drop(self._victim(by_bytes=True, keep=key))

    def _next_id(self) -> str:
        ms = int(time.time() * 1000)
        last_ms, seq = self._last_id
        self._last_id = (ms, 0) if ms > last_ms else (last_ms, seq + 1)
        return f"{self._last_id[0]}-{self._last_id[1]}"

    # --- the interface ---------------------------------------------------------

    async def load(self, tenant: str, session_id: str, history_turns: int, ttl: int) -> Session:
        await trio.lowlevel.checkpoint()
        entry = self._get((tenant, session_id))
        if entry is None:
            return Session()
        entry.expires = trio.current_time() + ttl
        events = list(entry.events)[-history_turns:] if history_turns > 0 else []
        return Session(turns=[e.turn for e, _ in events], variables=dict(entry.variables))

    async def append(self, tenant: str, session_id: str, turns: list[Turn], ttl: int) -> list[str]:
        await trio.lowlevel.checkpoint()
        if not turns:
            return []
        key = (tenant, session_id)
        entry = self._get_or_create(key, ttl)
        request_id = turns[0].request_id
        if request_id in entry.written:
            return []
        entry.written[request_id] = None
        self._grow(key, entry, len(request_id.encode()) + ID_OVERHEAD)
        while len(entry.written) > self.max_turns:
            old, _ = entry.written.popitem(last=False)
            self._grow(key, entry, -(len(old.encode()) + ID_OVERHEAD))
        ids = []
        for turn in turns:  # one request's turns: bounded by the request's limits
            ev = Event(id=self._next_id(), turn=turn)
            size = event_bytes(ev)
            entry.events.append((ev, size))
            self._grow(key, entry, size)
            ids.append(ev.id)
        self._fit(key, entry)
        self._waiters.wake(key)
        return ids

    async def set_vars(
        self, tenant: str, session_id: str, values: dict[str, str], ttl: int
    ) -> None:
        await trio.lowlevel.checkpoint()
        key = (tenant, session_id)
        entry = self._get(key)
        self.caps.check(*merged_size(entry.variables if entry is not None else {}, values))
        entry = self._get_or_create(key, ttl)
        delta = 0
        for name, value in values.items():  # at most MAX_VARS (check_vars)
            old = entry.variables.get(name)
            if old is not None:
                delta -= var_bytes(name, old) + VAR_OVERHEAD
            delta += var_bytes(name, value) + VAR_OVERHEAD
        entry.variables.update(values)
        self._grow(key, entry, delta)
        self._fit(key, entry)

    async def read(
        self, tenant: str, session_id: str, after: str | None, *, limit: int, block_ms: int
    ) -> list[Event]:
        key = (tenant, session_id)
        events = self._after(key, after, limit)
        if events or block_ms <= 0:
            await trio.lowlevel.checkpoint()
            return events
        await self._waiters.wait(key, block_ms / 1000.0)
        return self._after(key, after, limit)

    def _after(self, key: _Key, after: str | None, limit: int) -> list[Event]:
        entry = self._get(key)
        if entry is None or limit <= 0:
            return []
        if after is None:
            return [ev for ev, _ in list(entry.events)[-limit:]]
        mark = parse_event_id(after)
        out: list[Event] = []
        # Newest first: a follower is usually only a few events behind.
        for ev, _ in reversed(entry.events):
            if parse_event_id(ev.id) <= mark:
                break
            out.append(ev)
        out.reverse()
        return out[:limit]
