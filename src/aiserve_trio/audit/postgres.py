"""The audit log in PostgreSQL (``[audit] backend = "postgres"``): many gateways, one database.

psycopg 3's blocking API, run by the writer in a worker thread, one call at a
time -- the same shape as SQLite. Chosen over psycopg's non-blocking core on
Trio's waits by measurement (``bench/audit_pg.py``; docs/architecture.md): a
batch in a thread costs the event loop one hand-off, where the non-blocking
core runs the protocol and the row encoding on the loop.

A connection that fails is dropped; the next attempt connects again. What
fails because the server is away (:meth:`PostgresDatabase.transient`: it
cannot be reached, it shut down, a statement was cancelled, its disk is
full) leaves the batch queued for the writer to try again; what the server
refuses for good (a row it will never take) is dropped and counted. Two
gateways starting at once migrate under an advisory lock: one applies the
migrations, the other finds them applied.

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
from .schema import CREATE_VERSION_TABLE, insert_sql, pending

_INSERT = insert_sql("%s")
#: The advisory lock migrations take (any constant shared by every gateway).
_MIGRATION_LOCK = 0x61756469  # "audi"
CONNECT_TIMEOUT_S = 3


class PostgresDatabase:
    """One PostgreSQL database, named by a DSN (see the module docstring)."""

    placeholder = "%s"
    day_sql = "to_char(to_timestamp(ts) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"

    def __init__(self, dsn: str, *, name: str = "postgres") -> None:
        self._dsn = dsn
        self._name = name
        self._conn: psycopg.Connection[Any] | None = None

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
                cur.executemany(_INSERT, rows)
        except psycopg.Error:
            self._drop()  # the next batch connects again
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
