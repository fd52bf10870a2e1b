"""The session bus interface: one customer's context, shared by every channel.

A session is keyed by tenant + session id. Its turns form an append-only
stream of events (each with an event id, so followers can resume), its
variables are a small string map; both expire ``ttl`` seconds after last use.
Backends: ``memory`` (one process, the default) and ``redis`` (Redis Streams).

Implementations translate their library's errors into
:class:`SessionBusError` at the boundary; callers bound waits with cancel
scopes (no method takes a timeout).
"""

from __future__ import annotations

import abc
import re
from collections.abc import AsyncIterator

import msgspec

from ..errors import BadRequest, Overloaded

SESSION_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9:._-]{0,127}$")


class SessionBusError(Overloaded):
    """The session bus could not be reached or answered wrongly (503)."""

    default_code = "session_bus_unavailable"


class Turn(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str
    channel: str
    request_id: str
    #: Unix time in seconds.
    ts: float
    #: The reply was cut short (stream error, timeout, disconnect).
    truncated: bool = False
    #: Notes from policies or the pipeline (e.g. ``fraud_flag``).
    flags: dict[str, str] = msgspec.field(default_factory=dict)


class Event(msgspec.Struct, kw_only=True):
    """A turn as stored, with its stream id (``<ms>-<seq>``)."""

    id: str
    turn: Turn


class Session(msgspec.Struct, kw_only=True):
    turns: list[Turn] = msgspec.field(default_factory=list)
    variables: dict[str, str] = msgspec.field(default_factory=dict)


def check_session_id(session_id: str) -> str:
    """Return ``session_id`` if it is well-formed.

    Raises:
        BadRequest: it is empty, longer than 128 characters, or has characters
            other than letters, digits and ``: . _ -``.
    """
    if not SESSION_ID_RE.match(session_id):
        raise BadRequest(
            "`X-Session-Id` must be 1-128 characters of letters, digits and ':._-'",
            param="X-Session-Id",
            code="invalid_session_id",
        )
    return session_id


class SessionBus(abc.ABC):
    """Where sessions live. All methods may raise :class:`SessionBusError`."""

    async def aopen(self) -> None:  # noqa: B027 - optional hook
        """Connect; called once in lifespan start-up."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Disconnect; called once at shutdown."""

    @abc.abstractmethod
    async def ping(self) -> bool:
        """Whether the bus is reachable (for ``/readyz``)."""

    @abc.abstractmethod
    async def load(self, tenant: str, session_id: str, history_turns: int, ttl: int) -> Session:
        """The last ``history_turns`` turns and the variables; refreshes the TTL."""

    @abc.abstractmethod
    async def append(self, tenant: str, session_id: str, turns: list[Turn], ttl: int) -> list[str]:
        """Append turns; returns their event ids."""

    @abc.abstractmethod
    async def set_vars(
        self, tenant: str, session_id: str, values: dict[str, str], ttl: int
    ) -> None:
        """Merge ``values`` into the session's variables."""

    @abc.abstractmethod
    def follow(self, tenant: str, session_id: str, after: str | None) -> AsyncIterator[Event]:
        """Events after ``after`` (``None``: from the start of what is kept), then live ones."""
