"""The bound on requests starting at once follows the worker's CPU (``http/turns.py``,
``Pace``, ``[deadline] min_starting``/``max_starting``): a CPU-bound worker with requests
waiting lets fewer start (each one past its turn is objects the collector walks again),
one with requests waiting and time to spare lets more start, down to the floor and up to
the ceiling; windows nobody waited in, or far longer than a window, change nothing.
The core on numbers, the queue on clocks the test moves."""

from __future__ import annotations

import math
import time

import pytest
import trio
import trio.testing

from aiserve_trio.http.turns import LoopIdle, Pace, Turn, Turns

from .asgi_client import Client, chat_body
from .test_fair_turns import turns_app

W = Pace.window


def windows(pace: Pace, limit: int, busy: float, n: int, waited: bool = True) -> list[int]:
    """The limits after ``n`` windows, each ``busy`` of its wall time on the CPU."""
    wall = cpu = 0.0
    pace.next_limit(limit, wall, cpu)  # the first window starts at 0
    out = []
    for _ in range(n):
        pace.waited = waited
        wall += W
        cpu += W * busy
        limit = pace.next_limit(limit, wall, cpu)
        out.append(limit)
    return out


def test_a_cpu_bound_worker_with_requests_waiting_lets_fewer_start_down_to_the_floor() -> None:
    assert windows(Pace(16, 128, 0.0, 0.0), 128, busy=1.0, n=9) == [
        96,
        72,
        54,
        41,
        31,
        24,
        18,
        16,
        16,
    ]


def test_a_worker_with_time_to_spare_and_requests_waiting_lets_more_start_up_to_the_ceiling() -> (
    None
):
    assert windows(Pace(16, 128, 0.0, 0.0), 16, busy=0.5, n=4) == [32, 64, 128, 128]


def test_between_busy_and_idle_the_bound_holds() -> None:
    assert windows(Pace(16, 128, 0.0, 0.0), 40, busy=0.9, n=3) == [40, 40, 40]


def test_windows_nobody_waited_in_or_a_worker_that_slept_change_nothing() -> None:
    assert windows(Pace(16, 128, 0.0, 0.0), 40, busy=1.0, n=3, waited=False) == [40, 40, 40]
    pace = Pace(16, 128, 0.0, 0.0)
    pace.waited = True
    assert pace.next_limit(40, 10 * W, 0.0) == 40  # 10 windows long, idle: it slept
    assert not pace.waited  # and the next window starts afresh


class Clocks:
    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0

    def run(self, seconds: float, busy: float) -> None:
        self.wall += seconds
        self.cpu += seconds * busy


async def test_the_queue_lets_fewer_start_when_cpu_bound_and_more_when_not() -> None:
    clocks = Clocks()
    turns = Turns(wall=lambda: clocks.wall, cpu=lambda: clocks.cpu)
    turns.bound(2, 8)
    assert turns.limit == 8
    held = [await turns.take(math.inf) for _ in range(8)]
    got: list[Turn | None] = []

    async def wait() -> None:
        got.append(await turns.take(math.inf))

    async with trio.open_nursery() as nursery:
        clocks.run(W, busy=1.0)  # a window on the CPU, and a request must wait
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        assert turns.limit == 6
        # Two turns given back do not make room under the new bound; the third does.
        for turn in held[:2]:
            assert turn is not None
            turn.release()
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        held[2].release()  # type: ignore[union-attr]
        await trio.testing.wait_all_tasks_blocked()
        assert len(got) == 1

        nursery.start_soon(wait)  # waits: no window has passed since the last decision
        await trio.testing.wait_all_tasks_blocked()
        assert (len(got), turns.waiting) == (1, 1)
        clocks.run(W, busy=0.2)  # time to spare: the one waiting and the next both start
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        assert turns.limit == 8
        assert len(got) == 3
        assert (turns.active, turns.waiting) == (8, 0)


async def test_the_worker_takes_its_bounds_from_the_config() -> None:
    app = turns_app("max_starting = 64\nmin_starting = 4")
    resp = await Client(app).chat(chat_body("hi"))
    assert resp.status == 200
    turns = app.gateway.entry.turns
    assert turns.limit == 64
    assert turns.pace is not None
    assert (turns.pace.floor, turns.pace.ceiling) == (4, 64)
    fixed = turns_app("max_starting = 64\nmin_starting = 64")
    await Client(fixed).chat(chat_body("hi"))
    assert fixed.gateway.entry.turns.pace is None


async def test_the_loop_is_idle_while_it_waits_with_nothing_to_run_not_while_it_runs() -> None:
    idle = LoopIdle()
    trio.lowlevel.add_instrument(idle)
    try:
        start, ran = time.perf_counter(), idle.running()
        await trio.sleep(0.05)  # nothing else to run: the loop waits
        slept = time.perf_counter() - start
        assert idle.running() - ran < slept / 2
        start, ran = time.perf_counter(), idle.running()
        end = start + 0.05
        while time.perf_counter() < end:  # work, with checkpoints: polls, no idle wait
            await trio.lowlevel.checkpoint()
        worked = time.perf_counter() - start
        assert idle.running() - ran > worked * 0.9
    finally:
        trio.lowlevel.remove_instrument(idle)


async def test_the_bound_and_the_queue_are_gauges() -> None:
    app = turns_app("max_starting = 64\nmin_starting = 4")
    assert (await Client(app).chat(chat_body("hi"))).status == 200
    turns = app.gateway.entry.turns
    blocker = [await turns.take(math.inf) for _ in range(3)]
    seen = {}
    for line in app.metrics.render().decode().splitlines():
        if line.startswith("aiserve_starting"):
            name, value = line.split()
            seen[name] = float(value)
    assert seen == {
        "aiserve_starting_limit": 64.0,
        "aiserve_starting": 3.0,
        "aiserve_starting_waiting": 0.0,
    }
    for turn in blocker:
        assert turn is not None
        turn.release()


async def test_the_loop_clock_is_installed_when_a_request_first_waits_not_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    added: list[trio.abc.Instrument] = []
    monkeypatch.setattr(trio.lowlevel, "add_instrument", added.append)
    turns = Turns()
    turns.bound(2, 8)
    held = [await turns.take(math.inf) for _ in range(8)]
    assert added == []  # nobody waited: no cost a pass
    assert await turns.take(0.0) is None  # waits (and gives up at once)
    assert len(added) == 1
    assert isinstance(added[0], LoopIdle)
    assert await turns.take(0.0) is None
    assert len(added) == 1  # once
    for turn in held:
        assert turn is not None
        turn.release()
