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

Steps yield by *work done*, not only inside long strings: a request of 100,000
one-character parts has no long string, and a walker that yielded only inside
long ones held the loop for seconds on it (issue 51). A :class:`Meter` is charged
per item visited and per character handled, and says when a step has done its
share; every walker over request data yields when it does.

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
#: What visiting one item (a string, a key, a number, a list element, a content part)
#: costs, in characters: a short string's rewrite is a few regex searches and calls
#: (~20-70 us), the time of ~16 characters of the costliest text.
ITEM_UNITS = 16
#: Work units (characters; an item is :data:`ITEM_UNITS`) a step does before it yields:
#: at ~5 us a unit at worst, ~1-2 ms.
UNITS_PER_STEP = CHARS_PER_STEP


class Meter:
    """Counts the work a piece of steps has done since its last ``yield``.

    A walker charges it for each item it visits (:data:`ITEM_UNITS`) and each
    character it handles, and yields when :meth:`charge` says the step's share is
    done -- so a step is bounded however the work is shaped: one long string,
    or a hundred thousand short ones, or a hundred thousand list elements::

        if meter.charge(ITEM_UNITS + len(text)):
            yield

    Pure: it counts, the caller yields. One meter may be shared by the walkers of
    one piece of work (a request's messages, then its other fields).
    """

    __slots__ = ("per_step", "units")

    def __init__(self, per_step: int = UNITS_PER_STEP) -> None:
        self.per_step = per_step
        self.units = 0

    def charge(self, units: int = ITEM_UNITS) -> bool:
        """Add ``units`` of work; True (and a fresh count) when the step should yield."""
        self.units += units
        if self.units < self.per_step:
            return False
        self.units = 0
        return True

    def items(self, n: int) -> bool:
        """Charge ``n`` items at once (a list decoded in one call)."""
        return self.charge(n * ITEM_UNITS)


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
