"""aiserve-sim's ``GET /sim/requests``: the last requests exactly as they arrived."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import pytest
import trio
import trio.testing
import trio_websocket

from aiserve_trio.sim import SimApp
from aiserve_trio.sim.core import LOG_SIZE

from .asgi_client import Client
from .sim_process import run_sim
from .test_sim_chat import sim
from .test_sim_ws import ws_connect

#: Not how json.dumps would write it: spacing, key order, escapes and raw UTF-8 must survive.
ODD_BODY = (
    '{ "messages" : [{"content":"h\\u00e9llo \u2713 \\"q\\"","role":"user"}],\n'
    '  "model":"sim-model", "max_tokens" :1, "x-unknown": {"a": [1, 2.50]} }'
).encode()


async def log(app: SimApp) -> list[dict[str, Any]]:
    r = await Client(app).request("GET", "/sim/requests")
    assert r.status == 200
    return list(r.json()["requests"])


async def test_the_exact_body_and_headers(autojump_clock: trio.testing.MockClock) -> None:
    app = sim()
    r = await Client(app).request(
        "POST",
        "/v1/chat/completions",
        body=[ODD_BODY[:20], ODD_BODY[20:]],  # in two reads
        headers={"Content-Type": "application/json", "X-Custom": "A", "Authorization": "Bearer k"},
    )
    assert r.status == 200
    [entry] = await log(app)
    assert entry["path"] == "/v1/chat/completions"
    assert entry["transport"] == "http"
    assert entry["body"].encode() == ODD_BODY
    assert entry["headers"] == {
        "content-type": "application/json",
        "x-custom": "A",
        "authorization": "Bearer k",
    }


async def test_newest_last_bounded_bad_ones_too_reset_clears(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = sim()
    client = Client(app)
    await client.request("POST", "/v1/chat/completions", body=b"{broken")
    for i in range(LOG_SIZE + 5):
        await client.chat({"messages": [{"role": "user", "content": str(i)}], "max_tokens": 1})
    await client.request("GET", "/healthz")
    await client.request("GET", "/sim/stats")
    await client.request("GET", "/v1/models")
    entries = await log(app)
    assert len(entries) == LOG_SIZE
    assert entries[-1] == {"path": "/v1/models", "transport": "http", "headers": {}, "body": ""}
    last_chat = json.loads(entries[-2]["body"])
    assert last_chat["messages"][0]["content"] == str(LOG_SIZE + 4)
    assert (await client.request("POST", "/sim/reset")).status == 200
    assert await log(app) == []


async def test_websocket_messages(autojump_clock: trio.testing.MockClock) -> None:
    app = sim()
    text = '{"type":"generate", "id":"w1","messages":[{"role":"user","content":"\u2713"}],"max_tokens":1}'
    async with ws_connect(app, {"X-Sim-Fault": "none", "Authorization": "Bearer w"}) as ws:
        await ws.send_text(text)
        assert (await ws.from_app.receive())["type"] == "websocket.send"
        while json.loads((await ws.from_app.receive())["text"])["type"] != "done":
            pass
    [entry] = await log(app)
    assert entry == {
        "path": "/v1/ws",
        "transport": "ws",
        "headers": {"x-sim-fault": "none", "authorization": "Bearer w"},
        "body": text,
    }


@pytest.mark.slow
async def test_through_a_real_sim_process() -> None:
    with run_sim() as addr:
        async with httpx2.AsyncClient() as c:
            await c.post(
                f"http://{addr}/v1/chat/completions",
                content=ODD_BODY,
                headers={"content-type": "application/json"},
            )
            async with trio_websocket.open_websocket_url(f"ws://{addr}/v1/ws") as ws:
                await ws.send_message('{"type":"generate","id":"1","messages":[],"max_tokens":1}')
                while json.loads(await ws.get_message())["type"] != "done":
                    pass
            entries = (await c.get(f"http://{addr}/sim/requests")).json()["requests"]
    assert entries[0]["body"].encode() == ODD_BODY
    assert entries[0]["headers"]["content-length"] == str(len(ODD_BODY))
    assert entries[1]["transport"] == "ws"
    assert entries[1]["body"] == '{"type":"generate","id":"1","messages":[],"max_tokens":1}'
