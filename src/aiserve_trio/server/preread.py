"""A request is read when its turn comes, not before: the worker's queue of requests
starting (``http/turns.py``) reaches back to the socket while it is full.

Under overload most requests in a worker wait for their turn. Read, each of them is
objects -- hypercorn's scope and stream, the app's task and its frames, the parsed
headers -- that CPython's cycle collector walks again at every collection of its
younger generations while they wait (``docs/performance.md``: at 1,024 clients on one
worker the collector took a quarter of its CPU and held the loop ~50 ms a time).
Unread, a request is bytes in the kernel's socket buffer.

So when the read loop has read the first bytes of the next request on an HTTP/1.1
connection, on plain TCP, while the worker's queue is full
(:attr:`~..http.turns.Turns.full`), and they begin a ``POST`` -- a model call, what the
queue is for -- it waits for the request's turn (:func:`take_turn_first`) before it
hands them to hypercorn's parser, in arrival order with the requests already read; the
bytes of that one read are all the request holds meanwhile (the rest of it stays in
the kernel), the read's time stands as its arrival (its deadline counts from there),
and the keep-alive timer is stopped (the connection is not idle). Once it has its turn,
the task group hands the turn to the app (``http.types.TURN``), which uses it instead of
queueing again -- if the request came whole in that read: a head cut short or a body still
to come gives the turn back at once (:meth:`TurnFirst.settle`), so a client that dribbles
holds no turn, as before. Anything else (a health check, metrics, an HTTP/2 preface) is handed
on at once, as before.

A ``POST`` read before the exchange ahead of it on its connection has ended (its answer
written, hypercorn's recycle of the connection a scheduler pass later -- under load, a
third of the requests at 1,024 clients came then) first waits for that end
(:meth:`TurnFirst.next_cycle`, woken by the server's ``protocol_send``), then for its turn
like the others; handed on at once, hypercorn parsed it as soon as the exchange ended and
its app waited in the queue as objects.

A turn taken for a request that then never reached the app (the client closed, a
malformed head) is given back at the connection's next request or the read loop's
end. HTTP/2 streams share their connection, and TLS connections are read by
hypercorn's own loop: both are read at once.
"""

from __future__ import annotations

import math
from typing import Any

import h11
import trio

from ..http.turns import Turn, Turns

#: What a request the queue is for starts with.
_POST: bytes = b"POST "


class TurnFirst:
    """One connection's link to its worker's queue: the turn taken for the request about
    to be read (``turn``), until the task group hands it to the app (``given``, until the
    read that brought it is handled: :meth:`settle`)."""

    __slots__ = ("_cycled", "given", "turn", "turns")

    def __init__(self, turns: Turns) -> None:
        self.turns = turns
        self.turn: Turn | None = None
        self.given: Turn | None = None
        self._cycled: trio.Event | None = None

    async def next_cycle(self) -> None:
        """Wait until the connection is between requests again: the exchange before
        (its request all read) has ended, or the connection closes (:meth:`cycled`)."""
        self._cycled = trio.Event()
        await self._cycled.wait()

    def cycled(self) -> None:
        """The exchange before ended (hypercorn's ``Updated(idle=True)``) or the
        connection closed: a read waiting in :meth:`next_cycle` goes on."""
        cycled, self._cycled = self._cycled, None
        if cycled is not None:
            cycled.set()

    def handed(self) -> Turn | None:
        """The turn taken for the request just read, now the app's."""
        turn, self.turn = self.turn, None
        self.given = turn
        return turn

    def settle(self, protocol: Any) -> None:
        """After the read that waited for a turn was handled: the turn goes back unless
        its request came whole in it -- a head cut short, or a body still to come, would
        hold a turn for as long as its client dribbles. Such a request takes its turn the
        usual way once its body is in (``http/turns.py``)."""
        self.drop()  # no request was handed it: the head is not all in
        given, self.given = self.given, None
        if given is not None and _body_to_come(protocol):
            given.release()

    def drop(self) -> None:
        """Give back a turn no request took (the connection ended, or its request was
        never handed to an app)."""
        turn, self.turn = self.turn, None
        if turn is not None:
            turn.release()


def between_requests(protocol: Any) -> bool:
    """Whether ``protocol`` (the seam's protocol wrapper) is an HTTP/1.1 connection that
    has answered its last request and read nothing of the next."""
    h11_protocol: Any = getattr(protocol, "protocol", None)
    connection = getattr(h11_protocol, "connection", None)
    return (
        type(connection) is h11.Connection
        and connection.their_state is h11.IDLE
        and h11_protocol.stream is None
    )


def finishing(protocol: Any) -> bool:
    """Whether ``protocol`` is an HTTP/1.1 connection whose last request is all read but
    whose exchange has not ended (its answer still going out, or going out this step)."""
    h11_protocol: Any = getattr(protocol, "protocol", None)
    connection = getattr(h11_protocol, "connection", None)
    return (
        type(connection) is h11.Connection
        and connection.their_state is h11.DONE
        and h11_protocol.stream is not None
    )


def _body_to_come(protocol: Any) -> bool:
    connection = getattr(getattr(protocol, "protocol", None), "connection", None)
    return type(connection) is h11.Connection and connection.their_state is h11.SEND_BODY


def waits_for_turn(first: TurnFirst | None, data: bytes, protocol: Any) -> bool:
    """Whether ``data``, just read, begins a request that must wait for its turn before
    it is handed on (module docstring)."""
    return (
        first is not None
        and data.startswith(_POST)
        and first.turns.full
        and between_requests(protocol)
    )


def waits_for_cycle(first: TurnFirst | None, data: bytes, protocol: Any) -> bool:
    """Whether ``data``, just read, is a ``POST`` that came before the exchange ahead of it
    on its connection ended, while the queue is full: it must wait for that end
    (:meth:`TurnFirst.next_cycle`) before :func:`waits_for_turn` can tell."""
    return first is not None and data.startswith(_POST) and first.turns.full and finishing(protocol)


async def take_turn_first(first: TurnFirst, idle: Any) -> None:
    """Wait for the turn of the request whose first bytes were just read; the connection
    is not idle meanwhile (``idle``: its keep-alive timer, stopped)."""
    first.drop()
    await idle.stop()
    first.turn = await first.turns.take(math.inf)
