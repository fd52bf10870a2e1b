"""Chat requests take their turn in the order they arrived: a bounded FIFO queue before
the gateway's own work on a request (:class:`Turns`, ``[deadline] max_starting``), its
bound adapted to the worker's CPU (:class:`Pace`, ``[deadline] min_starting``)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextvars import ContextVar

import trio

from ..core.errors import Shed, StageDeadlineExceeded


class Pace:
    """How many requests may be starting at once, adapted to the worker's CPU (sans-IO).

    Every request past its turn is objects the worker holds, and under overload CPython's
    cycle collector walks them again at every collection of its younger generations: at
    1,024 clients on one worker, 128 requests starting at once cost ~25 % more CPU a
    request than 16 did, and 16 left the CPU idle no more than 128 did
    (``docs/performance.md``). But a fixed small bound starves a worker whose requests
    wait on I/O while starting (a session store, a semantic cache's embedding call, a
    remote policy): so the bound moves. Over each ``window`` of wall time in which a
    request had to wait for its turn, the time the run loop ran (did not wait for I/O
    with nothing to run: :class:`LoopIdle`) says which: a loop running at least ``busy``
    of the window is CPU-bound -- a quarter fewer turns (not below ``floor``); one
    running less than ``idle`` had work waiting and time to do it -- twice as many (not
    above ``ceiling``). A window in which nobody waited changes nothing (the
    bound does not matter then), nor does one far longer than ``window`` (the worker
    slept: there is nothing to learn from it).
    """

    __slots__ = ("_cpu", "_wall", "ceiling", "floor", "waited")

    #: Seconds of wall time a decision looks back on.
    window = 0.25
    #: The share of a window the loop spent running above which it is CPU-bound.
    busy = 0.95
    #: The share below which, with requests waiting, it had time for more.
    idle = 0.85

    def __init__(self, floor: int, ceiling: int, wall: float, cpu: float) -> None:
        self.floor = floor
        self.ceiling = ceiling
        self._wall = wall
        self._cpu = cpu
        #: A request waited for its turn in this window.
        self.waited = False

    def restart(self, wall: float, cpu: float) -> None:
        """Start a window now (its clocks changed), with nothing decided."""
        self._wall, self._cpu, self.waited = wall, cpu, False

    def due(self, wall: float) -> bool:
        """Whether the window has passed (check before reading the CPU time: cheaper)."""
        return wall - self._wall >= self.window

    def next_limit(self, limit: int, wall: float, cpu: float) -> int:
        """The bound for the next window, given this one's end (``wall``: seconds;
        ``cpu``: of them, those the run loop ran); starts the next window."""
        span = wall - self._wall
        used = cpu - self._cpu
        waited = self.waited
        self._wall, self._cpu, self.waited = wall, cpu, False
        if not waited or span <= 0 or span > 4 * self.window:
            return limit
        share = used / span
        if share >= self.busy:
            return max(self.floor, limit - max(1, limit // 4))
        if share < self.idle:
            return min(self.ceiling, max(limit * 2, self.floor))
        return limit


class LoopIdle(trio.abc.Instrument):
    """The seconds Trio's run loop has run: wall time less the time it waited for I/O
    with nothing to run (a wait with a timeout of 0 is a poll between steps, not idle).

    Not the thread's CPU time: a loop that never waits but gets less than its core
    (other processes on it) is as busy as it can be, and letting more requests start
    would only add to what it holds. Two calls a pass of the run loop.
    """

    __slots__ = ("_since", "idle")

    def __init__(self) -> None:
        self.idle = 0.0
        self._since = 0.0

    def before_io_wait(self, timeout: float) -> None:
        self._since = time.perf_counter() if timeout > 0 else 0.0

    def after_io_wait(self, timeout: float) -> None:
        if self._since:
            self.idle += time.perf_counter() - self._since
            self._since = 0.0

    def running(self) -> float:
        """Seconds (``time.perf_counter``'s) less those the loop was idle."""
        return time.perf_counter() - self.idle


class Turns:
    """Chat requests take their turn in the order they arrived (``[deadline] max_starting``).

    At most ``limit`` requests are *starting* at once -- between their turn and the moment
    their upstream call starts (reading the body, parsing, session context, input
    policies: the gateway's own work before the model's); the others wait in a FIFO queue
    before a byte of their body is read. Without it, under overload every request in the
    worker advanced one scheduler pass at a time and all were late together (1,024 clients
    on one worker: nearly every answer past a 2 s deadline; ``docs/performance.md``); with
    it a request's wait is in one place, in arrival order, where the queue budget sees it.
    A stream is not starting once its upstream call is under way: held streams take no
    turn. ``limit`` 0: no queue. Counting is sans-IO; waiting is a Trio ``ParkingLot``
    (FIFO), a finished turn handed straight to the next waiter (no overtaking).

    With :meth:`bound` (the worker's config: ``min_starting`` below ``max_starting``),
    ``limit`` moves between them with the worker's load (:class:`Pace`): ``wall`` is
    seconds, ``cpu`` the seconds of it the run loop ran (:class:`LoopIdle`, installed
    when a request first waits, unless a test gives its own clocks).
    """

    __slots__ = ("_bounds", "_cpu", "_lot", "_wall", "active", "limit", "pace")

    def __init__(
        self,
        limit: int = 0,
        *,
        wall: Callable[[], float] | None = None,
        cpu: Callable[[], float] | None = None,
    ) -> None:
        self.limit = limit
        #: Requests starting now (turns taken and not yet given back).
        self.active = 0
        self._lot = trio.lowlevel.ParkingLot()
        self._bounds = (limit, limit)
        self._wall: Callable[[], float] = wall or time.perf_counter
        self._cpu: Callable[[], float] | None = cpu
        #: What moves ``limit``; None: it is fixed.
        self.pace: Pace | None = None

    def bound(self, floor: int, ceiling: int) -> None:
        """``limit`` between ``floor`` and ``ceiling`` (fixed at ``ceiling`` when ``floor``
        is not below it, or ``ceiling`` is 0: no queue); a change starts at ``ceiling``."""
        if (floor, ceiling) == self._bounds:
            return
        self._bounds = (floor, ceiling)
        self._set(ceiling)
        if 0 < floor < ceiling:
            cpu = self._cpu
            self.pace = Pace(floor, ceiling, self._wall(), cpu() if cpu is not None else 0.0)
        else:
            self.pace = None

    def _watch_loop(self, pace: Pace) -> Callable[[], float]:
        """The run loop's own clock (:class:`LoopIdle`), installed the first time a request
        waits -- a worker that never queues pays nothing a pass -- and ``pace``'s window
        started on it."""
        running = LoopIdle()
        trio.lowlevel.add_instrument(running)
        self._wall, self._cpu = time.perf_counter, running.running
        pace.restart(self._wall(), running.running())
        return running.running

    def _set(self, limit: int) -> None:
        """A new ``limit``; requests it now lets start get their turns."""
        self.limit = limit
        room = len(self._lot) if not limit else min(limit - self.active, len(self._lot))
        if room > 0:
            self.active += room
            self._lot.unpark(count=room)

    @property
    def waiting(self) -> int:
        return len(self._lot)

    @property
    def full(self) -> bool:
        """Whether a request arriving now would wait for its turn."""
        return bool(self.limit) and (self.active >= self.limit or bool(self._lot))

    async def take(self, until: float) -> Turn | None:
        """A turn, once every request that arrived before has had its own; None when
        ``until`` (clock seconds) came first."""
        if not self.limit or (self.active < self.limit and not self._lot):
            self.active += 1
            return Turn(self)
        pace = self.pace
        if pace is not None:
            cpu = self._cpu or self._watch_loop(pace)
            pace.waited = True
            wall = self._wall()
            if pace.due(wall):
                limit = pace.next_limit(self.limit, wall, cpu())
                if limit != self.limit:
                    self._set(limit)
                    if self.active < limit and not self._lot:  # room now, and nobody ahead
                        self.active += 1
                        return Turn(self)
        if until == math.inf:  # the server's wait before a read: no cancel scope to make
            await self._lot.park()
            return Turn(self)
        with trio.move_on_at(until):
            await self._lot.park()  # a finished turn is handed on: ``active`` is kept
            return Turn(self)
        return None

    def _give(self) -> None:
        if self._lot and (not self.limit or self.active <= self.limit):
            self._lot.unpark()
        else:
            self.active -= 1


class Turn:
    """One request's turn (see :class:`Turns`); :meth:`release` is idempotent."""

    __slots__ = ("_turns",)

    def __init__(self, turns: Turns) -> None:
        self._turns: Turns | None = turns

    @property
    def held(self) -> bool:
        """Not given back yet."""
        return self._turns is not None

    def release(self) -> None:
        if self._turns is not None:
            turns, self._turns = self._turns, None
            turns._give()


class Place:
    """One request's place in the worker's :class:`Turns`: its turn once taken (``turn``:
    taken for it before it was read, by the server)."""

    __slots__ = ("_turn", "_turns")

    def __init__(self, turns: Turns, turn: Turn | None = None) -> None:
        self._turns = turns
        self._turn: Turn | None = turn

    async def take(self, queue_end: float, context_end: float) -> None:
        """Wait for the turn, at most until the queue budget (then shed: 503) or the
        context cut (504).

        Raises:
            Shed: ``queue_end`` came first.
            StageDeadlineExceeded: ``context_end`` came first.
        """
        # Just before the context cut: the parse stage's own cut would name the body.
        until = min(queue_end, context_end - 0.001)
        if self._turn is not None and not self._turn.held:
            self._turn = None  # the server gave it back: the request did not come whole
        if self._turn is not None:  # taken before the request was read
            turn: Turn | None = self._turn
            if trio.current_time() >= until:  # ... and that wait was too long
                self.release()
                turn = None
        else:
            turn = await self._turns.take(until)
        if turn is None:
            if queue_end <= context_end:
                raise Shed(
                    "queue",
                    "the gateway is overloaded: the request waited past its queue budget "
                    "for its turn",
                )
            raise StageDeadlineExceeded(
                "parse", "the request waited for its turn past its context budget"
            )
        self._turn = turn

    def release(self) -> None:
        if self._turn is not None:
            self._turn.release()
            self._turn = None


#: The current request's place: the entry sets it; its stage tasks inherit it.
CURRENT_PLACE: ContextVar[Place | None] = ContextVar("aiserve_place", default=None)


async def take_turn(queue_end: float, context_end: float) -> None:
    """The current request's turn (see :meth:`Place.take`); at once outside a request."""
    place = CURRENT_PLACE.get()
    if place is not None:
        await place.take(queue_end, context_end)


def end_turn() -> None:
    """Give back the current request's turn, if it holds one."""
    place = CURRENT_PLACE.get()
    if place is not None:
        place.release()
