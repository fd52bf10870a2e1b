"""The audit log in PostgreSQL (``[audit] backend = "postgres"``): many gateways, one database.

psycopg 3's blocking API, run by the writer in a worker thread, one call at a
time -- the same shape as SQLite. Chosen over psycopg's non-blocking core on
Trio's waits by measurement (docs/benchmarks.md, audit on PostgreSQL; docs/architecture.md): a
batch in a thread costs the event loop one hand-off, where the non-blocking
core runs the protocol and the row encoding on the loop.

A connection that fails is dropped; the next attempt connects again. What
fails because the server is away (:meth:`PostgresDatabase.transient`: it
cannot be reached, it shut down, a statement was cancelled, its disk is
full) leaves the batch queued for the writer to try again; what the server
refuses for good (a row it will never take) is dropped and counted. Two
gateways starting at once migrate under an advisory lock: one applies the
migrations, the other finds them applied.

A batch whose COMMIT reached the server just before the connection broke was
written, though the writer saw a failure and tries it again: after a failure,
the next batch leaves out the rows already in the table (one query on the ts
index, only then), so a retry does not count a request twice.

A usage read has a connection of its own with ``statement_timeout`` set: a
locked or slow table ends the read in the database, so its thread is not held
longer than ``[audit] usage_timeout_ms``, even once its client has gone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import psycopg

from .row import Row
from .schema import COLUMNS, CREATE_VERSION_TABLE, insert_sql, pending

_INSERT = insert_sql("%s")
_ID, _TS = COLUMNS.index("request_id"), COLUMNS.index("ts")
#: The rows of a batch already in the table (by the ts index, then the id).
_PRESENT = (
    "SELECT request_id FROM audit_requests WHERE ts >= %s AND ts <= %s AND request_id = ANY(%s)"
)
#: The advisory lock migrations take (any constant shared by every gateway).
_MIGRATION_LOCK = 0x61756469  # "audi"
#: The advisory lock a deletion past ``[audit] max_rows`` takes.
_TRIM_LOCK = 0x61756474  # "audt"
#: The oldest rows, by the ts index.
_TRIM = (
    "DELETE FROM audit_requests WHERE ctid IN "
    "(SELECT ctid FROM audit_requests ORDER BY ts LIMIT %s)"
)
CONNECT_TIMEOUT_S = 3


class PostgresDatabase:
    """One PostgreSQL database, named by a DSN (see the module docstring)."""

    placeholder = "%s"
    day_sql = "to_char(to_timestamp(ts) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"

    def __init__(self, dsn: str, *, name: str = "postgres") -> None:
        self._dsn = dsn
        self._name = name
        self._conn: psycopg.Connection[Any] | None = None
        #: The last insert failed: its rows may be in the table all the same.
        self._unsure = False

    def __str__(self) -> str:
        return self._name

    def _connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self._dsn, connect_timeout=CONNECT_TIMEOUT_S)

    def _require(self) -> psycopg.Connection[Any]:
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            self._drop()
            conn = self._conn = self._connect()
        return conn

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()

    def open(self) -> int:
        """Connect and migrate; returns the schema version.

        Raises:
            psycopg.Error: the database cannot be reached or migrated.
            SchemaTooNew: a newer gateway migrated it.
        """
        try:
            return self._migrate(self._require())
        except psycopg.Error:
            self._drop()  # the writer opens again later, on a new connection
            raise

    def _migrate(self, conn: psycopg.Connection[Any]) -> int:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            conn.execute(CREATE_VERSION_TABLE)
            row = conn.execute("SELECT max(version) FROM audit_schema").fetchone()
            current = int(row[0]) if row and row[0] is not None else 0
            for version, statements in pending(current):
                for stmt in statements:
                    conn.execute(stmt.replace("\n", " "))
                conn.execute("DELETE FROM audit_schema")
                conn.execute("INSERT INTO audit_schema (version) VALUES (%s)", (version,))
                current = version
        return current

    @staticmethod
    def transient(exc: BaseException) -> bool:
        """Whether ``exc`` is the server being away or busy (try again later), not a
        refusal of the rows (``OperationalError`` covers refused and lost connections,
        shutdowns, cancelled statements and a full disk; a read-only server is a
        failover under way)."""
        return isinstance(
            exc,
            (psycopg.OperationalError, psycopg.InterfaceError,
             psycopg.errors.ReadOnlySqlTransaction, OSError),
        )  # fmt: skip

    def insert(self, rows: Sequence[Row]) -> None:
        try:
            conn = self._require()
            with conn.transaction(), conn.cursor() as cur:
                if self._unsure:
                    rows = _absent(cur, rows)
                if rows:
                    cur.executemany(_INSERT, rows)
            self._unsure = False
        except psycopg.Error:
            self._drop()  # the next batch connects again
            self._unsure = True
            raise

    def purge(self, before: float) -> int:
        try:
            conn = self._require()
            with conn.transaction():
                cur = conn.execute("DELETE FROM audit_requests WHERE ts < %s", (before,))
                return cur.rowcount
        except psycopg.Error:
            self._drop()
            raise

    def measure(self) -> tuple[int, int]:
        """The rows, and the bytes of the table with its indexes and TOAST
        (``pg_total_relation_size``: a deletion's space is reused by later rows once
        vacuumed, not given back to the file system)."""
        try:
            conn = self._require()
            with conn.transaction():
                row = conn.execute(
                    "SELECT count(*), pg_total_relation_size('audit_requests') FROM audit_requests"
                ).fetchone()
        except psycopg.Error:
            self._drop()
            raise
        assert row is not None
        return int(row[0]), int(row[1])

    def trim(self, keep: int) -> int:
        """Delete the oldest rows past the newest ``keep``, under an advisory lock: two
        gateways past the bound at once delete the excess once, not twice."""
        try:
            conn = self._require()
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_TRIM_LOCK,))
                row = conn.execute("SELECT count(*) FROM audit_requests").fetchone()
                excess = (int(row[0]) if row else 0) - keep
                if excess <= 0:
                    return 0
                return conn.execute(_TRIM, (excess,)).rowcount
        except psycopg.Error:
            self._drop()
            raise

    def query(self, sql: str, params: Sequence[Any], timeout: float) -> list[tuple[Any, ...]]:
        """A read on a connection of its own (the usage endpoints), cancelled by the server
        after ``timeout`` seconds (a lock waited for included)."""
        ms = max(1, int(timeout * 1000))
        connect = max(1, min(CONNECT_TIMEOUT_S, int(timeout)))
        with psycopg.connect(
            self._dsn, connect_timeout=connect, options=f"-c statement_timeout={ms}"
        ) as conn:
            return conn.execute(sql, params).fetchall()

    def close(self) -> None:
        self._drop()


def _absent(cur: psycopg.Cursor[Any], rows: Sequence[Row]) -> Sequence[Row]:
    """``rows`` less those already in the table (a batch tried again after an unsure failure)."""
    stamps = [r[_TS] for r in rows]
    cur.execute(_PRESENT, (min(stamps), max(stamps), [r[_ID] for r in rows]))
    present = {row[0] for row in cur.fetchall()}
    return [r for r in rows if r[_ID] not in present] if present else rows
