"""``[audit]``: where each request's row goes; validated at load.

::

    [audit]
    backend = "sqlite"           # "sqlite" (embedded, the default), "postgres" or "off"
    path = "audit.db"            # sqlite: a file, relative to the config file
    dsn_env = "AISERVE_AUDIT_DSN"  # postgres: the environment variable holding the DSN
    retention_days = 90          # rows older than this are deleted (0: kept)
    content = "none"             # "redacted": also the prompt and the reply, after the
                                 # route's gdpr-redact, else the default detectors
    access_log = false           # also each row as one JSON line on stderr
    buffer = 8192                # rows queued for the writer (a failed batch stays queued
                                 # and is retried); beyond, dropped and counted
    flush_ms = 1000              # a row waits at most this long for the rest of its batch
    usage_threads = 4            # usage reads in their own threads at once; more: 503
    usage_timeout_ms = 5000      # a usage read's statement gives up after this long
    max_content_chars = 8192     # content = "redacted": the prompt and the reply each cut
                                 # to this many characters (the row says it was cut)
    unauthorized_interval_s = 60 # wrong-key requests: one row per address and route per
    unauthorized_addresses = 16  # interval, for this many addresses; the rest "others"
    max_rows = 20000000          # past this, the oldest rows are deleted (0: no bound)

Leaf module (msgspec and the decoding helpers): the config imports it.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from ..core.decoding import field_error


class AuditConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    backend: Literal["sqlite", "postgres", "off"] = "sqlite"
    path: str = "audit.db"
    dsn_env: str = "AISERVE_AUDIT_DSN"
    retention_days: int = 90
    #: ``redacted``: the prompt and the reply too, as the route's ``gdpr-redact`` left
    #: them, or through the default ``gdpr-redact`` detectors where it did not redact
    #: (issue 51, item 5: a route without it stored card numbers and e-mails in full).
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
    #: The prompt and the reply of ``content = "redacted"`` are each cut to this many
    #: characters (issue 55: a 100 KB prompt was an 87.6 KB row, a 1 MB body up to
    #: 0.8 MB); a cut text's row keeps its length (``prompt_chars``, ``reply_chars``).
    #: Cutting is a length check on the request path, and a slice only when over.
    max_content_chars: int = 8192
    #: Requests refused for a missing or wrong key are not a row each (issue 55: 38,875
    #: rows from as many addresses): they are counted per (route, client address) for
    #: this long, then written as one row per pair with the count (``requests``).
    unauthorized_interval_s: float = 60.0
    #: Addresses given a row of their own per interval; the requests of the others are
    #: one row per route with ``client = "others"``. An interval is at most this many
    #: rows plus one per chat route, however many addresses send wrong keys.
    unauthorized_addresses: int = 16
    #: Rows the database keeps at most, besides ``retention_days``: past it the oldest
    #: are deleted, down to 90 % of it (0: no bound). A row without content takes ~116
    #: bytes in SQLite (1,000,000 rows: 111 MiB with the indexes), so 20,000,000 ~2.3 GB;
    #: with content, at most ~2 x ``max_content_chars`` characters more.
    max_rows: int = 20_000_000

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
        if self.max_content_chars < 1:
            raise field_error("max_content_chars", "must be at least 1")
        if not 1.0 <= self.unauthorized_interval_s <= 3600.0:
            raise field_error("unauthorized_interval_s", "must be between 1 and 3600")
        if not 0 <= self.unauthorized_addresses <= 1024:
            raise field_error("unauthorized_addresses", "must be between 0 and 1024")
        if self.max_rows < 0:
            raise field_error("max_rows", "must not be negative")
        if not self.path:
            raise field_error("path", "must not be empty")
