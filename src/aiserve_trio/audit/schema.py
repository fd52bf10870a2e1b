"""The audit log's schema: one table, ``audit_requests``, versioned with migrations.

A database records its version in ``audit_schema``; start-up applies every
migration past it, in order, in one transaction each. A migration is a list of
statements both SQLite and PostgreSQL accept (the column types are the common
subset: TEXT, INTEGER, DOUBLE PRECISION). A database newer than this code is
refused rather than written with the wrong columns.
"""

from __future__ import annotations

#: The columns of ``audit_requests``, in insert order.
COLUMNS = (
    "request_id",
    "trace_id",
    "ts",
    "tenant",
    "key_id",
    "route",
    "api",
    "channel",
    "session_hash",
    "model",
    "served_model",
    "deployment",
    "fallback",
    "status",
    "error_code",
    "prompt_tokens",
    "completion_tokens",
    "cost",
    "saved",
    "ttft_ms",
    "total_ms",
    "cache",
    "steps",
    "policy_actions",
    "prompt",
    "reply",
    "prompt_chars",
    "reply_chars",
    "requests",
    "client",
    "cache_read_tokens",
    "cache_write_tokens",
    "cache_cost",
    "usage_source",
)

#: (version, statements): applied in order to a database below that version.
MIGRATIONS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (
        1,
        (
            """CREATE TABLE audit_requests (
                request_id TEXT NOT NULL,
                trace_id TEXT,
                ts DOUBLE PRECISION NOT NULL,
                tenant TEXT NOT NULL,
                key_id TEXT,
                route TEXT NOT NULL,
                api TEXT NOT NULL,
                channel TEXT NOT NULL,
                session_hash TEXT,
                model TEXT NOT NULL,
                served_model TEXT NOT NULL,
                deployment TEXT,
                fallback INTEGER,
                status TEXT NOT NULL,
                error_code TEXT,
                prompt_tokens INTEGER NOT NULL,
                completion_tokens INTEGER NOT NULL,
                cost DOUBLE PRECISION NOT NULL,
                ttft_ms DOUBLE PRECISION,
                total_ms DOUBLE PRECISION NOT NULL,
                cache TEXT,
                steps TEXT,
                policy_actions TEXT
            )""",
            "CREATE INDEX audit_requests_ts ON audit_requests (ts)",
            "CREATE INDEX audit_requests_key_ts ON audit_requests (key_id, ts)",
        ),
    ),
    (
        2,
        (
            # What a cache hit saved; the content, only with [audit] content = "redacted".
            "ALTER TABLE audit_requests ADD COLUMN saved DOUBLE PRECISION NOT NULL DEFAULT 0",
            "ALTER TABLE audit_requests ADD COLUMN prompt TEXT",
            "ALTER TABLE audit_requests ADD COLUMN reply TEXT",
        ),
    ),
    (
        3,
        (
            # Issue 55 (disk bounded). ``prompt_chars`` / ``reply_chars``: NULL, or the
            # text's length in characters when it was cut to ``[audit] max_content_chars``
            # (the stored text is truncated). ``requests``: how many requests the row
            # stands for -- 1, or a window's wrong-key requests from ``client`` (an
            # address, or "others" past ``unauthorized_addresses``).
            "ALTER TABLE audit_requests ADD COLUMN prompt_chars INTEGER",
            "ALTER TABLE audit_requests ADD COLUMN reply_chars INTEGER",
            "ALTER TABLE audit_requests ADD COLUMN requests INTEGER NOT NULL DEFAULT 1",
            "ALTER TABLE audit_requests ADD COLUMN client TEXT",
        ),
    ),
    (
        4,
        (
            # Issue 44, item 3 (prompt-cache accounting): of ``prompt_tokens``, those the
            # backend read from its prompt cache and those it wrote to it; ``cache_cost``:
            # the part of ``cost`` paid for them (each at its own rate in [pricing]).
            "ALTER TABLE audit_requests ADD COLUMN cache_read_tokens INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE audit_requests ADD COLUMN cache_write_tokens INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE audit_requests ADD COLUMN cache_cost DOUBLE PRECISION NOT NULL DEFAULT 0",
        ),
    ),
    (
        5,
        (
            # Issue 50, item 1 (bill on every ending): where the row's token counts came
            # from -- ``provider`` (the backend's own usage) or ``counted`` (the gateway's:
            # the reply never finished, or the backend's count was missing or not
            # believable); NULL on a row nothing was billed for (no answer), and on rows
            # written before this version.
            "ALTER TABLE audit_requests ADD COLUMN usage_source TEXT",
        ),
    ),
)

VERSION = MIGRATIONS[-1][0]

CREATE_VERSION_TABLE = "CREATE TABLE IF NOT EXISTS audit_schema (version INTEGER NOT NULL)"


class SchemaTooNew(Exception):
    """The database was migrated by a newer gateway than this one."""


def pending(current: int) -> list[tuple[int, tuple[str, ...]]]:
    """The migrations a database at version ``current`` needs, in order.

    Raises:
        SchemaTooNew: ``current`` is past :data:`VERSION`.
    """
    if current > VERSION:
        raise SchemaTooNew(
            f"the audit database is at schema version {current}; this gateway knows {VERSION}"
        )
    return [(v, stmts) for v, stmts in MIGRATIONS if v > current]


def insert_sql(placeholder: str) -> str:
    """``INSERT INTO audit_requests`` with one ``placeholder`` (``?`` or ``%s``) per column."""
    marks = ", ".join([placeholder] * len(COLUMNS))
    return f"INSERT INTO audit_requests ({', '.join(COLUMNS)}) VALUES ({marks})"
