"""aiserve-sim's WebSocket protocol, in-process on the virtual clock: the old messages,
and tools / structured output / reasoning making the same decisions as HTTP."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.testing

from aiserve_trio.sim import WS_PATH, SimApp
from aiserve_trio.sim.model import token_text

from .asgi_client import Client
from .test_sim_chat import ROUND_TRIP, TOOL_RESULT, TOOLS, Weather, json_schema_format, sim
from .test_sim_schema import WEATHER, schema_errors


class WsClient:
    """Drives the app's WebSocket side the way hypercorn does."""

    def __init__(self) -> None:
        self.to_app, self._app_in = trio.open_memory_channel[dict[str, Any]](100)
        self._app_out, self.from_app = trio.open_memory_channel[dict[str, Any]](1000)

    async def receive(self) -> dict[str, Any]:
        return await self._app_in.receive()

    async def send(self, message: Any) -> None:
        await self._app_out.send(dict(message))

    async def send_text(self, text: str) -> None:
        await self.to_app.send({"type": "websocket.receive", "text": text})

    async def generate(self, **fields: Any) -> list[dict[str, Any]]:
        """Send one ``generate``; the messages of its reply, up to ``done`` or ``error``."""
        msg = {"type": "generate", "id": "r1", "model": "sim-model", **fields}
        msg.setdefault("messages", [{"role": "user", "content": "hi"}])
        await self.send_text(json.dumps(msg))
        out = []
        while True:
            event = await self.from_app.receive()
            assert event["type"] == "websocket.send", event
            out.append(json.loads(event["text"]))
            if out[-1]["type"] in ("done", "error"):
                return out


@asynccontextmanager
async def ws_connect(app: SimApp, headers: dict[str, str] | None = None) -> AsyncIterator[WsClient]:
    c = WsClient()
    scope = {
        "type": "websocket",
        "path": WS_PATH,
        "headers": [(k.encode(), v.encode()) for k, v in (headers or {}).items()],
    }
    async with trio.open_nursery() as nursery:
        nursery.start_soon(app, scope, c.receive, c.send)
        await c.to_app.send({"type": "websocket.connect"})
        assert (await c.from_app.receive())["type"] == "websocket.accept"
        yield c
        await c.to_app.send({"type": "websocket.disconnect", "code": 1000})


def arguments(reply: list[dict[str, Any]]) -> str:
    return "".join(m["arguments"] for m in reply if m["type"] == "tool_call")


async def test_the_old_messages_still_work(autojump_clock: trio.testing.MockClock) -> None:
    app = sim()
    async with ws_connect(app) as ws:
        reply = await ws.generate(max_tokens=3)
        again = await ws.generate(max_tokens=1)
    assert reply[:3] == [
        {"type": "token", "id": "r1", "index": i, "text": token_text(i)} for i in range(3)
    ]
    done = reply[3]
    assert done["type"] == "done"
    assert done["finish_reason"] == "length"
    assert done["usage"]["completion_tokens"] == 3
    assert done["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert done["usage"]["prompt_tokens"] > 0
    assert [m["type"] for m in again] == ["token", "done"]
    assert app.stats.completed == 2


async def test_a_tool_call(autojump_clock: trio.testing.MockClock) -> None:
    async with ws_connect(sim()) as ws:
        reply = await ws.generate(tools=TOOLS, tool_choice="auto")
    head, *frags, done = reply
    assert head["type"] == "tool_call"
    assert head["call_id"].startswith("call_")
    assert head == {
        "type": "tool_call",
        "id": "r1",
        "index": 0,
        "call_id": head["call_id"],
        "name": "get_weather",
        "arguments": "",
    }
    assert len(frags) >= 3
    assert all(set(f) == {"type", "id", "index", "arguments"} for f in frags)
    assert schema_errors(WEATHER, json.loads(arguments(frags))) == []
    assert done["finish_reason"] == "tool_calls"
    assert done["usage"]["completion_tokens"] == len(frags)


async def test_the_same_decisions_as_http(autojump_clock: trio.testing.MockClock) -> None:
    named = {"type": "function", "function": {"name": "get_forecast"}}
    client = Client(sim())
    http = (await client.chat({"messages": ROUND_TRIP[:1], "tools": TOOLS, "tool_choice": named})).json()
    async with ws_connect(sim()) as ws:
        call = await ws.generate(messages=ROUND_TRIP[:1], tools=TOOLS, tool_choice=named)
        answer = await ws.generate(messages=ROUND_TRIP, tools=TOOLS)
        structured = await ws.generate(response_format=json_schema_format(Weather))
    http_call = http["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call[0]["name"] == http_call["name"] == "get_forecast"
    assert arguments(call) == http_call["arguments"]
    text = "".join(m["text"] for m in answer if m["type"] == "token")
    assert text.startswith(f"The tool returned: {TOOL_RESULT}")
    assert answer[-1]["finish_reason"] == "stop"
    Weather.model_validate_json("".join(m["text"] for m in structured if m["type"] == "token"))


async def test_reasoning_messages_come_first(autojump_clock: trio.testing.MockClock) -> None:
    async with ws_connect(sim()) as ws:
        reply = await ws.generate(reasoning_effort="medium", max_tokens=2)
    kinds = [m["type"] for m in reply]
    n = kinds.count("reasoning")
    assert n > 0
    assert kinds == ["reasoning"] * n + ["token", "token", "done"]
    assert all(set(m) == {"type", "id", "text"} for m in reply[:n])
    assert [m["index"] for m in reply[n:-1]] == [0, 1]  # content tokens count from 0
    usage = reply[-1]["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": n}
    assert usage["completion_tokens"] == n + 2


async def test_full_message_shapes_and_sampling_fields(autojump_clock: trio.testing.MockClock) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    async with ws_connect(sim()) as ws:
        reply = await ws.generate(
            messages=[{"role": "user", "content": [{"type": "text", "text": "see"}, image]}],
            stop=["\n", "END"],
            temperature=0.5,
            top_p=0.9,
            seed=4,
            something_new=True,
        )
    assert "".join(m.get("text", "") for m in reply).startswith("I see 1 image.")
    assert reply[-1]["type"] == "done"


async def test_a_schema_without_an_instance_is_an_error_reply(
    autojump_clock: trio.testing.MockClock,
) -> None:
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nowhere"}}}]
    async with ws_connect(sim()) as ws:
        reply = await ws.generate(tools=bad)
        after = await ws.generate(max_tokens=1)
    assert reply == [{"type": "error", "id": "r1", "status": 400, "message": reply[0]["message"]}]
    assert after[-1]["type"] == "done"  # the connection stays usable
