"""The recorder: a bounded queue filled by the request path, a writer task, rotating files.

The request path pays for one ``send_nowait``: :meth:`Recorder.offer` (called by
the observer with each finished request) keeps the routes and the sample
fraction ``[record]`` asks for and puts the :class:`~aiserve_trio.stages.outcome.Outcome`
into a Trio memory channel of ``buffer`` places. When the channel is full -- the
disk is slower than the traffic -- the record is dropped and counted
(``aiserve_record_dropped_total{reason="buffer_full"}``); a request never waits
for the disk.

:meth:`Recorder.run`, in the app's lifetime nursery, takes what is queued in
batches, builds the lines (``line.py``; CPU, so a checkpoint after each) and
writes them through a :class:`Disk`: the real one does its file I/O in
``trio.to_thread.run_sync``. Files rotate by size and by age
(:class:`Rotation`, pure), are named
``rec-<UTC start>-<pid>-<seq>.jsonl`` (several workers can share the directory),
and a disk error drops that batch (counted, logged) without stopping the
gateway.

Retention (``keep_bytes``, ``keep_s``): at start, after each new file and every
:data:`PRUNE_EVERY_S`, the writer lists the directory's recording files (every
worker's) and deletes, oldest last write first, those whose last line is older than
``keep_s`` and then the oldest while all together exceed ``keep_bytes``
(:func:`expired`, pure). Never its own open file, nor any file written within
``rotate_s`` (plus a minute): another worker may still have that one open -- a file
is closed ``rotate_s`` after it was started at the latest. So the directory holds at
most ``keep_bytes`` plus what the workers wrote within the last ``rotate_s``. Issue 55:
rotation opened new files and nothing removed the old ones.

A tool call through ``/mcp`` comes the same way: ``mcp/endpoint.py`` offers a
:class:`~.mcpcall.ToolCall` (:meth:`Recorder.offer_call`) when ``/mcp`` is recorded
(``routes`` empty, or naming it), into the same queue and files.

At shutdown :meth:`Recorder.aclose` closes the queue and gives the writer a moment
to write what is left.
"""

from __future__ import annotations

import logging
import math
import os
import random
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol, TypeVar

import trio
from prometheus_client import Counter, Gauge

from ..core.slices import run_sliced
from ..routes import route_label
from ..stages.outcome import Outcome
from .labels import LabelRules
from .line import LineBuilder
from .mcpcall import ToolCall
from .schema import MCP_ROUTE, REPLAY_HEADER

if TYPE_CHECKING:
    from ..config import Config
    from ..observability.metrics import Metrics
    from .settings import RecordConfig

log = logging.getLogger("aiserve_trio.record")
_T = TypeVar("_T")

#: Records taken off the queue per write: bounds a batch's memory and the time
#: the writer holds the event loop between checkpoints.
MAX_BATCH = 256
#: ``reason`` values of ``aiserve_record_dropped_total``.
DROP_REASONS = ("buffer_full", "disk_error", "unrecordable", "replay")
#: Seconds the writer gets at shutdown to write what is queued.
CLOSE_GRACE = 2.0
#: Seconds between two retention passes (besides the one after each new file).
PRUNE_EVERY_S = 300.0
#: A file not written for ``rotate_s`` plus this is taken as closed by its worker.
CLOSE_MARGIN_S = 60.0
#: The recording files of a directory (every worker's).
FILE_GLOB = "rec-*.jsonl"
#: ``reason`` values of ``aiserve_record_files_deleted_total``.
DELETE_REASONS = ("keep_s", "keep_bytes")


@dataclass(frozen=True, slots=True)
class RecFile:
    """A recording file of the directory: its size and the Unix time of its last write."""

    name: str
    size: int
    mtime: float


