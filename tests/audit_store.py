"""The audit log's database calls in a thread of the test's process, for the fake
databases the writer's tests use (the gateway runs them in a process of its own,
``aiserve_trio/audit/process.py``).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import IO, Any, TypeVar

import trio

from aiserve_trio.audit.row import access_line

_T = TypeVar("_T")

_Job = tuple[Callable[[], Any], Callable[[Any, BaseException | None], None]]


class WriterThread:
    """One daemon thread that runs blocking calls in order, on one connection; a call
    abandoned by a cancellation goes on in the thread while its result is dropped."""

    def __init__(self, name: str = "aiserve-audit-writer") -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, deliver = job
            try:
                result, error = fn(), None
            except BaseException as exc:  # handed to the caller, raised there
                result, error = None, exc
            deliver(result, error)

    async def call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` in the thread; its result or its exception.

        Cancellable: a cancelled caller stops waiting and the call finishes unseen.
        """
        self._start()
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        box: list[Any] = []

        def deliver(result: Any, error: BaseException | None) -> None:
            def back() -> None:
                box.append((result, error))
                done.set()

            # A run that is over has nobody waiting for the result.
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(back)

        self._jobs.put((lambda: fn(*args), deliver))
        await done.wait()
        result, error = box[0]
        if error is not None:
            raise error
        return result  # type: ignore[no-any-return]

    def stop(self) -> None:
        """Let the thread end after the calls queued so far."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None


class ThreadStore:
    """A :class:`~aiserve_trio.audit.log.Store` running a database's calls in a
    :class:`WriterThread`."""

    def __init__(self, db: Any, access: IO[bytes] | None = None) -> None:
        """Args:
        db: a :class:`~aiserve_trio.audit.log.Database`.
        access: where the access log's JSON lines go (``[audit] access_log``).
        """
        self.db = db
        self.access = access
        self.placeholder: str = db.placeholder
        self.day_sql: str = db.day_sql
        self._thread = WriterThread()

    def __str__(self) -> str:
        return str(self.db)

    async def open(self) -> int:
        return int(await self._thread.call(self.db.open))

    async def insert(self, rows: list[tuple[Any, ...]]) -> None:
        db, access = self.db, self.access

        def write() -> None:
            db.insert(rows)
            if access is not None:
                access.write(b"".join(access_line(r) for r in rows))
                access.flush()

        await self._thread.call(write)

    async def purge(self, before: float) -> int:
        return int(await self._thread.call(self.db.purge, before))

    async def query(self, sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
        # A connection of its own (``Database.query``): beside the writer, not behind it.
        rows: list[tuple[Any, ...]] = await trio.to_thread.run_sync(self.db.query, sql, params)
        return rows

    async def close(self) -> None:
        try:
            await self._thread.call(self.db.close)
        finally:
            await self.stop()

    async def stop(self) -> None:
        self._thread.stop()
