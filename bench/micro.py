"""Micro-benchmarks of pieces of the request path, each against what it replaced.

    PYTHONPATH=src .venv/bin/python -m bench.micro

- one upstream read of 20 events (what ``bench/node/upstream.js`` sends for 16 deltas)
  through ``ChatStreamDecoder``, the one-array decode against the event-by-event way;
- opening a stage channel pair against ``trio.open_memory_channel``;
- a keep-alive timer's restart and stop (one request on a kept-alive connection):
  ``IdleTimer`` against ``LeanSingleTask`` (a task started and cancelled per request).

Each figure is the best of five repeats; run it pinned (``taskset -c 0``) on a quiet CPU.
"""

from __future__ import annotations

import json
import time
import timeit
from typing import Any

import trio

from aiserve_trio.adapters.chat_stream import ChatStreamDecoder
from aiserve_trio.server.idle import IdleTimer, LeanSingleTask
from aiserve_trio.stages.channel import open_channel


def upstream_read(deltas: int = 16) -> bytes:
    """The bytes ``bench/node/upstream.js`` answers a streamed request with."""
    def chunk(delta: dict[str, Any], finish: str | None) -> str:
        body = {"id": "chatcmpl-up1", "object": "chat.completion.chunk", "created": 1,
                "model": "sim-model",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return "data: " + json.dumps(body, separators=(",", ":")) + "\n\n"

    out = chunk({"role": "assistant", "content": ""}, None)
    out += "".join(chunk({"content": (" w" if i else "w") + str(i)}, None) for i in range(deltas))
    out += chunk({}, "stop")
    usage = {"id": "chatcmpl-up1", "object": "chat.completion.chunk", "created": 1,
             "model": "sim-model", "choices": [],
             "usage": {"prompt_tokens": 8, "completion_tokens": deltas, "total_tokens": 24}}
    return (out + "data: " + json.dumps(usage, separators=(",", ":")) + "\n\ndata: [DONE]\n\n").encode()


def best(fn: Any, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def decode() -> tuple[float, float]:
    raw = upstream_read()

    def whole() -> None:
        d = ChatStreamDecoder("up")
        d.feed(raw)
        d.end()

    def by_event() -> None:  # a comment first: the read no longer qualifies for one array
        d = ChatStreamDecoder("up")
        d.feed(b": ping\n\n" + raw)
        d.end()

    return best(by_event, 20_000), best(whole, 20_000)


class _Group:
    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery


class _Server:
    """What a keep-alive timer uses of hypercorn's TCPServer."""

    def __init__(self) -> None:
        self.config = type("Config", (), {"keep_alive_timeout": 30.0})()
        self.context = type("Context", (), {"terminated": trio.Event()})()

    async def _idle_timeout(self) -> None:  # hypercorn's, as the timer is handed it
        with trio.move_on_after(self.config.keep_alive_timeout):
            await self.context.terminated.wait()

    async def _initiate_server_close(self) -> None:
        pass


async def timers(cycles: int = 5000) -> dict[str, float]:
    server = _Server()
    out: dict[str, float] = {}
    for cls in (LeanSingleTask, IdleTimer):
        timer = cls()
        async with trio.open_nursery() as nursery:
            group = _Group(nursery)
            runs = []
            for _ in range(5):
                t0 = time.process_time()
                for _ in range(cycles):
                    await timer.restart(group, server._idle_timeout)
                    await trio.lowlevel.checkpoint()  # the client reads, sends the next request
                    await timer.stop()
                    await trio.lowlevel.checkpoint()  # the request is served
                cycle = time.process_time() - t0
                t0 = time.process_time()
                for _ in range(cycles):
                    await trio.lowlevel.checkpoint()
                    await trio.lowlevel.checkpoint()
                runs.append((cycle - (time.process_time() - t0)) / cycles * 1e6)
            out[cls.__name__] = min(runs)
            nursery.cancel_scope.cancel()
    return out


def main() -> int:
    by_event, whole = decode()
    trio_pair = best(lambda: trio.open_memory_channel(0), 50_000)
    ours = best(lambda: open_channel(0), 50_000)
    cycles = trio.run(timers)
    print("| piece | before | after |\n|---|---|---|")
    print(f"| a 20-event upstream read decoded | {by_event:.1f} µs event by event | "
          f"{whole:.1f} µs as one array |")
    print(f"| a stage channel pair opened | {trio_pair:.2f} µs (trio.open_memory_channel) | "
          f"{ours:.2f} µs (stages.channel) |")
    print(f"| keep-alive timer restart + stop | {cycles['LeanSingleTask']:.1f} µs (a task "
          f"per request) | {cycles['IdleTimer']:.1f} µs (a deadline moved) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
