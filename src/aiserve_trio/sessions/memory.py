"""The ``memory`` session bus: one process, bounded, the default.

Sessions live in an LRU map capped at ``max_sessions``; a session not used for
its ``ttl`` is gone (checked on access, and swept from the cold end of the LRU
when new sessions arrive). Each session keeps its last ``max_turns`` events and
the request ids of its last writes, so a retried write is not stored twice --
the same contract as the Redis backend. Expiry runs on ``trio.current_time()``
so tests drive it with the virtual clock; event ids use wall-clock
milliseconds like Redis stream ids.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import trio

from .bus import Event, Session, SessionBus, Turn, VarCaps, merged_size, parse_event_id

_Key = tuple[str, str]


@dataclass(slots=True)
class _Entry:
    events: deque[Event]
    expires: float
    variables: dict[str, str] = field(default_factory=dict)
    #: Request ids already written, oldest first (bounded like the events).
    written: OrderedDict[str, None] = field(default_factory=OrderedDict)


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
        self, *, max_sessions: int = 10_000, max_turns: int = 100, caps: VarCaps | None = None
    ) -> None:
        self.max_sessions = max_sessions
        self.max_turns = max_turns
        self.caps = caps or VarCaps()
        self._sessions: OrderedDict[_Key, _Entry] = OrderedDict()
        self._waiters = _Waiters()
        self._last_id = (0, 0)

    def __len__(self) -> int:
        return len(self._sessions)

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
            del self._sessions[key]
            return None
        self._sessions.move_to_end(key)
        return entry

    def _get_or_create(self, key: _Key, ttl: int) -> _Entry:
        entry = self._get(key)
        now = trio.current_time()
        if entry is None:
            self._evict(now)
            entry = _Entry(events=deque(maxlen=self.max_turns), expires=now + ttl)
            self._sessions[key] = entry
        entry.expires = now + ttl
        return entry

    def _evict(self, now: float) -> None:
        """Make room for one more session: expired ones first, then the least recently used."""
        sessions = self._sessions
        while sessions:
            key, oldest = next(iter(sessions.items()))
            if oldest.expires > now and len(sessions) < self.max_sessions:
                break
            del sessions[key]

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
        return Session(turns=[e.turn for e in events], variables=dict(entry.variables))

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
        while len(entry.written) > self.max_turns:
            entry.written.popitem(last=False)
        ids = []
        for turn in turns:
            ev = Event(id=self._next_id(), turn=turn)
            entry.events.append(ev)
            ids.append(ev.id)
        self._waiters.wake(key)
        return ids

    async def set_vars(
        self, tenant: str, session_id: str, values: dict[str, str], ttl: int
    ) -> None:
        await trio.lowlevel.checkpoint()
        entry = self._get((tenant, session_id))
        self.caps.check(*merged_size(entry.variables if entry is not None else {}, values))
        self._get_or_create((tenant, session_id), ttl).variables.update(values)

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
            return list(entry.events)[-limit:]
        mark = parse_event_id(after)
        out: list[Event] = []
        # Newest first: a follower is usually only a few events behind.
        for ev in reversed(entry.events):
            if parse_event_id(ev.id) <= mark:
                break
            out.append(ev)
        out.reverse()
        return out[:limit]
