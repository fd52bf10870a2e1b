"""Handing a value to the next stage without a needless trip through the scheduler.

A memory channel's ``send`` is a checkpoint: even when the receiver is already
waiting (or the buffer has room) the sender yields, and the run loop goes round
once more before the sender goes on. A stage that hands on its result and ends
(parse, context), the watcher handing on the body, and an adapter sending the
deltas of one read gain nothing from that yield: measured at c = 1, a request took
about 20 trips through the run loop, each an ``epoll_wait`` and a task switch.

:func:`hand_on` and :class:`EagerSink` send at once when the channel takes the
value at once, and wait (``send``) only when it does not: backpressure is the
same, only the yield that waits for nothing is gone. A sender that keeps going
without waiting still meets a checkpoint at its next I/O. The pipeline's own channels
(``stages/channel.py``) send at once when they can already; these helpers keep a
memory channel handed to a stage (in tests) just as lean.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import trio

from .channel import Outbox

T = TypeVar("T")


async def hand_on(channel: Outbox[T], value: T) -> None:
    """Send ``value`` on ``channel``; yield only if the channel cannot take it now.

    Raises:
        trio.BrokenResourceError: the receiving end is closed.
    """
    try:
        channel.send_nowait(value)
    except trio.WouldBlock:
        await channel.send(value)


class EagerSink(Generic[T]):
    """A channel's sending end as a sink whose ``send`` is :func:`hand_on`."""

    __slots__ = ("_channel",)

    def __init__(self, channel: Outbox[T]) -> None:
        self._channel = channel

    async def send(self, value: T, /) -> None:
        try:
            self._channel.send_nowait(value)
        except trio.WouldBlock:
            await self._channel.send(value)
