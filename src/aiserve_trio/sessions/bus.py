"""The session bus interface: one customer's context, shared by every channel.

A session is keyed by tenant + session id. Its turns form an append-only
stream of events (each with an event id ``<ms>-<seq>``, so followers can
resume), its variables are a small string map; both expire ``ttl`` seconds
after last use. Backends: ``memory`` (one process, the default) and ``redis``
(Redis Streams).

Implementations translate their library's errors into
:class:`SessionBusError` at the boundary; callers bound waits with cancel
scopes. The one wait that is part of the protocol rather than a timeout is
:meth:`SessionBus.read`'s ``block_ms`` (Redis ``XREAD BLOCK``): it lets a
follower wake up for a heartbeat without cancelling a Redis call.
"""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass

import msgspec
import trio

from ..core.errors import BadRequest, Overloaded, PayloadTooLarge
from ..core.messages import ToolCall

# Re-exported: the tenant rule is shared with the config (see ``tenants``).
from ..core.tenants import TENANT_RE as TENANT_RE
from ..core.tenants import check_tenant as check_tenant

SESSION_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9:._-]{0,127}$")
EVENT_ID_RE = re.compile(r"^(\d{1,20})-(\d{1,20})$")
VAR_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
MAX_VARS = 64
MAX_VAR_CHARS = 1024


class SessionBusError(Overloaded):
    """The session bus could not be reached or answered wrongly (503)."""

    default_code = "session_bus_unavailable"


class SessionVarsFull(PayloadTooLarge):
    """Writing the variables would take the session past a ``[sessions]`` cap (413)."""

    default_code = "session_variables_full"


@dataclass(frozen=True, slots=True)
class VarCaps:
    """What one session's variables may hold (``[sessions] max_vars_per_session``,
    ``max_var_bytes_per_session``)."""

    count: int = 128
    bytes: int = 32_768

    def check(self, count: int, size: int, param: str = "variables") -> None:
        """Raises:
        SessionVarsFull: ``count`` variables or ``size`` bytes are past a cap (naming it).
        """
        if count > self.count:
            raise SessionVarsFull(
                f"the session would hold {count} variables, more than "
                f"[sessions] max_vars_per_session = {self.count}",
                param=param,
            )
        if size > self.bytes:
            raise SessionVarsFull(
                f"the session's variables would take {size} bytes, more than "
                f"[sessions] max_var_bytes_per_session = {self.bytes}",
                param=param,
            )


def var_bytes(name: str, value: str) -> int:
    """What one variable counts against ``max_var_bytes_per_session``: UTF-8 bytes."""
    return len(name.encode()) + len(value.encode())


def merged_size(current: dict[str, str], values: dict[str, str]) -> tuple[int, int]:
    """``(count, bytes)`` of ``current`` once ``values`` are merged into it."""
    merged = {**current, **values}
    return len(merged), sum(var_bytes(k, v) for k, v in merged.items())


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
    #: An assistant turn's tool calls; a tool turn's answer names its call.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class Event(msgspec.Struct, kw_only=True):
    """A turn as stored, with its stream id (``<ms>-<seq>``)."""

    id: str
    turn: Turn


class Session(msgspec.Struct, kw_only=True):
    turns: list[Turn] = msgspec.field(default_factory=list)
    variables: dict[str, str] = msgspec.field(default_factory=dict)


#: What a stored response's id, and so its session id, starts with (the app names a
#: Responses reply ``resp_`` + hex). No client session id may: the two namespaces never
#: meet, so a stored response stays as it was stored (issue 51, item 5).
RESPONSE_PREFIX = "resp_"


def check_session_id(session_id: str, param: str = "X-Session-Id") -> str:
    """Return ``session_id`` if it is well-formed and a client may use it.

    ``param`` names where the client put it (the header, a path's ``session_id``), for
    the message as much as for ``param``.

    Raises:
        BadRequest: it is empty, longer than 128 characters, or has characters
            other than letters, digits and ``: . _ -``; or it starts with ``resp_``,
            the stored responses' namespace (a client session id there would append to a
            stored response, or read and write its variables).
    """
    if not SESSION_ID_RE.fullmatch(session_id):
        raise BadRequest(
            f"`{param}` must be 1-128 characters of letters, digits and ':._-'",
            param=param,
            code="invalid_session_id",
        )
    if session_id.startswith(RESPONSE_PREFIX):
        raise BadRequest(
            f"`{param}` must not start with {RESPONSE_PREFIX!r}: those ids are stored "
            "responses, which only `previous_response_id` continues (and never changes)",
            param=param,
            code="invalid_session_id",
        )
    return session_id


