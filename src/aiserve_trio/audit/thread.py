"""The audit writer's own thread.

The writer's database calls block, so they run off the event loop, in one thread
of the writer's own rather than Trio's shared cache: the calls run in order on the
one connection, and a call abandoned by a cancellation (the shutdown's grace ran
out) goes on in the thread while its result is dropped.

The thread runs at the worker's own priority. It ran at nice 19 until measured
sharing its CPU with another busy worker (docs/benchmarks.md, ab: --together, c=16,
12 rounds, 2026-12-01, round 6): a writer the
scheduler sets aside while it holds the GIL stalls the event loop, which waits
for the GIL. With the log on, the worker got 18.9 % less of the CPU than its
neighbour with the log off at nice 19 (-27.9 to -5.5), 2.6 % less (-5.1 to 0.0)
at the worker's priority, and its requests cost no less CPU at nice 19 (+40
against +26 us). Alone on its CPU, nice 19 had bought a p99 lower by ~1.4 ms:
not worth a loop stalled behind a thread it cannot preempt.

Having run a thread at all costs a worker ~1 % of a request's CPU for as long as the
process lives, even once the thread has ended (a quarter of it, at most, in glibc's
locking, which leaves its single-thread paths for good). A writer process started
without a thread does not save it: its pipe costs as much (docs/architecture.md,
"Where the audit log's CPU goes").
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import trio

_T = TypeVar("_T")

_Job = tuple[Callable[[], Any], Callable[[Any, BaseException | None], None]]


class WriterThread:
    """One daemon thread that runs blocking calls in order (see the module docstring)."""

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
