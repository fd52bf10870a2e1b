"""Chat requests take their turn in the order they arrived: a bounded FIFO queue before
the gateway's own work on a request (:class:`Turns`, ``[deadline] max_starting``)."""

from __future__ import annotations

from contextvars import ContextVar

import trio

from ..core.errors import Shed, StageDeadlineExceeded


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
    """

    __slots__ = ("_lot", "active", "limit")

    def __init__(self, limit: int = 0) -> None:
        self.limit = limit
        #: Requests starting now (turns taken and not yet given back).
        self.active = 0
        self._lot = trio.lowlevel.ParkingLot()

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
