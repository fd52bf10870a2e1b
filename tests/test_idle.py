"""hypercorn's keep-alive timer without a lock (``server/idle.py``): the same timer, no checkpoint."""

from __future__ import annotations

from typing import Any

import h11
import pytest
import trio
import trio.testing

from aiserve_trio.server.idle import IdleTimer, LeanSingleTask


class Group:
    """What hypercorn hands the timer: an object with a ``_nursery``."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery


async def test_restart_replaces_the_task_and_stop_ends_it(autojump_clock: Any) -> None:
    fired: list[tuple[str, float]] = []

    def timer(name: str, after: float) -> Any:
        async def action() -> None:
            await trio.sleep(after)
            fired.append((name, trio.current_time()))

        return action

    single = LeanSingleTask()
    async with trio.open_nursery() as nursery:
        group = Group(nursery)
        with trio.testing.assert_no_checkpoints():
            await single.restart(group, timer("first", 5))
            await single.restart(group, timer("second", 5))  # the first never fires
        await trio.sleep(1)
        with trio.testing.assert_no_checkpoints():
            await single.stop()  # nor does the second
        await trio.sleep(10)
        assert fired == []
        await single.restart(group, timer("third", 2))
    assert fired == [("third", 13.0)]


@pytest.mark.slow
async def test_an_idle_connection_is_still_closed_and_a_busy_one_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hypercorn.config import Config

    from .test_coalesce import HEAD, body, exchange, server

    monkeypatch.setattr(Config, "keep_alive_timeout", 0.3)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send(HEAD)
        await send(body(b"ok"))

    async with server(app) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        conn = h11.Connection(h11.CLIENT)
        for _ in range(4):  # 0.8 s of requests 0.2 s apart: each restarts the timer
            assert await exchange(stream, conn) == (200, b"ok")
            await trio.sleep(0.2)
        with trio.fail_after(5):
            assert await stream.receive_some(10) == b""  # closed once idle for 0.3 s
        await stream.aclose()


# --- IdleTimer: the TCP server's idle timeout as one task whose deadline moves ---------


class FakeServer:
    """What the timer uses of hypercorn's TCPServer: its config, context and close."""

    def __init__(self, timeout: float) -> None:
        self.config = type("C", (), {"keep_alive_timeout": timeout})()
        self.context = type("W", (), {"terminated": trio.Event()})()
        self.closed_at: list[float] = []

    async def _idle_timeout(self) -> None:  # the action hypercorn hands the timer
        raise AssertionError("the timer runs its own wait, not the action")

    async def _initiate_server_close(self) -> None:
        self.closed_at.append(trio.current_time())


async def test_an_idle_connection_closes_after_the_timeout_and_a_busy_one_never(
    autojump_clock: Any,
) -> None:
    server = FakeServer(5)
    timer = IdleTimer()
    async with trio.open_nursery() as nursery:
        group = Group(nursery)
        for _ in range(50):  # requests 1 s apart: each stops and restarts the timer
            with trio.testing.assert_no_checkpoints():
                await timer.stop()
            await trio.sleep(0.5)  # the request is served
            with trio.testing.assert_no_checkpoints():
                await timer.restart(group, server._idle_timeout)
            await trio.sleep(0.5)
        assert len(nursery.child_tasks) == 1  # one task for all of them
        assert server.closed_at == []
        await timer.stop()
        await trio.sleep(60)  # a long request: busy, not idle
        assert server.closed_at == []
        await timer.restart(group, server._idle_timeout)
        t = trio.current_time()
    assert server.closed_at == [t + 5]


async def test_shutdown_closes_an_idle_connection_at_once_and_a_busy_one_once_answered(
    autojump_clock: Any,
) -> None:
    idle, busy = FakeServer(30), FakeServer(30)
    async with trio.open_nursery() as nursery:
        group = Group(nursery)
        timers = IdleTimer(), IdleTimer()
        for timer, server in zip(timers, (idle, busy), strict=True):
            await timer.restart(group, server._idle_timeout)
        await timers[1].stop()  # busy serves a request
        await trio.sleep(1)
        idle.context.terminated.set()
        busy.context.terminated.set()
        await trio.sleep(2)
        assert idle.closed_at == [1.0 + trio.current_time() - 3]
        assert busy.closed_at == []  # not in the middle of its request
        await timers[1].restart(group, busy._idle_timeout)  # the request is answered
    assert busy.closed_at == [idle.closed_at[0] + 2]


async def test_a_deadline_passing_as_a_request_arrives_does_not_close(autojump_clock: Any) -> None:
    server = FakeServer(5)
    timer = IdleTimer()
    async with trio.open_nursery() as nursery:
        group = Group(nursery)
        await timer.restart(group, server._idle_timeout)
        await trio.testing.wait_all_tasks_blocked()
        assert timer._scope is not None
        timer._scope.cancel()  # as the deadline passing does; the timer task is not yet run
        await timer.stop()  # ... and a request arrives first
        await trio.sleep(100)
        assert server.closed_at == []
        await timer.restart(group, server._idle_timeout)
        t = trio.current_time()
    assert server.closed_at == [t + 5]


async def test_another_action_runs_as_a_task_restarted_and_stopped(autojump_clock: Any) -> None:
    fired: list[float] = []

    async def action() -> None:
        await trio.sleep(3)
        fired.append(trio.current_time())

    timer = IdleTimer()
    async with trio.open_nursery() as nursery:
        group = Group(nursery)
        await timer.restart(group, action)
        await trio.sleep(2)
        await timer.restart(group, action)  # replaces the first
        await trio.sleep(2)
        await timer.stop()
        await trio.sleep(10)
        await timer.restart(group, action)
    assert fired == [17.0]


@pytest.mark.slow
async def test_a_client_gone_mid_request_leaves_no_timer_behind() -> None:
    """The connection's task ends when the client does: shutdown does not wait for it."""
    from .test_coalesce import HEAD, body, server

    answered = trio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await trio.sleep(0.2)  # the client leaves meanwhile
        await send(HEAD)
        await send(body(b"late"))
        answered.set()

    async with server(app) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await trio.sleep(0.05)
        await stream.aclose()
        await answered.wait()
        await trio.sleep(0.1)
        start = trio.current_time()
    # hypercorn waits up to graceful_timeout (3 s) for connections still open.
    assert trio.current_time() - start < 1.0
