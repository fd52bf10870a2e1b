"""hypercorn's keep-alive timer without a lock (``http/idle.py``): the same timer, no checkpoint."""

from __future__ import annotations

from typing import Any

import h11
import pytest
import trio
import trio.testing

from aiserve_trio.http import idle
from aiserve_trio.http.idle import LeanSingleTask


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

    assert idle.install() in ("installed", "already installed")
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
