"""The garbage collector, tuned for a gateway worker process.

CPython's cycle collector runs by allocation counts: a generation-0 collection
every 700 net allocations of container objects, walking every young object, and
now and then a full collection walking everything, start-up included. A gateway
worker allocates many short-lived objects per request (tasks, cancel scopes,
channels, events) that reference counting already frees; the request path leaves
no reference cycles (``tests/test_h1.py`` checks the one it had). Measured at 64
concurrent streams on one worker (docs/benchmarks.md, gc cost: an in-process
hypercorn, ``gc.callbacks`` timing each collection, 6 s): the collector took 12.6 %
of the worker's CPU and collected nothing -- generation 0 4.9 %, 1 4.2 %, 2 3.5 %
(17.5 % in an earlier run on a busier machine).

:func:`tune`, once start-up is done: collect, then :func:`gc.freeze` what
start-up built (modules, the config, compiled patterns, tokenizer tables: some
73,000 objects that every full collection walked), and raise generation 0's
threshold to :data:`GEN0_THRESHOLD`. Same load: one generation-0 collection
instead of 1,357, 0.1 % of the CPU. Cycles that error paths do make
(exceptions and their tracebacks) are still collected, a little later.

The older generations are collected by time, not by count (:class:`OldByTime`):
generation 1 at most every :data:`OLD_EVERY_S` seconds. What a young collection
leaves alive is, under load, the requests in flight; CPython's own rule (generation 1
every 10 young collections) walked them again and again while they were still alive,
so the more requests in flight, the more each one cost: at 1,024 clients on one
worker generation 1 ran ~1.7 times a second, 60-100 ms each, 11-15 % of the worker
(``docs/performance.md``, "Throughput at c = 1,024"). By time, generation 1 holds
what survived :data:`OLD_EVERY_S` of young collections -- not more than the requests
in flight, whose objects die with them -- and is walked a bounded number of times a
second however many requests there are. Generation 2 keeps CPython's rule on top of
it (every 10 collections of generation 1, when what was promoted since is a quarter
of what survived the last one).

Only in a process of the hypercorn binary (:func:`~.startup.hypercorn_process`):
a test process that builds many apps would keep every frozen one for good.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any, Final

#: Net container allocations between generation-0 collections (CPython's default: 700).
GEN0_THRESHOLD: Final = 7000

#: Seconds at least between two collections of generation 1 (and so of generation 2).
OLD_EVERY_S: Final = 2.0

#: Generation 1's threshold while it is not due: young collections it waits for
#: (about 10 a second under load: hours), so only :class:`OldByTime` makes it due.
_NOT_DUE: Final = 1_000_000


class OldByTime:
    """A ``gc.callbacks`` entry that makes generation 1 due every ``every`` seconds.

    Generation 1 is collected when more young collections have run since its last
    one than its threshold: held at :data:`_NOT_DUE`, dropped to 0 by the first
    young collection to end once ``every`` has passed, so the next automatic
    collection is of generation 1 (or 2, by CPython's rule), and raised again when
    that one ends. No collection is run from here (the collector is not reentrant):
    only thresholds change. ``clock``: seconds, monotonic.
    """

    __slots__ = ("clock", "due", "every")

    def __init__(self, every: float = OLD_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every = every
        self.clock = clock
        self.due = clock() + every

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase != "stop":
            return
        g0, g1, g2 = gc.get_threshold()
        if info["generation"] >= 1:
            self.due = self.clock() + self.every
            if g1 != _NOT_DUE:
                gc.set_threshold(g0, _NOT_DUE, g2)
        elif g1 and self.clock() >= self.due:
            gc.set_threshold(g0, 0, g2)


def tune(every: float = OLD_EVERY_S) -> str:
    """Collect, freeze what is alive, raise generation 0's threshold and collect the
    older generations by time (:class:`OldByTime`); say what was done."""
    gc.collect()
    gc.freeze()
    g0, _, g2 = gc.get_threshold()
    gc.set_threshold(max(g0, GEN0_THRESHOLD), _NOT_DUE, g2)
    if not any(isinstance(cb, OldByTime) for cb in gc.callbacks):
        gc.callbacks.append(OldByTime(every))
    return (
        f"froze {gc.get_freeze_count()} start-up objects, generation 0 every "
        f"{gc.get_threshold()[0]} allocations, the older ones every {every:g} s at most"
    )
