"""The stage channels: a memory channel's behaviour for one sender and one receiver."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from aiserve_trio.stages.channel import Receiver, Sender, open_channel

# --- without waiting: the same answers as trio's memory channel ------------------------

Op = tuple[str, int]
ops = st.lists(
    st.tuples(st.sampled_from(["send", "receive", "close_send", "close_receive"]), st.integers()),
    max_size=12,
)


def play(send: Any, recv: Any, script: list[Op]) -> list[object]:
    out: list[object] = []
    for op, value in script:
        try:
            if op == "send":
                send.send_nowait(value)
                out.append("sent")
            elif op == "receive":
                out.append(recv.receive_nowait())
            elif op == "close_send":
                send.close()
                out.append("closed")
            else:
                recv.close()
                out.append("closed")
        except (trio.WouldBlock, trio.EndOfChannel, trio.BrokenResourceError) as exc:
            out.append(type(exc).__name__)
        except trio.ClosedResourceError:
            out.append("ClosedResourceError")
    return out


@given(st.sampled_from([0, 1]), ops)
def test_without_waiting_it_answers_as_a_memory_channel_does(capacity: int, script: list[Op]) -> None:
    ours = open_channel(capacity)
    theirs = trio.open_memory_channel[int](capacity)
    assert play(*ours, script) == play(*theirs, script)


def test_only_a_buffer_of_zero_or_one() -> None:
    with pytest.raises(ValueError, match="0 or 1"):
        open_channel(2)


# --- waiting ----------------------------------------------------------------------------


async def test_a_rendezvous_send_waits_for_the_receiver_and_hands_over(autojump_clock: Any) -> None:
    send: Sender[str]
    recv: Receiver[str]
    send, recv = open_channel(0)
    done: list[float] = []

    async def sender() -> None:
        await send.send("a")
        done.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        await trio.sleep(5)
        assert done == []  # nobody received yet: backpressure
        assert recv.receive_nowait() == "a"  # taken from the waiting sender
        await trio.testing.wait_all_tasks_blocked()
        assert done == [5.0]


async def test_a_full_buffer_holds_the_sender_until_a_receive_frees_it(autojump_clock: Any) -> None:
    send: Sender[int]
    recv: Receiver[int]
    send, recv = open_channel(1)
    send.send_nowait(1)

    async def sender() -> None:
        await send.send(2)
        send.close()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        await trio.testing.wait_all_tasks_blocked()
        assert [v async for v in recv] == [1, 2]  # in order, then the end


async def test_a_waiting_receiver_gets_the_value_or_the_end(autojump_clock: Any) -> None:
    send: Sender[int]
    recv: Receiver[int]
    send, recv = open_channel(1)
    got: list[object] = []

    async def receiver() -> None:
        got.append(await recv.receive())
        try:
            await recv.receive()
        except trio.EndOfChannel:
            got.append("end")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receiver)
        await trio.testing.wait_all_tasks_blocked()
        send.send_nowait(7)  # straight to the waiting task, not the buffer
        await trio.testing.wait_all_tasks_blocked()
        async with send:  # leaving it closes it
            pass
    assert got == [7, "end"]


async def test_closing_the_receiver_breaks_a_waiting_send(autojump_clock: Any) -> None:
    send: Sender[int]
    recv: Receiver[int]
    send, recv = open_channel(0)
    broken: list[int] = []

    async def sender() -> None:
        try:
            await send.send(1)
        except trio.BrokenResourceError:
            broken.append(1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        await trio.testing.wait_all_tasks_blocked()
        recv.close()
    assert broken == [1]
    with pytest.raises(trio.BrokenResourceError):
        await send.send(2)


async def test_a_cancelled_wait_leaves_the_channel_as_it_was(autojump_clock: Any) -> None:
    send: Sender[int]
    recv: Receiver[int]
    send, recv = open_channel(0)
    with trio.move_on_after(1):
        await recv.receive()
    with trio.move_on_after(1):
        await send.send(1)
    with pytest.raises(trio.WouldBlock):  # the cancelled send left nothing behind
        recv.receive_nowait()

    async def late() -> None:
        await send.send(3)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(late)
        assert await recv.receive() == 3


async def test_a_cancelled_task_is_cancelled_even_with_a_value_there(autojump_clock: Any) -> None:
    send: Sender[int]
    recv: Receiver[int]
    send, recv = open_channel(1)
    send.send_nowait(1)
    with trio.CancelScope() as scope:
        scope.cancel()
        await recv.receive()
    assert scope.cancelled_caught
    assert recv.receive_nowait() == 1  # not taken by the cancelled receive


async def test_a_value_there_is_taken_without_a_trip_through_the_scheduler() -> None:
    send: Sender[int]
    recv: Receiver[int]
    send, recv = open_channel(1)
    ran: list[int] = []

    async def sibling() -> None:
        ran.append(1)

    async with trio.open_nursery() as nursery:
        # A runnable task: any yield gives it an even chance to run first (Trio runs
        # each batch in random order); twenty sends and receives never do.
        nursery.start_soon(sibling)
        for i in range(20):
            await send.send(i)
            assert await recv.receive() == i
        assert ran == []


async def test_one_waiting_task_per_end(autojump_clock: Any) -> None:
    recv: Receiver[int]
    _send, recv = open_channel(0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(recv.receive)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):
            await recv.receive()
        nursery.cancel_scope.cancel()


async def test_closing_an_end_wakes_its_own_waiter_with_closed(autojump_clock: Any) -> None:
    recv: Receiver[int]
    _send, recv = open_channel(0)
    errors: list[str] = []

    async def wait(fn: Any, *args: Any) -> None:
        try:
            await fn(*args)
        except trio.ClosedResourceError:
            errors.append(fn.__name__)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait, recv.receive)
        await trio.testing.wait_all_tasks_blocked()
        recv.close()
    send2: Sender[int]
    send2, _keep = open_channel(0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait, send2.send, 1)
        await trio.testing.wait_all_tasks_blocked()
        send2.close()
    assert errors == ["receive", "send"]


# --- what a channel costs a held stream ---------------------------------------------------


def test_none_is_a_value_like_any_other() -> None:
    send, recv = open_channel(1)
    send.send_nowait(None)
    with pytest.raises(trio.WouldBlock):
        send.send_nowait(1)  # the buffer holds the None
    assert recv.receive_nowait() is None
    with pytest.raises(trio.WouldBlock):
        recv.receive_nowait()


def test_a_channel_pair_costs_a_few_hundred_bytes() -> None:
    # A request holds five for as long as its stream lasts (bench/memprobe.py): with a
    # deque for its buffer of one a pair was ~990 bytes, without it ~230.
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        pairs = [open_channel(1) for _ in range(1000)]
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(pairs) == 1000
    assert grown / 1000 < 400
