"""A held stream's heartbeats and write deadline, kept by the sse stage's own task.

On the virtual clock: a ping goes out every ``heartbeat_s`` of silence, never while
deltas flow; a client that stops reading during a ping is given up on at the write
deadline; and a held stream runs no keep-alive task beside its stages (a task per
stream that only slept cost a held stream memory, ``bench/memprobe.py``).
"""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from .asgi_client import Client, chat_body
from .authcfg import OFF, auth_app

PING = b": ping\n\n"
LONG = {"x-request-timeout-ms": "120000"}


def app(**limits: str) -> Any:
    return auth_app(OFF, **limits)


async def test_pings_keep_their_interval_between_deltas(autojump_clock: Any) -> None:
    client = Client(app(heartbeat_s="1", ttft_ms="10", inter_token_ms="3500"))
    r = await client.chat(chat_body("hi there", stream=True), LONG)
    assert r.events()[-1] == "[DONE]"
    times = [t for t, _ in r.chunks]
    gaps = [
        (round(t - prev, 6), chunk == PING)
        for prev, (t, chunk) in zip(times, r.chunks[1:], strict=False)
    ]
    pings = [gap for gap, ping in gaps if ping]
    # Each 3.5 s wait between deltas: pings at 1, 2 and 3 s after the last write.
    assert len(pings) >= 3
    assert pings == [1.0] * len(pings)
    deltas = [gap for gap, ping in gaps if not ping]
    assert all(gap == 0.5 for gap in deltas if gap)  # the delta 0.5 s after the third ping


async def test_a_client_that_stops_reading_during_a_ping_is_dropped(autojump_clock: Any) -> None:
    a = app(heartbeat_s="1", write_timeout_ms="1000", ttft_ms="10", inter_token_ms="30000")
    client = Client(a)
    start = trio.current_time()
    with trio.fail_after(10):
        async with client.open(
            "POST",
            "/v1/chat/completions",
            json_body=chat_body(stream=True),
            headers=LONG,
            stall_after=1,
        ) as ex:
            await ex.done.wait()
    # The ping at 1 s is never taken: dropped at 2 s, not at the next delta (30 s).
    assert trio.current_time() - start < 3.0
    assert a.gate.admission.streams == 0
    assert ex.response.status == 200


def _tasks() -> list[str]:
    """The names of the tasks running (the test's own among them)."""

    def names(nursery: Any) -> list[str]:
        return [
            name
            for t in nursery.child_tasks
            for name in [t.name, *(m for n in t.child_nurseries for m in names(n))]
        ]

    root = trio.lowlevel.current_root_task()
    assert root is not None
    return [name for n in root.child_nurseries for name in names(n)]


async def test_a_held_stream_runs_no_keepalive_task(autojump_clock: Any) -> None:
    client = Client(app(heartbeat_s="1", ttft_ms="10", inter_token_ms="30000"))
    async with client.open(
        "POST", "/v1/chat/completions", json_body=chat_body("hi", stream=True), headers=LONG
    ) as ex:
        await ex.wait_for_bytes(1)
        await trio.testing.wait_all_tasks_blocked()
        held = _tasks()
        await trio.sleep(2.5)  # two heartbeats
        assert ex.response.body.count(PING) == 2
        await trio.testing.wait_all_tasks_blocked()
        assert _tasks() == held  # a ping is written by the stage itself
        ex.disconnect()
        await ex.done.wait()
    await trio.testing.wait_all_tasks_blocked()
    # The request's tasks: the exchange's (the pipeline, whose own task is the sse
    # stage's), the disconnect watcher and the inference stage; none for the sse stage.
    assert len(held) - len(_tasks()) == 3
    assert not any(".sse." in name for name in held)