def is_response_id(response_id: str) -> bool:
    """Whether ``response_id`` can name a stored response (``previous_response_id``).

    Raises:
        BadRequest: it is not an id at all (``param`` is ``previous_response_id``).
    """
    if not SESSION_ID_RE.fullmatch(response_id):
        raise BadRequest(
            "`previous_response_id` must be 1-128 characters of letters, digits and ':._-'",
            param="previous_response_id",
            code="invalid_previous_response_id",
        )
    return response_id.startswith(RESPONSE_PREFIX)


def parse_event_id(event_id: str) -> tuple[int, int]:
    """``"1700000000000-3"`` -> ``(1700000000000, 3)``.

    Raises:
        BadRequest: not an event id (``param`` is ``Last-Event-ID``).
    """
    m = EVENT_ID_RE.fullmatch(event_id)
    if m is None:
        raise BadRequest(
            "`Last-Event-ID` must be a session event id like 1700000000000-0",
            param="Last-Event-ID",
            code="invalid_event_id",
        )
    return int(m[1]), int(m[2])


def check_vars(values: dict[str, str], param: str) -> dict[str, str]:
    """Return ``values`` if they are acceptable session variables.

    At most 64 names of ``[A-Za-z_][A-Za-z0-9_]*`` (up to 64 characters), values
    up to 1024 characters.

    Raises:
        BadRequest: naming ``param``.
    """
    if len(values) > MAX_VARS:
        raise BadRequest(f"at most {MAX_VARS} session variables per request", param=param)
    for name, value in values.items():
        if not VAR_NAME_RE.fullmatch(name):
            raise BadRequest(
                f"session variable names must match {VAR_NAME_RE.pattern}; got {name[:70]!r}",
                param=param,
            )
        if not isinstance(value, str) or len(value) > MAX_VAR_CHARS:
            raise BadRequest(
                f"session variable {name!r} must be a string of at most {MAX_VAR_CHARS} chars",
                param=param,
            )
    return values


class SessionBus(abc.ABC):
    """Where sessions live. All data methods may raise :class:`SessionBusError`."""

    #: ``memory`` or ``redis`` (for logs and ``/readyz``).
    kind: str = "abstract"

    async def aopen(self) -> None:  # noqa: B027 - optional hook
        """Connect; called once in lifespan start-up, in the task that later calls aclose."""

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
        """Append one request's turns (all with the same ``request_id``); refreshes the TTL.

        Idempotent per request id: if that request's turns are already stored,
        nothing is written and ``[]`` is returned (so the outbox can retry a
        write whose reply was lost). Returns the new event ids.
        """

    @abc.abstractmethod
    async def set_vars(
        self, tenant: str, session_id: str, values: dict[str, str], ttl: int
    ) -> None:
        """Merge ``values`` into the session's variables; refreshes the TTL.

        Raises:
            SessionVarsFull: the merge would pass the bus's :class:`VarCaps`;
                nothing is written.
        """

    async def read(
        self, tenant: str, session_id: str, after: str | None, *, limit: int, block_ms: int
    ) -> list[Event]:
        """Events after the event id ``after``, oldest first, at most ``limit``.

        ``after=None`` means the last ``limit`` events kept. If there are none,
        wait up to ``block_ms`` for new ones (``0``: do not wait) and return
        ``[]`` if none came. Both backends override this; a bus that keeps no
        event stream (a test double) has no events to give.
        """
        await trio.sleep(max(block_ms, 0) / 1000.0)
        return []

    async def follow(
        self,
        tenant: str,
        session_id: str,
        after: str | None,
        send: trio.MemorySendChannel[Event],
        *,
        limit: int = 100,
        block_ms: int = 5_000,
    ) -> None:
        """Send the events after ``after`` into ``send``, then live ones, until cancelled.

        Closes ``send`` when it returns. Raises :class:`SessionBusError` if the
        bus fails.
        """
        async with send:
            while True:
                events = await self.read(
                    tenant, session_id, after, limit=limit, block_ms=block_ms
                )
                for ev in events:
                    await send.send(ev)
                if events:
                    after = events[-1].id
                elif after is None:
                    after = "0-0"
