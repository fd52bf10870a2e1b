"""``[audit]``: where each request's row goes; validated at load.

::

    [audit]
    backend = "sqlite"           # "sqlite" (embedded, the default), "postgres" or "off"
    path = "audit.db"            # sqlite: a file, relative to the config file
    dsn_env = "AISERVE_AUDIT_DSN"  # postgres: the environment variable holding the DSN
    retention_days = 90          # rows older than this are deleted (0: kept)
    content = "none"             # "redacted": also the prompt and the reply, after the
                                 # route's redaction policies
    access_log = false           # also each row as one JSON line on stderr
    buffer = 8192                # rows queued for the writer (a failed batch stays queued
                                 # and is retried); beyond, dropped and counted
    flush_ms = 1000              # a row waits at most this long for the rest of its batch
    usage_threads = 4            # usage reads in their own threads at once; more: 503
    usage_timeout_ms = 5000      # a usage read's statement gives up after this long

Leaf module (msgspec and the decoding helpers): the config imports it.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from ..decoding import field_error


class AuditConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    backend: Literal["sqlite", "postgres", "off"] = "sqlite"
    path: str = "audit.db"
    dsn_env: str = "AISERVE_AUDIT_DSN"
    retention_days: int = 90
    content: Literal["none", "redacted"] = "none"
    access_log: bool = False
    buffer: int = 8192
    #: Rows written per transaction at most.
    batch: int = 4096
    #: How long the writer lets rows gather after the first of a batch: one trip to the
    #: database thread per batch instead of one per request or two under load. Each
    #: batch also costs the event loop it interrupts: at c=16 on one worker, the log
    #: cost 5.8 % of the requests with 100 ms, 4.1 % with 1 s (docs/architecture.md).
    flush_ms: int = 1000
    #: Usage reads running at once, each in a thread of a limiter of their own: a client
    #: can send reads as fast as it likes, and they must never take the threads of Trio's
    #: shared limiter, which resolves upstream host names (issue 55: 40 reads on a locked
    #: table made every chat that needed a new connection a 504). A read beyond is a 503.
    usage_threads: int = 4
    #: A usage read's statement is cancelled by the database after this long (PostgreSQL's
    #: ``statement_timeout``, SQLite's busy timeout and a progress handler): a read's
    #: thread is held that long at most, even after its client has gone.
    usage_timeout_ms: int = 5000

    def __post_init__(self) -> None:
        if self.retention_days < 0:
            raise field_error("retention_days", "must not be negative")
        if self.buffer < 1:
            raise field_error("buffer", "must be at least 1")
        if self.batch < 1:
            raise field_error("batch", "must be at least 1")
        if self.flush_ms < 0:
            raise field_error("flush_ms", "must not be negative")
        if not 1 <= self.usage_threads <= 32:
            raise field_error("usage_threads", "must be between 1 and 32")
        if not 100 <= self.usage_timeout_ms <= 60_000:
            raise field_error("usage_timeout_ms", "must be between 100 and 60000")
        if not self.path:
            raise field_error("path", "must not be empty")