def expired(
    files: Sequence[RecFile],
    *,
    keep_bytes: int,
    keep_s: float,
    now: float,
    open_name: str | None,
    busy_s: float,
) -> list[tuple[RecFile, str]]:
    """The files to delete and why (``keep_s``, ``keep_bytes``), oldest last write first.

    Files older than ``keep_s`` go; then the oldest while the files' total (every one
    counted, those kept too) is above ``keep_bytes``. Never ``open_name`` (the
    writer's own open file), nor a file written less than ``busy_s`` before ``now``
    (another worker's may be open). 0 turns a bound off.
    """
    total = sum(f.size for f in files)
    gone: list[tuple[RecFile, str]] = []
    for f in sorted(files, key=lambda f: (f.mtime, f.name)):
        if f.name == open_name or now - f.mtime < busy_s:
            continue
        if keep_s and now - f.mtime > keep_s:
            reason = "keep_s"
        elif keep_bytes and total > keep_bytes:
            reason = "keep_bytes"
        else:
            continue
        gone.append((f, reason))
        total -= f.size
    return gone


@dataclass(frozen=True, slots=True)
class Chunk:
    """Lines for one file: ``seq`` is the file's number; ``new_file``: start it first."""

    seq: int
    new_file: bool
    data: bytes
    lines: int


class Rotation:
    """Which file each line goes to (pure: no I/O, the clock is passed in)."""

    def __init__(self, max_bytes: int, max_age: float) -> None:
        self.max_bytes = max_bytes
        self.max_age = max_age
        self.seq = 0
        self.size = 0
        #: When the current file was started (clock seconds); None: no file open.
        self.opened_at: float | None = None

    def deadline(self) -> float:
        """When the current file must be closed (``inf`` when none is open)."""
        return math.inf if self.opened_at is None else self.opened_at + self.max_age

    def close(self) -> None:
        """The current file is closed (its time is up, or writing to it failed)."""
        self.opened_at = None
        self.size = 0

    def plan(self, lines: list[bytes], now: float) -> list[Chunk]:
        """Split ``lines`` into the files they go to, starting new ones as needed.

        A file is started when none is open, when the current one is ``max_age``
        old, or when the next line would take it past ``max_bytes`` (a line larger
        than ``max_bytes`` gets a file of its own rather than being cut).
        """
        chunks: list[Chunk] = []
        pending: list[bytes] = []
        new_file = False

        def flush() -> None:
            if pending:
                chunks.append(Chunk(self.seq, new_file, b"".join(pending), len(pending)))
                pending.clear()

        if self.opened_at is not None and now >= self.deadline():
            self.close()
        for line in lines:
            full = self.size + len(line) > self.max_bytes
            if self.opened_at is None or full:
                flush()
                self.seq += 1
                self.size = 0
                self.opened_at = now
                new_file = True
            pending.append(line)
            self.size += len(line)
        flush()
        return chunks


