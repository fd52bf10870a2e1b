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
        "before = gc.get_threshold(); said = gctune.tune(); "
        "print(json.dumps([before, gc.get_threshold(), gc.get_freeze_count(), said]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    before, after, frozen, said = json.loads(out)
    assert before[0] < gctune.GEN0_THRESHOLD
    assert after == [gctune.GEN0_THRESHOLD, before[1], before[2]]
    assert frozen > 1000  # the interpreter and the modules imported
    assert f"froze {frozen}" in said


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
    assert f"({gctune.GEN0_THRESHOLD}," in log
