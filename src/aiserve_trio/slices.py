"""CPU work of unbounded size, in slices: pure steps, driven with checkpoints.

A request may carry megabytes of text (``max_body_bytes`` is 8 MB), and
redacting, scoring or tokenizing it costs microseconds per character. Done in
one call on the event loop, that stalls every other request of the worker for
seconds. So such work is written as *steps*: a generator that does a bounded
piece of work (a few thousand characters) between ``yield``\\s and returns its
result. The steps stay pure -- no I/O, no Trio -- and are tested as plain
functions through :func:`finish`; the request path drives them with
:func:`run_sliced`, which reaches a Trio checkpoint whenever :data:`SLICE_S` of
CPU has gone by. The checkpoint is also where the stage's cancel scope (its
budget cut point) takes effect, so this time counts like any other stage time.

Why slices and not a worker thread: ``docs/architecture.md`` has the measurement.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import TypeVar

import trio

T = TypeVar("T")
#: A piece of work: yields between bounded pieces, returns its result.
Steps = Generator[None, None, T]
#: Event-loop time a driver gives a piece of work before it lets others run.
SLICE_S = 0.001
#: Characters per step for text work costing up to ~5 us a character (~1-3 ms).
CHARS_PER_STEP = 256


def finish(steps: Steps[T]) -> T:
    """Run ``steps`` to the end at once (pure callers, tests)."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]


async def run_sliced(steps: Steps[T], slice_s: float = SLICE_S) -> T:
    """Run ``steps`` on the event loop, reaching a checkpoint every ``slice_s`` seconds.

    Raises:
        whatever the steps raise; ``trio.Cancelled`` at a checkpoint (the
        generator is closed, so its ``finally`` blocks run).
    """
    clock = time.perf_counter
    until = clock() + slice_s
    try:
        while True:
            try:
                next(steps)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            if clock() >= until:
                await trio.lowlevel.checkpoint()
                until = clock() + slice_s
    finally:
        steps.close()


def text_slices(text: str, size: int = CHARS_PER_STEP) -> list[str]:
    """``text`` cut into pieces of ``size`` characters (one piece for short text)."""
    if len(text) <= size:
        return [text]
    return [text[i : i + size] for i in range(0, len(text), size)]
