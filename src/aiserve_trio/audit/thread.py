"""The audit writer's own thread, at the lowest CPU priority.

The writer's database calls block, so they run off the event loop. They do
not run in Trio's shared thread cache: this thread is the writer's alone and,
on Linux, runs at nice :data:`NICE` (``setpriority`` on its thread id: only
this thread, not the process). A worker is CPU-bound under load, and the
event loop and the writer share its CPU: at the lowest priority the writer
takes the CPU the loop leaves idle and, while the loop is saturated, lets the
rows wait in the queue (dropped and counted once it is full) -- the log's
promise that it never slows a request. Measured with the log on at nice 19
and at nice 0 in one interleaved run (``python -m bench.ab``, c=16, one
worker): throughput within the run's noise of each other (1,625 and 1,644
non-streamed requests/s), the p99 latency lower at nice 19 (14.8 against
16.2 ms non-streamed, 15.4 against 17.7 ms streamed). A thread of Trio's
shared cache would carry the lowered priority to other work, hence one of
its own.

A call abandoned by a cancellation (the shutdown's grace ran out) goes on in
the thread; its result is dropped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import trio

log = logging.getLogger("aiserve_trio.audit")

_T = TypeVar("_T")

#: The writer thread's nice value (Linux; elsewhere the thread keeps the process's).
NICE = 19

_Job = tuple[Callable[[], Any], Callable[[Any, BaseException | None], None]]


class WriterThread:
    """One daemon thread that runs blocking calls in order (see the module docstring)."""

    def __init__(self, name: str = "aiserve-audit-writer", nice: int = NICE) -> None:
        self.name = name
        self.nice = nice
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        if sys.platform == "linux" and self.nice:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except OSError as exc:  # a sandbox that refuses it: run at the usual priority
                log.warning("audit: the writer thread keeps its priority: %s", exc)
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
