"""Single flight: identical requests in flight at once share one answer (no I/O here).

A :class:`Flight` is one answer being produced for every request with the same
key. Its :class:`FlightLog` is append-only: the reply's pieces as they are
released, then done or failed. Each request that shares it (a *member*) reads
the log from the start at its own pace with its own cursor, so a late joiner
catches up, a slow client slows nobody else, and one more member costs an
integer, not a buffer. (A channel per member would have to drop a member that
falls behind and send it to the finished entry; a shared log never has to.)

:class:`FlightTable` holds the flights by key: a request joins the one in
flight or starts one; the last member to leave an unfinished flight ends it
(nobody is waiting for that answer any more).
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeAlias

import trio

if TYPE_CHECKING:
    from ..core.errors import GatewayError
    from .entry import Replayed


#: Publishes released pieces to the flight (called by a producer as they come).
Publish: TypeAlias = "Callable[[Sequence[Replayed]], None]"
#: Produces the answer until the deadline given: the model through the route's
#: output filters, every released piece published, the final one last. Returns
#: the cap that ended the reply early (``max_tokens``), if one did; raises a
#: GatewayError on failure.
Producer: TypeAlias = Callable[[Publish, float], Awaitable[str | None]]


class FlightState(enum.Enum):
    OPEN = "open"
    DONE = "done"
    FAILED = "failed"


class FlightStateError(RuntimeError):
    """A call the log's state does not allow (a bug in the caller)."""


class FlightLog:
    """The pieces of one reply, as they are released, and how it ended."""

    __slots__ = ("error", "pieces", "source", "state")

    def __init__(self) -> None:
        self.pieces: list[Replayed] = []
        self.state = FlightState.OPEN
        self.error: GatewayError | None = None
        #: Where the answer comes from: ``model``, ``store`` (an entry written
        #: meanwhile) or ``remote`` (another gateway's flight, through Redis).
        self.source: str | None = None

    @property
    def ended(self) -> bool:
        return self.state is not FlightState.OPEN

    def publish(self, pieces: Sequence[Replayed], source: str) -> None:
        if self.state is not FlightState.OPEN:
            raise FlightStateError(f"publish in state {self.state.value}")
        if self.source is None:
            self.source = source
        self.pieces.extend(pieces)

    def finish(self) -> None:
        if self.state is not FlightState.OPEN:
            raise FlightStateError(f"finish in state {self.state.value}")
        if not self.pieces or self.pieces[-1].finish_reason is None:
            raise FlightStateError("finish before the final piece")
        self.state = FlightState.DONE

    def fail(self, error: GatewayError) -> bool:
        """Record how the flight failed; False if it had already ended."""
        if self.state is not FlightState.OPEN:
            return False
        self.state = FlightState.FAILED
        self.error = error
        return True

    def since(self, cursor: int) -> list[Replayed]:
        return self.pieces[cursor:]


class Flight:
    """One answer in flight for one key."""

    __slots__ = (
        "_changed",
        "deadline",
        "fresh",
        "generation",
        "key",
        "launched",
        "limit",
        "log",
        "members",
        "probe",
        "scope",
    )

    def __init__(self, key: str, *, fresh: bool = False) -> None:
        self.key = key
        #: Started by ``no-cache``: it does not answer from the store.
        self.fresh = fresh
        self.log = FlightLog()
        self.members = 0
        #: Set once a member has started producing the answer.
        self.launched = False
        #: The producing task's scope (cancelled when the last member leaves).
        self.scope: trio.CancelScope | None = None
        #: The latest inference deadline of its members.
        self.deadline = float("-inf")
        #: Once launched: the deadline the backend was given (the flight never outlasts it).
        self.limit = float("inf")
        #: 0, or how many flights for this key failed before this one took over.
        self.generation = 0
        #: The semantic tier's probe of the question (``semantic.Probe``): filed
        #: under its guard when the answer is stored.
        self.probe: object | None = None
        self._changed = trio.Event()

    def changed(self) -> None:
        """Wake the members waiting for more of the log."""
        self._changed.set()
        self._changed = trio.Event()

    def publish(self, pieces: Sequence[Replayed], source: str) -> None:
        """Add released pieces to the log (from ``source``) and wake the members."""
        if pieces:
            self.log.publish(pieces, source)
            self.changed()

    def finish(self) -> None:
        self.log.finish()
        self.changed()

    async def wait(self, cursor: int) -> None:
        """Return once the log has more than ``cursor`` pieces or has ended."""
        while len(self.log.pieces) <= cursor and not self.log.ended:
            await self._changed.wait()


class FlightTable:
    """The flights in progress, by key."""

    def __init__(self) -> None:
        self._flights: dict[str, Flight] = {}

    def __len__(self) -> int:
        return len(self._flights)

    def find(self, key: str) -> Flight | None:
        return self._flights.get(key)

    def start(self, key: str, *, fresh: bool = False) -> Flight:
        """A new flight for ``key``; it replaces one already there for new joiners
        (``no-cache``: whoever asks from now on gets the fresh answer)."""
        flight = self._flights[key] = Flight(key, fresh=fresh)
        return flight

    def join(self, flight: Flight) -> None:
        flight.members += 1

    def leave(self, flight: Flight) -> bool:
        """One member less; True when it was the last and the flight had not ended:
        the caller cancels it (and it is gone for new requests at once)."""
        flight.members -= 1
        if flight.members > 0 or flight.log.ended:
            return False
        self.remove(flight)
        return True

    def remove(self, flight: Flight) -> None:
        """Forget ``flight`` (if a newer one has not replaced it)."""
        if self._flights.get(flight.key) is flight:
            del self._flights[flight.key]