def private_file(path: Path) -> IO[bytes]:
    """``path`` opened to append, created readable and writable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    # A file created earlier with a looser mode (or under a loose umask) is tightened.
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "ab")


def batch_of(first: _T, inbox: trio.MemoryReceiveChannel[_T], limit: int) -> list[_T]:
    """``first`` and what is queued behind it in ``inbox``, at most ``limit`` in all
    (a writer task's next batch, taken without a trip through the scheduler)."""
    batch = [first]
    while len(batch) < limit:
        try:
            batch.append(inbox.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            break
    return batch


class Disk(Protocol):
    """Where the writer's files go; one file is open at a time."""

    async def prepare(self) -> None:
        """Make sure the files can be written (e.g. create the directory)."""
        ...

    async def open(self, name: str) -> None:
        """Close the current file, if any, and start ``name``."""
        ...

    async def write(self, data: bytes) -> None:
        """Append ``data`` to the current file."""
        ...

    async def close(self) -> None:
        """Close the current file, if any."""
        ...

    async def listing(self) -> list[RecFile]:
        """The directory's recording files (every worker's)."""
        ...

    async def remove(self, names: Sequence[str]) -> None:
        """Delete these files (one another worker deleted first is no error)."""
        ...


class ThreadDisk:
    """Files in a directory, every blocking call in a worker thread."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._file: IO[bytes] | None = None

    def __str__(self) -> str:
        return str(self.directory)

    async def prepare(self) -> None:
        # Recordings hold what customers sent: the owner's only (0700 / 0600).
        await trio.to_thread.run_sync(
            lambda: self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        )

    async def open(self, name: str) -> None:
        await self.close()
        self._file = await trio.to_thread.run_sync(private_file, self.directory / name)

    async def write(self, data: bytes) -> None:
        f = self._file
        if f is None:
            raise OSError("no recording file is open")

        def write() -> None:
            f.write(data)
            # Flushed per batch: a line is whole on disk once its batch is written,
            # so a crash loses at most the batch in flight. Not fsynced: a
            # recording is a sample of traffic, not a ledger.
            f.flush()

        # Abandoned if cancelled (only at shutdown, after the grace): a hung disk
        # (a stale NFS mount) must not hold the app's exit. The thread finishes or
        # dies with the process; the recording has ended either way.
        await trio.to_thread.run_sync(write, abandon_on_cancel=True)

    async def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            await trio.to_thread.run_sync(f.close, abandon_on_cancel=True)

    async def listing(self) -> list[RecFile]:
        def scan() -> list[RecFile]:
            found = []
            for path in self.directory.glob(FILE_GLOB):
                try:
                    st = path.stat()
                except FileNotFoundError:  # deleted meanwhile (another worker)
                    continue
                found.append(RecFile(path.name, st.st_size, st.st_mtime))
            return found

        return await trio.to_thread.run_sync(scan, abandon_on_cancel=True)

    async def remove(self, names: Sequence[str]) -> None:
        def unlink() -> None:
            for name in names:
                (self.directory / name).unlink(missing_ok=True)

        await trio.to_thread.run_sync(unlink, abandon_on_cancel=True)


class Recorder:
    """Records finished chat requests (see the module docstring)."""

    def __init__(
        self,
        settings: RecordConfig,
        builder: LineBuilder,
        metrics: Metrics,
        routes: Mapping[str, str],
        *,
        disk: Disk,
        rng: random.Random | None = None,
        started: float | None = None,
        note: str = "",
        wall: Callable[[], float] = time.time,
    ) -> None:
        """Args:
        settings: ``[record]``.
        builder: makes the lines; its ``clock_start`` is set when :meth:`run` starts.
        metrics: where written and dropped records are counted.
        routes: the routes recorded, label -> path.
        disk: where the files go.
        rng: the sampling draw (tests seed it).
        started: Unix time in the files' names (default: now).
        note: said in the log line when recording starts.
        wall: Unix time now, against the files' last writes (retention; tests pass
            one that follows the virtual clock).
        """
        self.settings = settings
        self.builder = builder
        self.routes = dict(routes)
        self.disk = disk
        self._rng = rng or random.Random()
        self._sample = settings.sample
        self._outbox, self._inbox = trio.open_memory_channel[Outcome | ToolCall](settings.buffer)
        self._rotation = Rotation(settings.rotate_bytes, settings.rotate_s)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started or time.time()))
        self._prefix = f"rec-{stamp}-{os.getpid()}"
        self._written = metrics.records_written
        self._dropped = {r: metrics.record_dropped.labels(r) for r in DROP_REASONS}
        self._running = False
        self._done = trio.Event()
        self._disk_failing = False
        self._note = note
        self.wall = wall
        #: This writer's open file (never deleted by retention).
        self._open_name: str | None = None
        self._next_prune = -math.inf  # a pass at start
        registry = metrics.registry
        deleted = Counter(
            "aiserve_record_files_deleted",
            "Recording files deleted: older than [record] keep_s, or the oldest while the "
            "directory's files are above keep_bytes.",
            ["reason"],
            registry=registry,
        )
        self._deleted = {r: deleted.labels(r) for r in DELETE_REASONS}
        self._kept_bytes = Gauge(
            "aiserve_record_directory_bytes",
            "Bytes of the recording directory's files (every worker's) after the last "
            "retention pass ([record] keep_bytes).",
            registry=registry,
        )
        #: Seconds the writer gets at shutdown (and to close its file) before it is left.
        self.grace = CLOSE_GRACE

    # --- the request path -----------------------------------------------------

    def offer(self, outcome: Outcome) -> None:
        """Queue ``outcome`` for the writer if its route is recorded and it is sampled.

        Never blocks: a full queue drops the record and counts it.
        """
        if outcome.route not in self.routes:
            return
        info = outcome.info
        if (
            info is not None
            and REPLAY_HEADER in info.headers
            and not self.settings.include_replays
        ):
            self._dropped["replay"].inc()
            return
        self._queue(outcome)

    def offer_call(self, call: ToolCall) -> None:
        """Queue a tool call through ``/mcp`` if ``/mcp`` is recorded and it is sampled.

        Never blocks: a full queue drops the record and counts it.
        """
        if MCP_ROUTE not in self.routes:
            return
        if call.replayed and not self.settings.include_replays:
            self._dropped["replay"].inc()
            return
        self._queue(call)

    def _queue(self, item: Outcome | ToolCall) -> None:
        if self._sample < 1.0 and self._rng.random() >= self._sample:
            return
        try:
            self._outbox.send_nowait(item)
        except trio.WouldBlock:
            self._dropped["buffer_full"].inc()
        except trio.ClosedResourceError:
            pass  # shutting down: the recording has ended

    # --- the writer -----------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write queued records until :meth:`aclose` (or cancellation).

        Raises:
            OSError: the directory cannot be created (before ``task_status.started``,
                so that the app does not start recording into nothing).
        """
        await self.disk.prepare()
        # The recording starts now: every line's offset counts from here.
        self.builder.started = time.time()
        self.builder.clock_start = trio.current_time()
        self._running = True
        log.info(
            "recording %s of routes %s to %s%s%s",
            f"{self._sample:.0%}",
            ", ".join(sorted(self.routes.values())),
            self.disk,
            "" if self.builder.redactor is not None else " (NOT redacted: redact = false)",
            f"; {self._note}" if self._note else "",
        )
        task_status.started()
        try:
            await self._loop()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(self.grace):
                try:
                    await self.disk.close()
                except OSError as exc:
                    log.warning("recording: closing the file failed: %s", exc)
            self._done.set()

    async def _loop(self) -> None:
        while True:
            first: Outcome | ToolCall | None = None
            with trio.move_on_at(min(self._rotation.deadline(), self._next_prune)):
                try:
                    first = await self._inbox.receive()
                except trio.EndOfChannel:
                    return
            now = trio.current_time()
            if now >= self._next_prune:
                await self._prune()
            if first is None:
                if now >= self._rotation.deadline():  # the file is as old as files get
                    self._rotation.close()
                    await self._close_file()
                continue
            await self._write(await self._lines(batch_of(first, self._inbox, MAX_BATCH)))

    async def _lines(self, batch: list[Outcome | ToolCall]) -> list[bytes]:
        lines = []
        for item in batch:
            try:
                # Redaction is CPU by the character: in slices, between which
                # the requests in flight run.
                if isinstance(item, ToolCall):
                    steps = self.builder.call_line_steps(item)
                else:
                    steps = self.builder.line_steps(item, self.routes[item.route])
                lines.append(await run_sliced(steps))
            except Exception:
                # A request the builder cannot record must not stop the recording.
                what = (
                    f"tool call {item.server}/{item.tool}"
                    if isinstance(item, ToolCall)
                    else f"request {item.request_id}"
                )
                log.exception("recording: %s could not be recorded", what)
                self._dropped["unrecordable"].inc()
            await trio.lowlevel.checkpoint()
        return lines

    async def _write(self, lines: list[bytes]) -> None:
        chunks = self._rotation.plan(lines, trio.current_time())
        done = 0
        try:
            for chunk in chunks:
                if chunk.new_file:
                    name = f"{self._prefix}-{chunk.seq:05d}.jsonl"
                    self._open_name = None  # closed by open, even if open fails
                    await self.disk.open(name)
                    self._open_name = name
                    self._next_prune = trio.current_time()  # a file closed: a pass next
                await self.disk.write(chunk.data)
                done += chunk.lines
                self._written.inc(chunk.lines)
        except OSError as exc:
            lost = sum(c.lines for c in chunks) - done
            self._dropped["disk_error"].inc(lost)
            if not self._disk_failing:  # once per run of failures, not per batch
                log.warning("recording: writing failed, %d records dropped: %s", lost, exc)
            self._disk_failing = True
            self._rotation.close()
            await self._close_file()
        else:
            if self._disk_failing:
                log.info("recording: writing works again")
            self._disk_failing = False

    async def _prune(self) -> None:
        """Delete the files past ``keep_s`` and ``keep_bytes`` (see the module docstring)."""
        self._next_prune = trio.current_time() + PRUNE_EVERY_S
        s = self.settings
        if not (s.keep_bytes or s.keep_s):
            return
        try:
            files = await self.disk.listing()
            gone = expired(
                files,
                keep_bytes=s.keep_bytes,
                keep_s=s.keep_s,
                now=self.wall(),
                open_name=self._open_name,
                busy_s=s.rotate_s + CLOSE_MARGIN_S,
            )
            if gone:
                await self.disk.remove([f.name for f, _ in gone])
        except OSError as exc:
            log.warning("recording: deleting old files failed: %s", exc)
            return
        for _, reason in gone:
            self._deleted[reason].inc()
        self._kept_bytes.set(sum(f.size for f in files) - sum(f.size for f, _ in gone))
        if gone:
            log.info(
                "recording: deleted %d files (%d bytes), oldest first: past keep_s or keep_bytes",
                len(gone), sum(f.size for f, _ in gone),
            )  # fmt: skip

    async def _close_file(self) -> None:
        self._open_name = None
        try:
            await self.disk.close()
        except OSError as exc:
            log.warning("recording: closing the file failed: %s", exc)

    async def aclose(self) -> None:
        """Stop taking records and let the writer write what is queued (at most :attr:`grace`)."""
        self._outbox.close()
        if not self._running:
            return
        with trio.CancelScope(shield=True), trio.move_on_after(self.grace):
            await self._done.wait()


def recorded_routes(cfg: Config) -> dict[str, str]:
    """The routes ``[record]`` records, label -> path: those it names, else every chat route
    and ``/mcp`` (whose label is its path)."""
    named = set(cfg.record.routes)
    paths = named or {rc.path for rc in cfg.routes if rc.kind == "chat"}
    out = {route_label(rc): rc.path for rc in cfg.routes if rc.path in paths}
    if not named or MCP_ROUTE in named:
        out[MCP_ROUTE] = MCP_ROUTE
    return out


def build_recorder(cfg: Config, metrics: Metrics) -> Recorder | None:
    """The recorder ``[record]`` asks for (None when it is off).

    Raises:
        ConfigError: the default ``gdpr-redact`` cannot be built.
    """
    rec = cfg.record
    if not rec.enabled:
        return None
    recorded = recorded_routes(cfg)
    key_text = os.environ.get(rec.session_key_env)
    key = key_text.encode() if key_text else secrets.token_bytes(32)
    keyed = (
        f"session ids hashed with ${rec.session_key_env}"
        if key_text
        else f"${rec.session_key_env} unset: session ids hashed with a key of this worker only"
    )
    builder = LineBuilder(
        LabelRules(rec.labels, rec.metadata_labels),
        redactor=cfg.build_policies(["gdpr-redact"])[0] if rec.redact else None,
        session_key=key,
        started=0.0,  # both set when the writer starts
        clock_start=0.0,
    )
    directory = Path(os.path.normpath(Path(cfg.base_dir) / rec.path))
    disk = ThreadDisk(directory)
    return Recorder(rec, builder, metrics, recorded, disk=disk, note=keyed)
