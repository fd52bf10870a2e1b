"""The 20 ms rule on /mcp (issue 52): a tool call whose answer is megabytes of small JSON
items -- decoded, redacted, measured and cut -- never holds the event loop for 20 ms.
The gateway runs in-process with an instrument that takes each task step's CPU time on
the loop's thread (a worker thread's time, and time the machine gives to others, are not
the loop's); the upstream is the SDK-written tests/mcp_servers/faulty.py over stdio."""

from __future__ import annotations

import gc
import json
import sys
import time

import pytest
import trio

from aiserve_trio.config import parse_config
from aiserve_trio.runtime.asgi import App
from aiserve_trio.util import gctune

from .conftest import config_text
from .sim_gateway import running

pytestmark = pytest.mark.slow


class Holds(trio.abc.Instrument):
    """The longest task step, in CPU seconds of the loop's thread, with which task took
    it and the garbage collections that ran inside it (generation, CPU ms)."""

    def __init__(self) -> None:
        self.longest = 0.0
        self.steps = 0
        self.why = ""
        self._start: float | None = None
        self._gcs: list[str] = []
        self._gc_start = 0.0

    def collecting(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.thread_time()
        elif self._start is not None:
            ms = (time.thread_time() - self._gc_start) * 1000
            self._gcs.append(f"gen{info['generation']} {ms:.1f} ms")

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._gcs = []
        self._start = time.thread_time()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._start is not None:  # not the step that added the instrument
            took = time.thread_time() - self._start
            if took > self.longest:
                self.longest = took
                self.why = f"{task.name}; collections inside: {self._gcs or 'none'}"
            self.steps += 1
            self._start = None


async def test_a_big_answer_never_holds_the_loop_20_ms() -> None:
    text = (
        config_text()
        + f"""
[mcp]
policies = ["gdpr-redact"]
max_result_bytes = 100000

[mcp.servers.faulty]
command = ["{sys.executable}", "-m", "tests.mcp_servers.faulty"]
timeout_ms = 60000
"""
    )
    app = App(parse_config(text, source="<test>"))
    async with running(app) as client:
        headers = {"accept": "application/json, text/event-stream"}
        init = {"protocolVersion": "2025-11-25", "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"}}  # fmt: skip
        with trio.fail_after(30):
            while True:
                health = json.loads((await client.request("GET", "/healthz")).body)
                if health["mcp"]["faulty"]["state"] == "ready":
                    break
                await trio.sleep(0.1)
        r = await client.request("POST", "/mcp", headers=headers,
                                 json_body={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": init})  # fmt: skip
        headers["mcp-session-id"] = r.headers["mcp-session-id"]
        holds = Holds()
        # As a hypercorn worker does at start (util/gctune.py): what is alive now is frozen,
        # so a full collection walks this call's objects, not the whole test session's heap,
        # and generation 0 is collected as rarely as in a worker.
        thresholds = gc.get_threshold()
        gctune.tune()
        gc.callbacks.append(holds.collecting)
        trio.lowlevel.add_instrument(holds)
        try:
            call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                    "params": {"name": "faulty__many", "arguments": {"n": 60_000}}}  # fmt: skip
            r = await client.request("POST", "/mcp", headers=headers, json_body=call)
        finally:
            trio.lowlevel.remove_instrument(holds)
            gc.callbacks.remove(holds.collecting)
            gc.unfreeze()
            gc.set_threshold(*thresholds)
    answer = json.loads(r.body)
    content = answer["result"]["content"]
    assert "[aiserve: result cut to 100000 bytes of" in content[-1]["text"]
    assert holds.steps > 100
    assert holds.longest < 0.020, f"the loop was held {holds.longest * 1000:.1f} ms by {holds.why}"
