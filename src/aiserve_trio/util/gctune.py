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

Only in a process of the hypercorn binary (:func:`~.startup.hypercorn_process`):
a test process that builds many apps would keep every frozen one for good.
"""

from __future__ import annotations

import gc
from typing import Final

#: Net container allocations between generation-0 collections (CPython's default: 700).
GEN0_THRESHOLD: Final = 7000


def tune() -> str:
    """Collect, freeze what is alive, raise generation 0's threshold; say what was done."""
    gc.collect()
    gc.freeze()
    g0, g1, g2 = gc.get_threshold()
    gc.set_threshold(max(g0, GEN0_THRESHOLD), g1, g2)
    return f"froze {gc.get_freeze_count()} start-up objects, thresholds {gc.get_threshold()}"
