"""``[sessions]``: the session bus's backend, its Redis, and the bounds of a session.

A leaf module (msgspec and the decoding helpers): the config imports it.
"""

from __future__ import annotations

import msgspec

from ..core.decoding import field_error, not_above, positive
from ..util.redisconn import RedisSettings


class SessionsConfig(RedisSettings):
    """``[sessions]``: where conversations are kept, and their bounds."""

    #: Session variables kept in clear although a route (or the session endpoints)
    #: redacts what is written to the session: templates that need the value.
    clear_vars: list[str] = msgspec.field(default_factory=list)
    #: The Redis backend's server (the schemes: ``RedisSettings.url``).
    url: str = "redis://127.0.0.1:6379/0"
    #: Memory backend: sessions kept at most, and their bytes at most (turns as
    #: encoded JSON, variables, plus a fixed overhead each: ``sessions/memory.py``).
    #: When full, the least recently used session of the tenant holding the most goes.
    max_sessions: int = 10_000
    max_bytes: int = 268_435_456
    #: Memory backend: one session's bytes at most; its oldest turns are dropped past it.
    max_session_bytes: int = 4_194_304
    #: Turns kept per session (``XADD MAXLEN ~``).
    max_turns: int = 100
    #: Turns put into the prompt.
    history_turns: int = 20
    #: Turns kept for write-back while the bus is unreachable.
    outbox_max: int = 10_000
    #: Outbox retry backoff: first delay, doubling up to the max.
    outbox_retry_ms: int = 200
    outbox_retry_max_ms: int = 5_000
    #: System prompt carrying session variables; ``{vars}`` is "name: value" lines.
    system_template: str = "Known facts about this customer:\n{vars}"
    #: ``GET /v1/sessions/{id}/events``: events replayed on connect, heartbeat
    #: comment interval, and the stream's lifetime before the client reconnects.
    replay_events: int = 100
    heartbeat_ms: int = 15_000
    events_max_s: int = 3_600
    #: Variables one session may hold, and their names' and values' UTF-8 bytes in
    #: all: they ride along in every prompt, so a write past either is refused (413).
    max_vars_per_session: int = 128
    max_var_bytes_per_session: int = 32_768

    def __post_init__(self) -> None:
        positive(self, "max_vars_per_session", "max_var_bytes_per_session")
        super().__post_init__()  # the Redis keys, checked in the order they were
        positive(
            self,
            "max_sessions",
            "max_bytes",
            "max_session_bytes",
            "max_turns",
            "outbox_max",
            "outbox_retry_ms",
            "outbox_retry_max_ms",
            "replay_events",
            "heartbeat_ms",
            "events_max_s",
        )
        not_above(self, "outbox_retry_ms", "outbox_retry_max_ms")
        not_above(self, "max_session_bytes", "max_bytes")
        if not 0 <= self.history_turns <= self.max_turns:
            raise field_error("history_turns", "must be between 0 and `max_turns`")
