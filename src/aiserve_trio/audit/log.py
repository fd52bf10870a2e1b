"""The audit log's writer: a bounded queue of rows filled by the request path, a
writer task, batches written off the event loop.

The request path pays for one row: :meth:`AuditLog.offer` (a sink of the
observer, called with every finished request) builds the request's row -- a
flat tuple of names, counts and times, so the
:class:`~aiserve_trio.stages.outcome.Outcome` and all it holds are freed with
the request rather than kept until the batch is written -- and appends it to a
list of at most ``[audit] buffer`` rows. When the list is full -- the database
is slower than the traffic, or gone -- the row is dropped and counted
(``aiserve_audit_dropped_total{reason="buffer_full"}``): a request never waits
for the database. A plain list rather than a Trio memory channel: the writer
takes the whole list at once, and only a parked writer is woken.

:meth:`AuditLog.run`, in the app's lifetime nursery, opens and migrates the
database, then waits for a first row, lets the batch gather for ``flush_ms``,
and inserts up to ``[audit] batch`` rows in one transaction in a worker
thread. A failed insert drops that batch (counted, ``reason="db_error"``,
logged once per run of failures) and the writer goes on: when the database is
back, rows resume. Rows older than ``retention_days`` are deleted at start-up
and every hour. At shutdown :meth:`AuditLog.aclose` stops taking rows and
gives the writer :attr:`grace` seconds to write the rest.

What it costs, with it on and off in one run (``python -m bench.ab
HEAD+bench/configs/audit-off.toml HEAD+bench/configs/audit-on.toml --together
--conc 16 --modes json``): 29 us of a worker's CPU a non-streamed request at c=16,
~4 % (2026-12-01; the writer's thread ~6 us a row, ``offer`` ~3 us, the rest the
loop running slower beside the writer's work: docs/architecture.md, "Where the
audit log's CPU goes"). Every run of this code pooled (``python -m bench.pool``,
2026-12-02): +3.4 %, 95 % interval +3.2 to +3.7; on another host, where the rest of a
request costs more, the same µs are +2.3 % (+1.9 to +2.8), and on a third +3.8 % (+3.6
to +4.0). Those workers reach their upstream at 127.0.0.1 and never run a thread but the
writer's, whose first-thread cost (~1 %) the log pays there; in a worker that names its
upstream (resolved in a thread) the log costs +2.0 % (+1.5 to +2.4, ``--upstream-host
localhost``, the third host).
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import trio
from prometheus_client import Counter

from ..errors import ConfigError
from .row import Row, RowBuilder, access_line
from .thread import WriterThread

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ..config import Config
    from ..stages.outcome import Outcome
    from .settings import AuditConfig

log = logging.getLogger("aiserve_trio.audit")

#: ``reason`` values of ``aiserve_audit_dropped_total``.
DROP_REASONS = ("buffer_full", "db_error", "unwritable")
#: Seconds the writer gets at shutdown to write what is queued.
CLOSE_GRACE = 2.0
#: Seconds a usage read waits for the rows queued before it to be written.
FLUSH_WAIT_S = 2.0
#: Seconds between two deletions of rows past ``retention_days``.
PURGE_EVERY_S = 3600.0
DAY_S = 86_400.0


class Database(Protocol):
    """Where rows go; every method blocks (the writer runs them in a worker thread)."""

    placeholder: str
    day_sql: str

    def open(self) -> int:
        """Connect and apply the pending migrations; returns the schema version."""
        ...

    def insert(self, rows: Sequence[Row]) -> None:
        """Insert ``rows`` in one transaction."""
        ...

    def purge(self, before: float) -> int:
        """Delete rows older than Unix time ``before``."""
        ...

    def query(self, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        """A read (the usage endpoints)."""
        ...

    def close(self) -> None: ...


class AuditMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.written = Counter(
            "aiserve_audit_rows_written",
            "Requests written to the audit log ([audit]).",
            registry=registry,
        )
        dropped = Counter(
            "aiserve_audit_dropped",
            "Requests the audit log dropped: its buffer was full (the database is slow "
            "or gone), the database refused the batch, or the row could not be built.",
            ["reason"],
            registry=registry,
        )
        self.dropped = {r: dropped.labels(r) for r in DROP_REASONS}


class AuditLog:
    """Writes a row per finished request (see the module docstring)."""

    def __init__(
        self,
        settings: AuditConfig,
        db: Database,
        builder: RowBuilder,
        metrics: AuditMetrics,
        *,
        access: IO[bytes] | None = None,
    ) -> None:
        """Args:
        access: where the access log's JSON lines go (``[audit] access_log``).
        """
        self.settings = settings
        self.db = db
        self.builder = builder
        self.metrics = metrics
        self._access = access
        #: Rows waiting for the writer, oldest first (at most ``settings.buffer``).
        self._queue: list[Row] = []
        #: Set by :meth:`offer` when the writer is parked on an empty queue.
        self._wake: trio.Event | None = None
        self._closed = False
        #: A reader asked for the queued rows now (:meth:`flush`); its event cuts the
        #: batch's gathering short.
        self._hurry = False
        self._hurry_event: trio.Event | None = None
        self._running = False
        self._done = trio.Event()
        self._failing = False
        #: Where the database calls run: a thread of the writer's own.
        self._thread = WriterThread()
        #: Serialises the writer's database calls (and a purge) on the one connection.
        self._lock = trio.Lock()
        self.version = 0
        self.grace = CLOSE_GRACE
        #: Rows offered (queued or dropped) and rows the writer is done with.
        self._offered = 0
        self._settled = 0
        self._progress = trio.Event()

    # --- the request path -----------------------------------------------------

    def offer(self, outcome: Outcome) -> None:
        """Queue ``outcome``'s row; never blocks (a full queue drops it and counts it)."""
        if self._closed:
            return  # shutting down
        if len(self._queue) >= self.settings.buffer:
            self.metrics.dropped["buffer_full"].inc()
            return
        # Arrival in Unix time: the clock's distance to now, taken now.
        ts = time.time() - (trio.current_time() - outcome.arrival)
        try:
            row = self.builder.row(outcome, ts)
        except Exception:
            log.exception("audit: request %s could not be turned into a row", outcome.request_id)
            self.metrics.dropped["unwritable"].inc()
            return
        self._queue.append(row)
        self._offered += 1
        wake = self._wake
        if wake is not None:
            self._wake = None
            wake.set()

    async def settle(self) -> None:
        """Wait until every row queued so far is written (or dropped by a failed write)."""
        target = self._offered
        while self._settled < target and self._running:
            await self._progress.wait()

    async def flush(self, wait: float = FLUSH_WAIT_S) -> None:
        """Have the rows queued so far written now, not after the batch's ``flush_ms``, and
        wait for them -- at most ``wait`` seconds (a slow database leaves them queued).

        The usage endpoints call it, so that a read sees the requests made before it.
        """
        if self._settled >= self._offered:
            return  # nothing waits to be written
        self._hurry = True
        hurry = self._hurry_event
        if hurry is not None:
            hurry.set()
        with trio.move_on_after(wait):
            await self.settle()

    # --- the writer -----------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the database and write queued rows until :meth:`aclose`.

        Raises:
            Exception: the database cannot be opened or migrated at start-up
                (before ``task_status.started``: the app does not start without
                the log it was told to keep).
        """
        try:
            self.version = await self._thread.call(self.db.open)
        except BaseException:
            self._thread.stop()
            raise
        await self._purge()
        self._running = True
        log.info(
            "audit log: %s (schema version %d, rows kept %s%s%s)",
            self.db,
            self.version,
            f"{self.settings.retention_days} days" if self.settings.retention_days else "forever",
            ", with redacted content" if self.builder.content else "",
            ", access log on stderr" if self._access is not None else "",
        )
        task_status.started()
        try:
            await self._loop()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(self.grace):
                await self._thread.call(self.db.close)
            self._thread.stop()
            self._done.set()

    async def _loop(self) -> None:
        next_purge = trio.current_time() + PURGE_EVERY_S
        limit = self.settings.batch
        while True:
            if not self._queue:
                if self._closed:
                    return
                wake = self._wake = trio.Event()
                with trio.move_on_at(next_purge):
                    await wake.wait()
                if trio.current_time() >= next_purge:
                    await self._purge()
                    next_purge = trio.current_time() + PURGE_EVERY_S
                continue
            if not self._closed and not self._hurry:
                # Let the batch gather: each batch costs the event loop an interruption.
                hurry = self._hurry_event = trio.Event()
                with trio.move_on_after(self.settings.flush_ms / 1000):
                    await hurry.wait()
                self._hurry_event = None
            self._hurry = False
            batch = self._queue[:limit]
            del self._queue[:limit]
            await self._write(batch)
            self._settled += len(batch)
            self._progress.set()
            self._progress = trio.Event()

    async def _write(self, rows: list[Row]) -> None:
        if not rows:
            return
        access = self._access

        def write() -> None:
            self.db.insert(rows)
            if access is not None:
                access.write(b"".join(access_line(r) for r in rows))
                access.flush()

        try:
            async with self._lock:
                # Abandoned only at shutdown after the grace: a hung database must
                # not hold the app's exit.
                await self._thread.call(write)
        except Exception as exc:
            self.metrics.dropped["db_error"].inc(len(rows))
            if not self._failing:  # once per run of failures, not per batch
                log.warning("audit: writing failed, %d rows dropped: %s", len(rows), exc)
            self._failing = True
        else:
            self.metrics.written.inc(len(rows))
            if self._failing:
                log.info("audit: writing works again")
            self._failing = False

    async def _purge(self) -> None:
        days = self.settings.retention_days
        if not days:
            return
        before = time.time() - days * DAY_S
        try:
            async with self._lock:
                gone = await self._thread.call(self.db.purge, before)
        except Exception as exc:
            log.warning("audit: deleting rows older than %d days failed: %s", days, exc)
            return
        if gone:
            log.info("audit: deleted %d rows older than %d days", gone, days)

    async def aclose(self) -> None:
        """Stop taking rows and let the writer write what is queued (at most :attr:`grace`)."""
        self._closed = True
        # Wake the writer, parked on an empty queue or letting a batch gather.
        for event in (self._wake, self._hurry_event):
            if event is not None:
                event.set()
        self._wake = None
        if not self._running:
            return
        with trio.CancelScope(shield=True), trio.move_on_after(self.grace):
            await self._done.wait()

    async def query(self, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        """A read for the usage endpoints, in a worker thread."""
        return await trio.to_thread.run_sync(self.db.query, sql, params)


def build_audit(config: Config, registry: CollectorRegistry) -> AuditLog | None:
    """The audit log ``[audit]`` asks for (None when it is absent or ``backend = "off"``).

    Raises:
        ConfigError: ``backend = "postgres"`` and the DSN's environment variable is unset.
    """
    settings = config.audit
    if settings is None or settings.backend == "off":
        return None
    db: Database
    if settings.backend == "postgres":
        dsn = os.environ.get(settings.dsn_env)
        if not dsn:
            raise ConfigError(
                f"{config.source}: key `audit.dsn_env`: ${settings.dsn_env} is not set "
                "(the PostgreSQL DSN, e.g. postgresql://user@host:5432/db)"
            )
        from .postgres import PostgresDatabase  # late: psycopg only with this backend

        db = PostgresDatabase(dsn, name=f"postgres (${settings.dsn_env})")
    else:
        from .sqlite import SQLiteDatabase

        db = SQLiteDatabase(Path(os.path.normpath(Path(config.base_dir) / settings.path)))
    key_text = os.environ.get(config.record.session_key_env)
    key = key_text.encode() if key_text else secrets.token_bytes(32)
    builder = RowBuilder(key, content=settings.content == "redacted")
    access = sys.stderr.buffer if settings.access_log else None
    return AuditLog(settings, db, builder, AuditMetrics(registry), access=access)
