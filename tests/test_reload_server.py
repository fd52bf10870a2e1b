"""Reload without a restart under the real hypercorn binary, in front of a real aiserve-sim:
100 open streams survive a reload that replaces their adapter, and an unchanged adapter
keeps its upstream connections (counted by a TCP proxy in front of the sim)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx2
import pytest
import trio

from .conftest import config_text
from .servers import hypercorn_gateway
from .sim_process import run_sim

pytestmark = pytest.mark.slow

#: Replies of 100 tokens, one every 40 ms: each stream stays open for 4 s, long enough
#: for all 100 to be open at once on a busy machine.
TOKENS = 100
SLOW_SIM = [
    "--prefill-overhead-ms", "5", "--prefill-per-token-ms", "0", "--itl-ms", "40",
    "--output-tokens-mean", str(TOKENS), "--output-tokens-std", "0", "--seed", "3",
]  # fmt: skip


def adapter(name: str, base: str, extra: str = "") -> str:
    return (
        f'\n[adapters.{name}]\nkind = "openai"\nbase_url = "http://{base}/v1"\n'
        f'models = ["sim-model"]\n{extra}\n'
    )


def route(path: str, name: str, adapter_name: str) -> str:
    return f'\n[[routes]]\npath = "{path}"\nname = "{name}"\nadapter = "{adapter_name}"\n'


def ask(**extra: Any) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "tell me a story"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


@dataclass
class Stream:
    content: list[str]
    done: bool = False
    finish: str | None = None
    completion_tokens: int | None = None


async def stream(
    client: httpx2.AsyncClient, path: str, started: trio.Event | None = None, **extra: Any
) -> Stream:
    """One streamed chat request, read to its end."""
    out = Stream(content=[])
    async with client.stream("POST", path, json=ask(**extra)) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                out.done = True
                continue
            event = json.loads(data)
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    out.content.append(piece)
                    if started is not None:
                        started.set()
                out.finish = choice.get("finish_reason") or out.finish
            if event.get("usage"):
                out.completion_tokens = event["usage"]["completion_tokens"]
    return out


async def write_config(path: Path, text: str) -> None:
    await trio.Path(path).write_text(text)


async def test_100_open_streams_survive_a_reload_and_new_requests_see_the_new_config(
    tmp_path: Path,
) -> None:
    with run_sim(SLOW_SIM) as sim:
        base_text = config_text() + adapter("up", sim) + route("/v1/up", "up", "up")
        path = tmp_path / "gateway.toml"
        await write_config(path, base_text)
        with hypercorn_gateway(path) as (gateway, _):
            limits = httpx2.Limits(max_connections=200, max_keepalive_connections=200)
            async with httpx2.AsyncClient(base_url=gateway, limits=limits, timeout=30) as client:
                assert (await client.post("/v1/late", json=ask())).status_code == 404
                results: list[Stream] = []
                starts = [trio.Event() for _ in range(100)]

                async def one(started: trio.Event) -> None:
                    results.append(await stream(client, "/v1/up", started))

                async with trio.open_nursery() as nursery:
                    for started in starts:
                        nursery.start_soon(one, started)
                    with trio.fail_after(20):
                        for started in starts:
                            await started.wait()
                    # Every stream is open and has content; the new file replaces their
                    # adapter (a changed setting) and adds a route.
                    new_text = (
                        config_text()
                        + adapter("up", sim, "max_retries = 1")
                        + route("/v1/up", "up", "up")
                        + route("/v1/late", "late", "up")
                    )
                    r = await client.post(
                        "/admin/config/reload",
                        content=new_text.encode(),
                        headers={"content-type": "application/toml"},
                    )
                    assert r.status_code == 200, r.text
                    assert r.json()["applied"] is True
                    assert results == []  # all 100 were open during the reload
                    late = await stream(client, "/v1/late", max_tokens=3)  # the new route
                    assert late.done
                    assert (late.finish, len(late.content)) == ("length", 3)
                    status = (await client.get("/admin/config")).json()
                    assert status["loaded_by"] == "api:loopback"
                    assert status["version"] == r.json()["version"]
                assert len(results) == 100
                for s in results:
                    assert s.done, "a stream was cut"
                    assert s.finish == "stop"
                    assert s.completion_tokens == TOKENS
                    # Tokens that queued during a slow write go out in one chunk.
                    assert 0 < len(s.content) <= TOKENS
                assert len({"".join(s.content) for s in results}) == 1
                metrics = (await client.get("/metrics")).text
                assert 'aiserve_config_reloads_total{result="applied"} 1.0' in metrics
        assert await trio.Path(path).read_text() == new_text


@dataclass
class CountingProxy:
    """A TCP proxy in front of the sim that counts the connections it accepts."""

    target: tuple[str, int]
    port: int = 0
    accepted: int = 0

    async def _serve(self, down: trio.SocketStream) -> None:
        self.accepted += 1
        async with (
            down,
            await trio.open_tcp_stream(*self.target) as up,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(self._pump, down, up, nursery.cancel_scope)
            nursery.start_soon(self._pump, up, down, nursery.cancel_scope)

    @staticmethod
    async def _pump(src: trio.SocketStream, dst: trio.SocketStream, done: trio.CancelScope) -> None:
        try:
            while data := await src.receive_some(65536):
                await dst.send_all(data)
        except trio.BrokenResourceError:
            pass
        done.cancel()


@asynccontextmanager
async def counting_proxy(nursery: trio.Nursery, sim: str) -> AsyncIterator[CountingProxy]:
    host, port = sim.rsplit(":", 1)
    proxy = CountingProxy((host, int(port)))
    listeners = await nursery.start(partial(trio.serve_tcp, proxy._serve, 0, host="127.0.0.1"))
    proxy.port = listeners[0].socket.getsockname()[1]
    yield proxy


async def test_an_unchanged_adapter_keeps_its_upstream_connection_a_changed_one_opens_anew(
    tmp_path: Path,
) -> None:
    with run_sim() as sim:
        async with trio.open_nursery() as nursery:
            async with counting_proxy(nursery, sim) as keep, counting_proxy(nursery, sim) as change:
                routes = route("/v1/keep", "keep", "keep") + route("/v1/change", "change", "change")

                def text(change_extra: str = "") -> str:
                    return (
                        config_text()
                        + adapter("keep", f"127.0.0.1:{keep.port}")
                        + adapter("change", f"127.0.0.1:{change.port}", change_extra)
                        + routes
                    )

                path = tmp_path / "gateway.toml"
                await write_config(path, text())
                with hypercorn_gateway(path) as (gateway, _):
                    async with httpx2.AsyncClient(base_url=gateway, timeout=30) as client:
                        for _ in range(3):  # one after the other: one pooled connection each
                            assert (await stream(client, "/v1/keep")).done
                            assert (await stream(client, "/v1/change")).done
                        assert (keep.accepted, change.accepted) == (1, 1)
                        # The file changes one adapter; the API reloads it.
                        await write_config(path, text('headers = { "x-tenant-hint" = "b" }'))
                        r = await client.post("/admin/config/reload")
                        assert r.status_code == 200, r.text
                        assert r.json()["applied"] is True
                        for _ in range(3):
                            assert (await stream(client, "/v1/keep")).done
                            assert (await stream(client, "/v1/change")).done
                        # No new TCP connection for the unchanged adapter; a new pool
                        # (one new connection) for the changed one.
                        assert (keep.accepted, change.accepted) == (1, 2)
            nursery.cancel_scope.cancel()
