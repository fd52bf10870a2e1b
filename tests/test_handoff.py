"""Stage hand-offs (``stages/handoff.py``): no yield when the channel takes the value
at once, the usual wait when it cannot (backpressure unchanged)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from aiserve_trio.stages.handoff import EagerSink, hand_on


async def test_a_waiting_receiver_gets_the_value_without_a_checkpoint() -> None:
    send, recv = trio.open_memory_channel[int](0)
    got: list[int] = []

    async def receiver() -> None:
        got.append(await recv.receive())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receiver)
        await trio.testing.wait_all_tasks_blocked()
        with trio.testing.assert_no_checkpoints():
            await hand_on(send, 1)
    assert got == [1]
    send1, recv1 = trio.open_memory_channel[int](1)
    with trio.testing.assert_no_checkpoints():
        await EagerSink(send1).send(7)  # room in the buffer
    assert recv1.receive_nowait() == 7


async def test_a_full_channel_makes_the_sender_wait(autojump_clock: trio.testing.MockClock) -> None:
    send, recv = trio.open_memory_channel[int](1)
    sink = EagerSink(send)
    await sink.send(1)
    sent_at: list[float] = []

    async def sender() -> None:
        with trio.testing.assert_checkpoints():
            await hand_on(send, 2)
        sent_at.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        await trio.sleep(5)
        assert sent_at == []  # still waiting: the buffer is full
        assert recv.receive_nowait() == 1
    assert sent_at == [5.0]
    assert recv.receive_nowait() == 2


async def test_a_closed_receiver_is_reported() -> None:
    send, recv = trio.open_memory_channel[int](1)
    recv.close()
    with pytest.raises(trio.BrokenResourceError):
        await hand_on(send, 1)
    with pytest.raises(trio.BrokenResourceError):
        await EagerSink(send).send(1)
