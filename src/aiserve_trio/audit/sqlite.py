"""The audit log in SQLite (the standard library's ``sqlite3``): the embedded default.

Every method blocks; the writer calls them in a worker thread, one at a time.
The file is in WAL mode, so that the usage endpoints read (each on a
connection of its own, also in a thread) while the writer writes. A read
gives up after ``[audit] usage_timeout_ms``: the busy timeout bounds its wait
for a lock, a progress handler the statement itself.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, cast

from .row import Row
from .schema import CREATE_VERSION_TABLE, insert_sql, pending

_INSERT = insert_sql("?")

# ``sqlite3`` binds an int, a float or a str as it is, but takes any other value --
# None included -- through its adapter registry: a (type, protocol) key built and looked
# up, then ``__adapt__`` and ``__conform__`` looked for. A row has ten or so NULL
# columns. With an adapter of None to None (``{}.get(None)`` is None, called in C) the
# first lookup finds it: the same NULLs, a third less of the insert's CPU (6.1 -> 4.4 us
# a row, ``executemany`` of 1,700-row batches; docs/architecture.md). The registry is
# the process's, and binding None is all this changes.
sqlite3.register_adapter(type(None), cast("Callable[[None], None]", {}.get))

#: Rows inserted between two offers of the CPU. The writer's thread shares the worker's
#: CPU at the worker's priority (audit/thread.py): a second's batch inserted at one go
#: holds the CPU for several ms while requests wait. 128 rows are ~0.6 ms; then the
#: thread yields (``sched_yield``) and the event loop runs. Measured against one
#: ``executemany`` per batch (docs/benchmarks.md, ab: c=16, 8 rounds): p99 16.3
#: against 17.6 ms (medians; lower in every round), throughput no lower.
CHUNK = 128
#: Rows deleted per transaction past ``[audit] max_rows``.
TRIM_CHUNK = 10_000
#: The oldest rows, by the ts index.
_TRIM = (
    "DELETE FROM audit_requests WHERE rowid IN "
    "(SELECT rowid FROM audit_requests ORDER BY ts LIMIT ?)"
)
_yield_cpu: Callable[[], None] = getattr(os, "sched_yield", None) or partial(time.sleep, 0)


class SQLiteDatabase:
    """One SQLite file (see the module docstring)."""

    placeholder = "?"
    #: How a Unix time column becomes a ``YYYY-MM-DD`` day in SQL.
    day_sql = "strftime('%Y-%m-%d', ts, 'unixepoch')"

    def __init__(self, path: Path) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = None

    def __str__(self) -> str:
        return f"sqlite:{self.path}"

    def _connect(self) -> sqlite3.Connection:
        # Used by one thread at a time (the writer's), not always the same thread.
        conn = sqlite3.connect(self.path, timeout=5.0, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    def open(self) -> int:
        """Connect and migrate; returns the schema version.

        Raises:
            sqlite3.Error, OSError: the file cannot be opened or migrated.
            SchemaTooNew: a newer gateway migrated it.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = self._conn = self._connect()
        conn.execute(CREATE_VERSION_TABLE)
        row = conn.execute("SELECT max(version) FROM audit_schema").fetchone()
        current = int(row[0]) if row and row[0] is not None else 0
        for version, statements in pending(current):
            with conn:  # one transaction per migration
                for stmt in statements:
                    conn.execute(stmt)
                conn.execute("DELETE FROM audit_schema")
                conn.execute("INSERT INTO audit_schema (version) VALUES (?)", (version,))
            current = version
        return current

    @staticmethod
    def transient(exc: BaseException) -> bool:
        """Whether ``exc`` may pass (a locked or full database, a file that cannot be opened
        now: ``OperationalError``, ``OSError``), not a row refused for good (``IntegrityError``)."""
        return isinstance(exc, (sqlite3.OperationalError, OSError))

    def insert(self, rows: Sequence[Row]) -> None:
        """Insert ``rows`` in one transaction, :data:`CHUNK` at a time, giving up the CPU
        between chunks (see :data:`CHUNK`)."""
        conn = self._require()
        with conn:
            for start in range(0, len(rows), CHUNK):
                if start:
                    _yield_cpu()
                conn.executemany(_INSERT, rows[start : start + CHUNK])

    def purge(self, before: float) -> int:
        """Delete the rows older than Unix time ``before``; returns how many."""
        conn = self._require()
        with conn:
            return conn.execute("DELETE FROM audit_requests WHERE ts < ?", (before,)).rowcount

    def measure(self) -> tuple[int, int]:
        """The rows, and the bytes of the file's pages in use (the free pages a deletion
        leaves are reused by later rows, not given back: the file stays as large)."""
        conn = self._require()
        (rows,) = conn.execute("SELECT count(*) FROM audit_requests").fetchone()
        (pages,) = conn.execute("PRAGMA page_count").fetchone()
        (free,) = conn.execute("PRAGMA freelist_count").fetchone()
        (page,) = conn.execute("PRAGMA page_size").fetchone()
        return int(rows), (int(pages) - int(free)) * int(page)

    def trim(self, keep: int) -> int:
        """Delete the oldest rows past the newest ``keep``, :data:`TRIM_CHUNK` a
        transaction (a reader or another worker's writer waits for one chunk, not for
        them all), giving up the CPU between chunks."""
        conn = self._require()
        (rows,) = conn.execute("SELECT count(*) FROM audit_requests").fetchone()
        excess = int(rows) - keep
        gone = 0
        while excess > 0:
            if gone:
                _yield_cpu()
            with conn:
                n = conn.execute(_TRIM, (min(excess, TRIM_CHUNK),)).rowcount
            if n <= 0:
                break
            gone += n
            excess -= n
        return gone

    def query(self, sql: str, params: Sequence[Any], timeout: float) -> list[tuple[Any, ...]]:
        """Run a read on a connection of its own (the usage endpoints), interrupted after
        ``timeout`` seconds (``sqlite3.OperationalError: interrupted``)."""
        deadline = time.monotonic() + timeout
        conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=timeout)
        try:
            # Every 10,000 virtual-machine steps (well under a millisecond): past the
            # deadline, a non-zero answer interrupts the statement.
            conn.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)
            return conn.execute(sql, params).fetchall()
        finally:
            conn.close()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _require(self) -> sqlite3.Connection:
        if self._conn is None:
            self._conn = self._connect()
        return self._conn
