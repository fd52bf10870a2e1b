"""The channels between a request's stages: one sender, one receiver, a buffer of 0 or 1.

A request opens five channels (body, parsed request, prepared request twice, deltas),
each between exactly two tasks. ``trio.open_memory_channel`` serves any number of
tasks on each end, clones, statistics, and an ordered wait queue on both sides; its
pair cost about 4 µs to open here, more than the rest of some stages' work, and its
``receive`` yields to the scheduler even when a value is waiting.

:func:`open_channel` makes the pair for this one job. Its ends behave as a memory
channel's do -- the same methods and the same exceptions (``WouldBlock``,
``EndOfChannel`` once the sender closed and the buffer is empty,
``BrokenResourceError`` for a send nobody will receive, ``ClosedResourceError``
on an end already closed), backpressure at the same point, waits that a cancel
scope ends -- with two differences:

- one task waits on each end at a time; a second raises ``trio.BusyResourceError``
  (each stage channel has one producer and one consumer, and this says so);
- ``receive`` and ``send`` return at once, with no trip through the scheduler,
  when the value is there or the channel takes it (a cancelled task still raises
  ``Cancelled`` first). A stage that always finds its input keeps going; it meets
  a checkpoint at its next wait.

The stages type their channels as :class:`Inbox` and :class:`Outbox`, which a
memory channel's ends also are: tests may hand a stage either.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

import outcome
import trio

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
T_contra = TypeVar("T_contra", contravariant=True)

__all__ = ["Inbox", "Outbox", "Receiver", "Sender", "open_channel"]


class Inbox(Protocol[T_co]):
    """The receiving end a stage reads (a channel of this module or a memory channel)."""

    def receive_nowait(self) -> T_co: ...

    async def receive(self) -> T_co: ...

    def close(self) -> None: ...

    def __aiter__(self) -> Any: ...


class Outbox(Protocol[T_contra]):
    """The sending end a stage writes."""

    def send_nowait(self, value: T_contra, /) -> None: ...

    async def send(self, value: T_contra, /) -> None: ...

    def close(self) -> None: ...


#: The empty buffer (a value of its own: None is a value a stage may send).
_EMPTY: Any = object()


class _State(Generic[T]):
    __slots__ = ("capacity", "held", "receiver", "receiving", "sender", "sending", "value")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        #: The buffer: its one value, or ``_EMPTY``. A slot, not a deque: a deque's
        #: first block is ~600 bytes, and a held stream keeps its five channels
        #: (3 KB of the stream's memory; docs/performance.md).
        self.held: Any = _EMPTY
        #: The task waiting in ``receive`` / in ``send`` (and the value it sends).
        self.receiver: trio.lowlevel.Task | None = None
        self.sender: trio.lowlevel.Task | None = None
        self.value: Any = None
        #: Each end still open.
        self.sending = True
        self.receiving = True


def open_channel(capacity: int) -> tuple[Sender[Any], Receiver[Any]]:
    """A sender and a receiver joined by a buffer of ``capacity`` (0: a rendezvous).

    Typed as the caller annotates them: ``send: Sender[X]; recv: Receiver[X]``.
    """
    if capacity not in (0, 1):
        raise ValueError("a stage channel buffers 0 or 1 values")
    state: _State[Any] = _State(capacity)
    return Sender(state), Receiver(state)


class Sender(Generic[T]):
    """The sending end (see the module docstring)."""

    __slots__ = ("_state",)

    def __init__(self, state: _State[T]) -> None:
        self._state = state

    def send_nowait(self, value: T, /) -> None:
        """Hand ``value`` to the waiting receiver, or buffer it.

        Raises:
            trio.WouldBlock: no receiver waits and the buffer is full.
            trio.BrokenResourceError: the receiving end is closed.
            trio.ClosedResourceError: this end is closed.
        """
        s = self._state
        if not s.sending:
            raise trio.ClosedResourceError
        if not s.receiving:
            raise trio.BrokenResourceError
        if s.receiver is not None:
            task, s.receiver = s.receiver, None
            trio.lowlevel.reschedule(task, outcome.Value(value))
        elif s.capacity and s.held is _EMPTY:
            s.held = value
        else:
            raise trio.WouldBlock

    async def send(self, value: T, /) -> None:
        """:meth:`send_nowait`, waiting until the channel takes ``value``."""
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self.send_nowait(value)
            return
        except trio.WouldBlock:
            pass
        s = self._state
        if s.sender is not None:
            raise trio.BusyResourceError("another task is already sending on this channel")
        s.sender = trio.lowlevel.current_task()
        s.value = value

        def abort(_: Any) -> trio.lowlevel.Abort:
            s.sender = s.value = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    def close(self) -> None:
        """Close this end: the receiver gets what is buffered, then ``EndOfChannel``."""
        s = self._state
        if not s.sending:
            return
        s.sending = False
        if s.sender is not None:  # a send on this end, waiting: it cannot finish now
            task, s.sender, s.value = s.sender, None, None
            trio.lowlevel.reschedule(task, outcome.Error(trio.ClosedResourceError()))
        if s.receiver is not None and s.held is _EMPTY:
            task, s.receiver = s.receiver, None
            trio.lowlevel.reschedule(task, outcome.Error(trio.EndOfChannel()))

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> Sender[T]:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Receiver(Generic[T]):
    """The receiving end (see the module docstring)."""

    __slots__ = ("_state",)

    def __init__(self, state: _State[T]) -> None:
        self._state = state

    def receive_nowait(self) -> T:
        """The next value, if one is there.

        Raises:
            trio.WouldBlock: none is, and the sender is open.
            trio.EndOfChannel: none is, and the sender closed its end.
            trio.ClosedResourceError: this end is closed.
        """
        s = self._state
        if not s.receiving:
            raise trio.ClosedResourceError
        value: T
        if s.held is not _EMPTY:
            value = s.held
            s.held = _EMPTY
            if s.sender is not None:  # its value takes the freed place
                task, s.sender = s.sender, None
                s.held, s.value = s.value, None
                trio.lowlevel.reschedule(task, outcome.Value(None))
            return value
        if s.sender is not None:  # a rendezvous: take it from the waiting sender
            task, s.sender = s.sender, None
            value, s.value = s.value, None
            trio.lowlevel.reschedule(task, outcome.Value(None))
            return value
        if not s.sending:
            raise trio.EndOfChannel
        raise trio.WouldBlock

    async def receive(self) -> T:
        """:meth:`receive_nowait`, waiting until there is a value (or the end)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            return self.receive_nowait()
        except trio.WouldBlock:
            pass
        s = self._state
        if s.receiver is not None:
            raise trio.BusyResourceError("another task is already receiving on this channel")
        s.receiver = trio.lowlevel.current_task()

        def abort(_: Any) -> trio.lowlevel.Abort:
            s.receiver = None
            return trio.lowlevel.Abort.SUCCEEDED

        return await trio.lowlevel.wait_task_rescheduled(abort)  # type: ignore[no-any-return]

    def close(self) -> None:
        """Close this end: what is buffered is dropped, a waiting or later send is broken."""
        s = self._state
        if not s.receiving:
            return
        s.receiving = False
        s.held = _EMPTY
        if s.sender is not None:
            task, s.sender, s.value = s.sender, None, None
            trio.lowlevel.reschedule(task, outcome.Error(trio.BrokenResourceError()))
        if s.receiver is not None:  # a receive on this end, waiting
            task, s.receiver = s.receiver, None
            trio.lowlevel.reschedule(task, outcome.Error(trio.ClosedResourceError()))

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()

    def __aiter__(self) -> Receiver[T]:
        return self

    async def __anext__(self) -> T:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
