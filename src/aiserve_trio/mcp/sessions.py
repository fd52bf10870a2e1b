"""``/mcp``'s client sessions (``Mcp-Session-Id``) of the handshake-era protocol.

A worker keeps at most ``[mcp] max_sessions``. When a new one would pass that, the
session evicted is the least recently used one *of the tenant holding the most*:
a tenant may use the whole table while no other needs it, but one that opens
sessions in bulk evicts its own before anyone else's (the session bus's rule,
sessions/memory.py). An evicted client gets 404 on its next request and initializes
again, as the protocol asks. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import trio


@dataclass(slots=True)
class Session:
    """A client's ``Mcp-Session-Id``: whose it is, at which protocol version."""

    key_id: str | None
    version: str
    #: The tenant it counts against (the key's).
    tenant: str = ""
    #: In-flight calls by request id: their cancel scopes (``notifications/cancelled``).
    calls: dict[Any, trio.CancelScope] = field(default_factory=dict)


class SessionTable:
    """Sessions by id, least recently used first overall and per tenant."""

    __slots__ = ("_by_tenant", "_sessions", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._sessions: dict[str, Session] = {}
        self._by_tenant: dict[str, OrderedDict[str, None]] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[str]:
        return iter(self._sessions)

    def get(self, sid: str) -> Session | None:
        """The session ``sid``, now its tenant's most recently used; None if unknown."""
        s = self._sessions.get(sid)
        if s is not None:
            self._by_tenant[s.tenant].move_to_end(sid)
        return s

    def add(self, sid: str, session: Session) -> list[Session]:
        """Keep ``session``; return the sessions evicted to make room (their calls are
        the caller's to cancel)."""
        self._sessions[sid] = session
        self._by_tenant.setdefault(session.tenant, OrderedDict())[sid] = None
        evicted = []
        while len(self._sessions) > self.limit:
            largest = max(self._by_tenant.values(), key=len)
            evicted.append(self.remove(next(iter(largest))))
        return evicted

    def remove(self, sid: str) -> Session:
        """Forget ``sid`` (a DELETE, or an eviction) and return it.

        Raises:
            KeyError: ``sid`` is not kept.
        """
        s = self._sessions.pop(sid)
        mine = self._by_tenant[s.tenant]
        del mine[sid]
        if not mine:
            del self._by_tenant[s.tenant]
        return s
