"""The garbage collector's tuning (``util/gctune.py``): what it does, and where it is applied."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest

from aiserve_trio.runtime.asgi import App
from aiserve_trio.util import gctune

from .conftest import make_config
from .servers import hypercorn_gateway
from .sim_gateway import running


def test_tune_freezes_what_is_alive_and_raises_generation_0s_threshold() -> None:
    # In a process of its own: freezing this one would keep the suite's objects for good.
    code = (
        "import gc, json; from aiserve_trio.util import gctune; "
        "before = gc.get_threshold(); gctune.tune(); said = gctune.tune(); "
        "timed = [type(cb).__name__ for cb in gc.callbacks]; "
        "print(json.dumps([before, gc.get_threshold(), gc.get_freeze_count(), said, timed]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    before, after, frozen, said, timed = json.loads(out)
    assert before[0] < gctune.GEN0_THRESHOLD
    # Generation 1 waits for its time (OldByTime), not for 10 young collections.
    assert after == [gctune.GEN0_THRESHOLD, gctune._NOT_DUE, before[2]]
    assert timed == ["OldByTime"]  # once, however often tune is called
    assert frozen > 1000  # the interpreter and the modules imported
    assert f"froze {frozen}" in said


# Young collections made by allocating (20,000 lists kept: ~28 of them at a
# threshold of 700); a garbage cycle promoted to generation 1 first. In a process of
# its own: the thresholds and callbacks are the process's.
_BY_TIME = """
import gc, json, weakref
from aiserve_trio.util import gctune

now = [0.0]
gens = []
gc.set_threshold(700, gctune._NOT_DUE, 10)
gc.callbacks.append(gctune.OldByTime(every=2.0, clock=lambda: now[0]))
gc.callbacks.append(lambda phase, info: phase == "stop" and gens.append(info["generation"]))

class Node:
    pass

def churn():
    keep = [[i] for i in range(20000)]
    return len(keep)

a, b = Node(), Node()
a.other, b.other = b, a
gone = weakref.ref(a)
gc.collect(0)  # the cycle survives a young collection: it is in generation 1 now
del a, b
gens.clear()
now[0] = 1.9
churn()
before = [list(gens), gone() is not None, gc.get_threshold()[1]]
gens.clear()
now[0] = 2.0
churn()
after = [list(gens), gone() is not None, gc.get_threshold()[1]]
print(json.dumps([before, after]))
"""


def test_the_older_generations_are_collected_by_time_not_by_allocations() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _BY_TIME], capture_output=True, text=True, check=True
    ).stdout
    before, after = json.loads(out)
    young, cycle_alive, g1 = before
    # Before it is due: young collections only, however many (CPython's rule would have
    # collected generation 1 after 10), and the old cycle is still there.
    assert len(young) >= 20
    assert set(young) == {0}
    assert cycle_alive
    assert g1 == gctune._NOT_DUE
    gens, cycle_alive, g1 = after
    # Once due: the next collection is of generation 1, once, and it finds the cycle;
    # then young ones again until the next time.
    assert [g for g in gens if g >= 1] == [1]
    assert gens.index(1) <= 1
    assert set(gens[gens.index(1) + 1:]) == {0}
    assert not cycle_alive
    assert g1 == gctune._NOT_DUE


async def test_an_app_outside_hypercorn_leaves_the_collector_alone() -> None:
    thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()
    async with running(App(make_config())):
        pass
    assert (gc.get_threshold(), gc.get_freeze_count()) == (thresholds, frozen)


@pytest.mark.slow
def test_a_hypercorn_worker_tunes_its_collector_at_start_up() -> None:
    with hypercorn_gateway(None) as (_, proc):
        proc.terminate()
        proc.wait(10)
        assert proc.stdout is not None
        log = proc.stdout.read().decode()
    assert "garbage collector: froze" in log
    assert f"generation 0 every {gctune.GEN0_THRESHOLD} allocations" in log
    assert f"the older ones every {gctune.OLD_EVERY_S:g} s at most" in log
