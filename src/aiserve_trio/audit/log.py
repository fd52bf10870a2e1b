"""The audit log's writer: a bounded queue of rows filled by the request path, a
writer task, batches written off the event loop.

The request path pays for one row: :meth:`AuditLog.offer` (a sink of the
observer, called with every finished request) builds the request's row -- a
flat tuple of names, counts and times, so the
:class:`~aiserve_trio.stages.outcome.Outcome` and all it holds are freed with
the request rather than kept until the batch is written -- and appends it to a
list of at most ``[audit] buffer`` rows. When the list is full -- the database
is slower than the traffic, or gone longer than the buffer lasts -- the row is
dropped and counted (``aiserve_audit_dropped_total{reason="buffer_full"}``): a
request never waits for the database. A plain list rather than a Trio memory
channel: the writer takes the whole list at once, and only a parked writer is
woken.

:meth:`AuditLog.run`, in the app's lifetime nursery, opens and migrates the
database, then waits for a first row, lets the batch gather for ``flush_ms``,
and inserts up to ``[audit] batch`` rows in one transaction in a thread of its
own. A batch stays at the head of the queue until it is written: one that
fails because the database is away (the database's ``transient``) is tried
again after a backoff (0.5 s, doubling to 5 s), and the rows behind it wait,
counted in ``aiserve_audit_rows_pending``, so an outage costs rows only once
the buffer is full (8,192 rows: 160 s at 50 requests/s). A batch the database
refuses for good (a row it will never take) is dropped and counted
(``reason="db_error"``). A database that cannot be reached at start-up does
not hold the start: the worker serves, queues, and connects (and migrates) when
it can, with the same backoff -- a database that goes away costs rows, never
requests. Rows older than ``retention_days`` are deleted once connected and
every hour. At shutdown :meth:`AuditLog.aclose` stops taking rows and gives the
writer :attr:`grace` seconds to write the rest; rows still queued then are
counted (``reason="shutdown"``).

A request refused for a missing or wrong key is not a row of its own (issue 55:
38,875 wrong keys from as many addresses were 38,875 rows): ``offer`` counts it in the
current interval's :class:`_Window` (a dict update), per (route, client address) for
``unauthorized_addresses`` (16) addresses, the rest together as ``client = "others"``;
when ``unauthorized_interval_s`` (60 s) is over, the writer queues one row per bucket
with its count in ``requests``. An interval is at most 16 rows plus one per chat route,
however many addresses send wrong keys, and every request is counted (usage sums
``requests``; until its interval is written, a usage answer says it is partial).

Usage reads (:meth:`AuditLog.query`) run in threads of a limiter of their own
(``usage_threads``, 4), never Trio's shared one, which also resolves upstream
host names: a client that sends many reads to a slow database gets 503s
(``usage_busy``), not the threads new upstream connections need. A read's
statement ends in the database after ``usage_timeout_ms`` and a cancelled read
stops waiting for its thread at once.

What it costs, with it on and off in one run (docs/benchmarks.md, ab: its example
compares the audit log off and on, --conc 16 --modes json):
29 us of a worker's CPU a non-streamed request at c=16,
~4 % (2026-12-01; the writer's thread ~6 us a row, ``offer`` ~3 us, the rest the
loop running slower beside the writer's work: docs/architecture.md, "Where the
audit log's CPU goes"). Every run of this code pooled (docs/benchmarks.md, pool;
2026-12-02): +3.4 %, 95 % interval +3.2 to +3.7; on another host, where the rest of a
request costs more, the same µs are +2.3 % (+1.9 to +2.8), and on a third +3.8 % (+3.6
to +4.0). Those workers reach their upstream at 127.0.0.1 and never run a thread but the
writer's, whose first-thread cost (~1 %) the log pays there; in a worker that names its
upstream (resolved in a thread) the log costs +2.0 % (+1.5 to +2.4, ``--upstream-host
localhost``, the third host).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import trio
from prometheus_client import Counter, Gauge

from ..core.errors import ConfigError, Overloaded
from ..policies.redact import GdprRedact, build_rules
from ..policies.stream import Rewriter
from .row import Row, RowBuilder, Unredacted, access_line
from .schema import COLUMNS, SchemaTooNew
from .thread import WriterThread

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ..config import Config
    from ..stages.outcome import Outcome
    from .settings import AuditConfig

log = logging.getLogger("aiserve_trio.audit")

#: ``reason`` values of ``aiserve_audit_dropped_total``.
DROP_REASONS = ("buffer_full", "db_error", "unwritable", "shutdown")
#: ``reason`` values of ``aiserve_audit_rows_purged_total``.
PURGE_REASONS = ("retention", "max_rows")
#: ``reason`` values of ``aiserve_audit_usage_refused_total``.
REFUSE_REASONS = ("busy", "unavailable")
#: Seconds the writer gets at shutdown to write what is queued.
CLOSE_GRACE = 2.0
#: Seconds a usage read waits for the rows queued before it to be written.
FLUSH_WAIT_S = 2.0
#: Seconds between two deletions of rows past ``retention_days`` (and two counts of the
#: rows: see :data:`TRIM_TO`).
PURGE_EVERY_S = 3600.0
#: Past ``[audit] max_rows`` the oldest rows are deleted down to this share of it: the
#: next deletion is a tenth of the bound away, not one batch (each costs a count).
TRIM_TO = 0.9
#: The writer's wait after its first failure to write or connect; it doubles with each
#: failure in a row, up to :data:`RETRY_MAX_S`, and starts again after a success.
RETRY_FIRST_S = 0.5
#: The longest wait between two tries: rows are written at most this long after the
#: database is back (and a down database sees one connection attempt per worker this often).
RETRY_MAX_S = 5.0
#: ``Retry-After`` of a usage read refused because every reader's thread is busy.
BUSY_RETRY_AFTER_S = 1
DAY_S = 86_400.0
#: ``status`` of a request refused for a missing or wrong key: counted per address and
#: interval (:class:`_Window`), not a row each.
UNAUTHORIZED = "unauthorized"
#: ``client`` of a window's row for the addresses past ``[audit] unauthorized_addresses``.
OTHERS = "others"
#: ``client`` of a wrong-key request whose address is not known.
UNKNOWN = "unknown"
#: ``client`` is cut to this many characters (an IPv6 address with a zone fits).
MAX_CLIENT_CHARS = 64
_ID, _REQUESTS, _CLIENT = (COLUMNS.index(c) for c in ("request_id", "requests", "client"))


class _Window:
    """The wrong-key requests of one interval: per (route, address), the row of its
    first request and how many came. At most ``unauthorized_addresses`` addresses have
    a bucket of their own; the rest share one per route (``client = "others"``)."""

    __slots__ = ("addresses", "buckets", "closes", "requests")

    def __init__(self, closes: float) -> None:
        #: When the writer turns it into rows (clock seconds).
        self.closes = closes
        self.buckets: dict[tuple[str, str], list[Any]] = {}  # [row, requests]
        self.addresses = 0
        self.requests = 0


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

    def measure(self) -> tuple[int, int]:
        """The rows the table holds and the bytes it (with its indexes) takes."""
        ...

    def trim(self, keep: int) -> int:
        """Delete the oldest rows (by ``ts``) past the newest ``keep``; returns how many."""
        ...

    def query(self, sql: str, params: Sequence[Any], timeout: float) -> list[tuple[Any, ...]]:
        """A read (the usage endpoints), given up by the database after ``timeout`` seconds."""
        ...

    def transient(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised by :meth:`open` or :meth:`insert`, may pass (the database
        is away, busy or full): the batch is kept and tried again, not dropped."""
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
        self.pending = Gauge(
            "aiserve_audit_rows_pending",
            "Rows queued for the audit log and not written yet (the database is slow or "
            "away: they are kept, up to [audit] buffer, and written when it answers).",
            registry=registry,
        )
        self.up = Gauge(
            "aiserve_audit_database_up",
            "1 when the audit log's last connection or write succeeded, else 0.",
            registry=registry,
        )
        self.failures = Counter(
            "aiserve_audit_write_failures",
            "Tries of the audit writer that failed (a batch or a connection; each is "
            "tried again after a backoff).",
            registry=registry,
        )
        self.rows = Gauge(
            "aiserve_audit_database_rows",
            "Rows in the audit database: counted when it is reached and hourly, plus the "
            "rows this worker wrote since (other workers' rows show at the next count).",
            registry=registry,
        )
        self.bytes = Gauge(
            "aiserve_audit_database_bytes",
            "Bytes the audit table and its indexes take (SQLite: the file's pages in use; "
            "PostgreSQL: pg_total_relation_size), at the last count.",
            registry=registry,
        )
        self.max_rows = Gauge(
            "aiserve_audit_database_max_rows",
            "[audit] max_rows: past it the oldest rows are deleted (0: no bound).",
            registry=registry,
        )
        purged = Counter(
            "aiserve_audit_rows_purged",
            "Rows the audit log deleted: older than retention_days, or the oldest past "
            "max_rows.",
            ["reason"],
            registry=registry,
        )
        self.purged = {r: purged.labels(r) for r in PURGE_REASONS}
        refused = Counter(
            "aiserve_audit_usage_refused",
            "Usage reads answered 503: every reader's thread was busy ([audit] "
            "usage_threads), or the database did not answer.",
            ["reason"],
            registry=registry,
        )
        self.usage_refused = {r: refused.labels(r) for r in REFUSE_REASONS}


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
        #: The last try (write or connect) failed: the writer is backing off.
        self._failing = False
        #: Why, in one line (for the log).
        self._last_error = ""
        #: The database was opened and migrated (at start-up, or later by the writer).
        self._opened = False
        #: The writer's next wait after a failure (see :data:`RETRY_FIRST_S`).
        self._delay = RETRY_FIRST_S
        #: Set by :meth:`aclose` to end the writer's backoff.
        self._retry_event: trio.Event | None = None
        #: Where the database calls run: a thread of the writer's own.
        self._thread = WriterThread()
        #: Serialises the writer's database calls (and a purge) on the one connection.
        self._lock = trio.Lock()
        #: The usage reads' threads: never Trio's shared limiter (see the module docstring).
        self._readers = trio.CapacityLimiter(settings.usage_threads)
        self.version = 0
        self.grace = CLOSE_GRACE
        #: The wrong-key requests of the current interval (None: none yet).
        self._window: _Window | None = None
        #: Rows offered (queued or dropped) and rows the writer is done with.
        self._offered = 0
        self._settled = 0
        #: Rows this worker will never write (every reason): usage answers say so.
        self._dropped = 0
        self._progress = trio.Event()
        #: Rows the database holds: the last count plus the rows written since.
        self._rows = 0
        #: The rows were counted since the database was reached (:meth:`_bound`).
        self._counted = False
        metrics.pending.set_function(lambda: len(self._queue))  # read at scrape time
        metrics.rows.set_function(lambda: self._rows)
        metrics.max_rows.set(settings.max_rows)

    # --- the request path -----------------------------------------------------

    def offer(self, outcome: Outcome) -> None:
        """Queue ``outcome``'s row; never blocks (a full queue drops it and counts it)."""
        if self._closed:
            return  # shutting down
        if outcome.status == UNAUTHORIZED:
            self._count_unauthorized(outcome)
            return
        if self._full():
            return
        # Arrival in Unix time: the clock's distance to now, taken now.
        ts = time.time() - (trio.current_time() - outcome.arrival)
        try:
            row = self.builder.row(outcome, ts)
        except Exception:
            log.exception("audit: request %s could not be turned into a row", outcome.request_id)
            self.metrics.dropped["unwritable"].inc()
            self._dropped += 1
            return
        self._enqueue(row)

    def offer_row(self, row: Row) -> None:
        """Queue a row built elsewhere (an MCP tool call's, ``mcp/endpoint.py``); never
        blocks (a full queue drops it and counts it)."""
        if not self._closed and not self._full():
            self._enqueue(row)

    def _full(self) -> bool:
        """The queue is full: the row about to be offered is dropped (and counted)."""
        if len(self._queue) < self.settings.buffer:
            return False
        self.metrics.dropped["buffer_full"].inc()
        self._dropped += 1
        return True

    def _enqueue(self, row: Row) -> None:
        self._queue.append(row)
        self._offered += 1
        wake = self._wake
        if wake is not None:
            self._wake = None
            wake.set()

    def _count_unauthorized(self, outcome: Outcome) -> None:
        """Count a wrong-key request in the current window (a dict update; a row is built
        only for the first request of each (route, address) of the window)."""
        window = self._window
        if window is None:
            closes = trio.current_time() + self.settings.unauthorized_interval_s
            window = self._window = _Window(closes)
            wake = self._wake  # the writer sets its timer to the window's end
            if wake is not None:
                self._wake = None
                wake.set()
        # An address is at most 45 characters; a proxy's header may say anything.
        key = (outcome.route, (outcome.client or UNKNOWN)[:MAX_CLIENT_CHARS])
        bucket = window.buckets.get(key)
        if bucket is None:
            if window.addresses >= self.settings.unauthorized_addresses:
                key = (outcome.route, OTHERS)
                bucket = window.buckets.get(key)
            if bucket is None:
                ts = time.time() - (trio.current_time() - outcome.arrival)
                try:
                    row = self.builder.row(outcome, ts)
                except Exception:
                    log.exception("audit: request %s could not be turned into a row",
                                  outcome.request_id)  # fmt: skip
                    self.metrics.dropped["unwritable"].inc()
                    self._dropped += 1
                    return
                bucket = window.buckets[key] = [row, 0]
                if key[1] != OTHERS:
                    window.addresses += 1
        bucket[1] += 1
        window.requests += 1

    def _close_window(self) -> None:
        """Queue the current window's rows: one per (route, address), with its count."""
        window, self._window = self._window, None
        if window is None:
            return
        batch = secrets.token_hex(8)
        for i, ((_, client), (row, requests)) in enumerate(window.buckets.items()):
            if len(self._queue) >= self.settings.buffer:
                self.metrics.dropped["buffer_full"].inc(requests)
                self._dropped += requests
                continue
            cells = list(row)
            cells[_ID] = f"unauthorized-{batch}-{i}"
            cells[_REQUESTS] = requests
            cells[_CLIENT] = client
            self._queue.append(tuple(cells))
            self._offered += 1

    @property
    def offered(self) -> int:
        """Rows queued so far (the mark a usage read takes before it reads)."""
        return self._offered

    def unwritten(self, offered: int) -> int:
        """Rows missing from the database for a read that took the mark ``offered``: those
        queued before it and still waiting (the database is away), every request this
        worker dropped, and the wrong-key requests of the interval not written yet."""
        window = self._window
        waiting = 0 if window is None else window.requests
        return max(0, offered - self._settled) + self._dropped + waiting

    async def settle(self) -> None:
        """Wait until every row queued so far is written (or refused for good)."""
        target = self._offered
        while self._settled < target and self._running:
            await self._progress.wait()

    async def flush(self, wait: float = FLUSH_WAIT_S) -> None:
        """Have the rows queued so far written now, not after the batch's ``flush_ms``, and
        wait for them -- at most ``wait`` seconds (a slow database leaves them queued), and
        not at all while the writer backs off from a database that is away.

        The usage endpoints call it, so that a read sees the requests made before it.
        """
        if self._settled >= self._offered:
            return  # nothing waits to be written
        if self._failing or not self._opened:
            return  # they wait for the database, not for this read: the answer says so
        self._hurry = True
        hurry = self._hurry_event
        if hurry is not None:
            hurry.set()
        with trio.move_on_after(wait):
            await self.settle()

    # --- the writer -----------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the database and write queued rows until :meth:`aclose`.

        A database that cannot be reached does not hold the start: the writer connects
        later (with a backoff) and the rows wait in the queue meanwhile.

        Raises:
            SchemaTooNew: the database was migrated by a newer gateway (before
                ``task_status.started``: this gateway cannot write its rows).
        """
        try:
            opened = await self._open(starting=True)
        except BaseException:
            self._thread.stop()
            raise
        self._running = True
        if not opened:
            log.warning(
                "audit log: %s cannot be reached (%s); serving without it: rows are queued "
                "(%d at most, aiserve_audit_rows_pending) and written once it answers",
                self.db,
                self._last_error,
                self.settings.buffer,
            )
        task_status.started()
        try:
            await self._loop()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(self.grace):
                await self._thread.call(self.db.close)
            self._thread.stop()
            self._close_window()
            left = sum(row[_REQUESTS] for row in self._queue)
            if left:
                self.metrics.dropped["shutdown"].inc(left)
                self._dropped += left
                log.warning("audit: shut down with %d rows not written (database away)", left)
                self._queue.clear()
            self._done.set()

    async def _open(self, *, starting: bool = False) -> bool:
        """Connect and migrate; False if the database cannot be reached (logged, counted).

        Raises:
            SchemaTooNew: at start-up (later, it is logged and tried again).
        """
        try:
            async with self._lock:
                self.version = await self._thread.call(self.db.open)
        except SchemaTooNew as exc:
            if starting:
                raise
            self._failed(exc)
            return False
        except Exception as exc:
            if not starting and not self.db.transient(exc):
                log.error("audit: opening %s failed: %s", self.db, exc)
            self._failed(exc, quiet=starting)  # the start-up's own line says it
            return False
        self._opened = True
        self._succeeded()
        await self._purge()
        # The rows are counted by the writer's loop, once the worker serves: a count(*) of
        # millions of rows must not hold the start.
        self._counted = False
        log.info(
            "audit log: %s (schema version %d, rows kept %s%s%s)",
            self.db,
            self.version,
            f"{self.settings.retention_days} days" if self.settings.retention_days else "forever",
            (
                ", with content: redacted by the route's gdpr-redact, else by the default "
                "gdpr-redact detectors"
            )
            if self.builder.content
            else "",
            ", access log on stderr" if self._access is not None else "",
        )
        return True

    async def _loop(self) -> None:
        next_purge = trio.current_time() + PURGE_EVERY_S
        limit = self.settings.batch
        while True:
            window = self._window
            if window is not None and (self._closed or trio.current_time() >= window.closes):
                self._close_window()
                window = None
            if not self._opened:
                if self._closed:
                    return
                if not await self._open():
                    await self._backoff()
                continue
            if not self._counted:
                self._counted = True
                await self._bound()
            if not self._queue:
                if self._closed:
                    return
                wake = self._wake = trio.Event()
                window = self._window  # a window may have opened since the top of the loop
                due = next_purge if window is None else min(next_purge, window.closes)
                with trio.move_on_at(due):
                    await wake.wait()
                if trio.current_time() >= next_purge:
                    await self._purge()
                    await self._bound()
                    next_purge = trio.current_time() + PURGE_EVERY_S
                continue
            if not self._closed and not self._hurry:
                # Let the batch gather: each batch costs the event loop an interruption.
                hurry = self._hurry_event = trio.Event()
                with trio.move_on_after(self.settings.flush_ms / 1000):
                    await hurry.wait()
                self._hurry_event = None
            self._hurry = False
            # The batch stays at the head of the queue (offer only appends) until it is
            # written: a failed one is tried again, and counts against the buffer meanwhile.
            batch = self._queue[:limit]
            if self.builder.redactor is not None:
                batch = await self._redact(batch)
            if not await self._write(batch):
                if self._closed:
                    return  # what is left is counted by run
                await self._backoff()
                continue
            del self._queue[: len(batch)]
            self._settled += len(batch)
            self._rows += len(batch)
            if 0 < self.settings.max_rows < self._rows:
                await self._bound()
            self._progress.set()
            self._progress = trio.Event()

    async def _redact(self, batch: list[Row]) -> list[Row]:
        """``batch`` with the content its routes left unredacted put through the default
        detectors, in the writer's thread (CPU by the character, never the event loop's),
        and put back at the head of the queue: a batch tried again is not redacted twice."""
        try:
            done = await self._thread.call(self.builder.redact, batch)
        except Exception:  # a bug: the rows are still written, without that content
            log.exception("audit: redacting a batch's content failed; stored without it")
            done = [tuple(None if type(c) is Unredacted else c for c in row) for row in batch]
        self._queue[: len(batch)] = done
        return done

    async def _backoff(self) -> None:
        """Wait before the next try (cut short by :meth:`aclose`); the next wait is longer."""
        delay = self._delay
        self._delay = min(delay * 2, RETRY_MAX_S)
        event = self._retry_event = trio.Event()
        with trio.move_on_after(delay):
            await event.wait()
        self._retry_event = None

    def _failed(self, exc: BaseException, *, quiet: bool = False) -> None:
        self.metrics.failures.inc()
        self.metrics.up.set(0)
        self._last_error = " ".join(str(exc).split()) or type(exc).__name__
        if not self._failing and not quiet:  # once per run of failures, not per try
            log.warning(
                "audit: %s is not answering (%s); %d rows queued, trying again",
                self.db, self._last_error, len(self._queue),
            )  # fmt: skip
        self._failing = True

    def _succeeded(self) -> None:
        self.metrics.up.set(1)
        self._delay = RETRY_FIRST_S
        if self._failing:
            log.info("audit: %s answers again; %d rows queued", self.db, len(self._queue))
        self._failing = False

    async def _write(self, rows: list[Row]) -> bool:
        """Insert ``rows``; False when the database is away (the batch is to be kept)."""
        if not rows:
            return True
        access = self._access

        def write() -> None:
            self.db.insert(rows)
            if access is not None:
                try:
                    access.write(b"".join(access_line(r) for r in rows))
                    access.flush()
                except (OSError, ValueError):  # the rows are in: not a reason to insert again
                    log.warning("audit: the access log could not be written", exc_info=True)

        try:
            async with self._lock:
                # Abandoned only at shutdown after the grace: a hung database must
                # not hold the app's exit.
                await self._thread.call(write)
        except Exception as exc:
            if self.db.transient(exc):
                self._failed(exc)
                return False
            # Refused for good (a row it will never take): kept, it would block the queue.
            self.metrics.dropped["db_error"].inc(len(rows))
            self._dropped += len(rows)
            log.warning("audit: the database refused a batch, %d rows dropped: %s", len(rows), exc)
            return True
        self.metrics.written.inc(len(rows))
        self._succeeded()
        return True

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
            self.metrics.purged["retention"].inc(gone)
            log.info("audit: deleted %d rows older than %d days", gone, days)

    async def _bound(self) -> None:
        """Count the rows (and bytes); past ``max_rows``, delete the oldest down to
        :data:`TRIM_TO` of it. In the writer's thread: a count, and a deletion on the ts
        index, never on the loop."""
        cap = self.settings.max_rows
        db = self.db

        def work() -> tuple[int, int, int]:
            rows, size = db.measure()
            gone = 0
            if cap and rows > cap:
                gone = db.trim(int(cap * TRIM_TO))
                rows, size = db.measure()
            return rows, size, gone

        try:
            async with self._lock:
                rows, size, gone = await self._thread.call(work)
        except Exception as exc:
            log.warning("audit: counting the rows (or deleting past max_rows) failed: %s", exc)
            return
        self._rows = rows
        self.metrics.bytes.set(size)
        if gone:
            self.metrics.purged["max_rows"].inc(gone)
            log.warning(
                "audit: %d rows deleted, oldest first: the database held more than max_rows "
                "(%d); %d kept",
                gone, cap, rows,
            )  # fmt: skip

    async def aclose(self) -> None:
        """Stop taking rows and let the writer write what is queued (at most :attr:`grace`)."""
        self._closed = True
        # Wake the writer, parked on an empty queue, letting a batch gather or backing off.
        for event in (self._wake, self._hurry_event, self._retry_event):
            if event is not None:
                event.set()
        self._wake = None
        if not self._running:
            return
        with trio.CancelScope(shield=True), trio.move_on_after(self.grace):
            await self._done.wait()

    async def query(self, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        """A read for the usage endpoints, in a thread of the readers' own limiter.

        Given up by the database after ``usage_timeout_ms``; a cancelled caller stops
        waiting at once (the thread ends with the statement, holding its token till then,
        so abandoned reads still count against ``usage_threads``).

        Raises:
            Overloaded: 503 with ``Retry-After``: every reader's thread is busy
                (``usage_busy``), or the database is away or did not answer in time
                (``audit_unavailable``).
        """
        if not self._opened:
            raise self._unavailable("it has not been reached since this worker started")
        # The token is taken before to_thread's first checkpoint: no other read can take
        # it between this test and the call.
        if self._readers.available_tokens < 1:
            self.metrics.usage_refused["busy"].inc()
            raise Overloaded(
                f"{self.settings.usage_threads} usage reads are running on this worker; "
                "retry shortly",
                code="usage_busy",
                headers={"Retry-After": str(BUSY_RETRY_AFTER_S)},
            )
        timeout = self.settings.usage_timeout_ms / 1000
        try:
            return await trio.to_thread.run_sync(
                self.db.query, sql, params, timeout,
                limiter=self._readers, abandon_on_cancel=True,
            )  # fmt: skip
        except Exception as exc:
            log.warning("audit: a usage read failed: %s", exc)
            raise self._unavailable("it did not answer") from None

    def _unavailable(self, why: str) -> Overloaded:
        self.metrics.usage_refused["unavailable"].inc()
        return Overloaded(
            f"usage is read from the audit database, and {why}; retry later",
            code="audit_unavailable",
            headers={"Retry-After": str(math.ceil(max(self._delay, 1.0)))},
        )


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
    content = settings.content == "redacted"
    builder = RowBuilder(
        key,
        content=content,
        max_chars=settings.max_content_chars,
        redactor=_default_redactor(config) if content else None,
    )
    access = sys.stderr.buffer if settings.access_log else None
    return AuditLog(settings, db, builder, AuditMetrics(registry), access=access)


def _default_redactor(config: Config) -> Rewriter:
    """The detectors the content of a route without ``gdpr-redact`` goes through: the
    ``gdpr-redact`` policy as ``[policies.gdpr-redact]`` sets it (by default every kind),
    as the recorder builds it (its ``input``/``output`` do not apply: stored data).

    Raises:
        ConfigError: ``[policies.gdpr-redact]`` is not valid.
    """

    policy = config.build_policies(["gdpr-redact"])[0]
    if isinstance(policy, GdprRedact):
        return policy.rewriter
    return Rewriter(build_rules())  # a policy of another kind took the name
