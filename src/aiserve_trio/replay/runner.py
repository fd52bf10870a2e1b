"""Running a replay: the slots of ``schedule.py`` sent on time, each measured.

:func:`run` owns the timing; what sends one request is the caller's ``send``
(``client.py`` over HTTP; a fake in tests, so the schedule is checked on Trio's
virtual clock without a socket). For every slot it makes a
:class:`~.timing.StreamTimer` started at the slot's *scheduled* time, and
bounds the request with ``request_timeout`` -- the timeout belongs here, the caller of
``send``, not to the client.

Paced slots (recorded timing, ``--rate``) are started at their time whatever
the target does (open loop); beyond ``max_inflight`` requests in flight a slot
is not sent and counts as an ``inflight_cap`` error, so an overloaded target
shows as errors rather than as a replay that quietly slows down. Unpaced slots
(``--concurrency N``) are sent by N workers back to back (closed loop).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import trio

from .schedule import Slot
from .timing import Result, StreamTimer

#: Sends one request, reporting what arrives to the timer (head, feed, finish).
Send = Callable[[Slot, StreamTimer], Awaitable[None]]


@dataclass(slots=True)
class Progress:
    """Live counts of a replay, and the progress line (pure: the clock is passed in)."""

    started: float = 0.0
    sent: int = 0
    done: int = 0
    errors: int = 0
    inflight: int = 0
    _last_time: float = 0.0
    _last_done: int = 0
    _rate: float = 0.0
    errors_by_kind: dict[str, int] = field(default_factory=dict)

    def start(self, now: float) -> None:
        self.started = self._last_time = now

    def add(self, result: Result) -> None:
        self.done += 1
        if result.error is not None:
            self.errors += 1
            self.errors_by_kind[result.error] = self.errors_by_kind.get(result.error, 0) + 1

    def line(self, now: float, total: int | None = None) -> str:
        """``sent/total, req/s over the time since the last line, errors, in flight, elapsed``."""
        span = now - self._last_time
        if span > 0:
            self._rate = (self.done - self._last_done) / span
            self._last_time, self._last_done = now, self.done
        elapsed = now - self.started
        of = f"/{total}" if total is not None else ""
        worst = max(self.errors_by_kind.items(), key=lambda kv: kv[1], default=None)
        why = f" (most: {worst[0]} {worst[1]})" if worst is not None else ""
        return (
            f"replay {self.done}{of} done, {self._rate:6.1f} req/s, {self.errors} errors{why}, "
            f"{self.inflight} in flight, {int(elapsed) // 60:02d}:{int(elapsed) % 60:02d}"
        )


async def _one(
    slot: Slot, scheduled: float, send: Send, deadline: float, stream: bool, progress: Progress,
    rpc: bool = False,
) -> Result:  # fmt: skip
    timer = StreamTimer(slot.n, slot.record, scheduled, stream=stream, rpc=rpc)
    progress.sent += 1
    progress.inflight += 1
    try:
        with trio.move_on_at(deadline) as scope:
            try:
                await send(slot, timer)
            except Exception as exc:  # a transport error is a result, not a crash
                return timer.fail(type(exc).__name__, trio.current_time())
        if scope.cancelled_caught:
            return timer.fail("timeout", trio.current_time())
        return timer.finish(trio.current_time())
    finally:
        progress.inflight -= 1


async def run(
    slots: Iterator[Slot],
    send: Send,
    *,
    streams: Callable[[int], bool],
    concurrency: int | None = None,
    duration: float | None = None,
    request_timeout: float = 60.0,
    max_inflight: int = 512,
    progress: Progress | None = None,
    rpc: Callable[[int], bool] | None = None,
) -> list[Result]:
    """Send every slot; return the results by their number.

    Args:
        slots: from :func:`~.schedule.plan` (paced: ``at`` set; unpaced: None).
        send: sends one request (see :data:`Send`).
        streams: whether a record's request streams (its body's ``stream``).
        concurrency: workers for unpaced slots.
        duration: unpaced slots stop being taken this many seconds after the start
            (paced ones are cut by the plan itself).
        request_timeout: seconds from a request's scheduled start to giving up on it.
        max_inflight: paced requests in flight at most (see the module docstring).
        progress: counts updated as requests end.
        rpc: whether a record is an MCP tool call (a JSON-RPC answer; default: none is).
    """
    prog = progress if progress is not None else Progress()
    start = trio.current_time()
    prog.start(start)
    results: list[Result] = []
    end = start + duration if duration is not None else math.inf

    async def one(slot: Slot, scheduled: float) -> None:
        deadline = scheduled + request_timeout
        is_rpc = rpc is not None and rpc(slot.record)
        result = await _one(slot, scheduled, send, deadline, streams(slot.record), prog, is_rpc)
        results.append(result)
        prog.add(result)

    async with trio.open_nursery() as nursery:
        if concurrency is not None:

            async def worker() -> None:
                # One iterator shared by the workers: Trio runs one task at a time.
                for slot in slots:
                    now = trio.current_time()
                    if now >= end:
                        return
                    await one(slot, now)

            for _ in range(concurrency):
                nursery.start_soon(worker)
        else:
            for slot in slots:
                assert slot.at is not None, "a paced replay needs times"
                scheduled = start + slot.at
                await trio.sleep_until(scheduled)
                if prog.inflight >= max_inflight:
                    capped = StreamTimer(slot.n, slot.record, scheduled, stream=False)
                    result = capped.fail("inflight_cap", trio.current_time())
                    results.append(result)
                    prog.add(result)
                    continue
                nursery.start_soon(one, slot, scheduled)
    results.sort(key=lambda r: r.n)
    return results
