"""The gateway (in-process) in front of a real aiserve-sim process, for adapter tests."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx2
import trio

from aiserve_trio.config import Config
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client, Response
from .conftest import make_config

PATH = "/v1/up"


def toml_value(v: Any) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f'"{k}" = {toml_value(x)}' for k, x in v.items()) + " }"
    return json.dumps(v)


def gateway_app(kind: str, addr: str, **settings: Any) -> App:
    """An app whose route ``/v1/up`` uses a ``kind`` adapter pointed at the sim at ``addr``."""
    return App(gateway_config(kind, addr, **settings))


def gateway_config(kind: str, addr: str, **settings: Any) -> Config:
    """The config of :func:`gateway_app`."""
    where = f'base_url = "http://{addr}/v1"' if kind == "openai" else f'url = "ws://{addr}/v1/ws"'
    opts = {"backoff_base_ms": 10, "backoff_max_ms": 50, **settings}
    lines = "\n".join(f"{k} = {toml_value(v)}" for k, v in opts.items())
    extra = f"""
[adapters.up]
kind = "{kind}"
{where}
models = ["sim-model"]
{lines}

[[routes]]
path = "{PATH}"
name = "up"
adapter = "up"
default_model = "sim-model"
"""
    return make_config(extra)


@asynccontextmanager
async def running(app: App) -> AsyncIterator[Client]:
    async with trio.open_nursery() as nursery:
        await app.startup(nursery)
        try:
            yield Client(app)
        finally:
            await app.shutdown()


def chat(text: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": text}], **extra}


async def post(
    client: Client, body: dict[str, Any], headers: dict[str, str] | None = None
) -> Response:
    return await client.request("POST", PATH, json_body=body, headers=headers)


async def sim_stats(addr: str) -> dict[str, Any]:
    async with httpx2.AsyncClient() as c:
        r = await c.get(f"http://{addr}/sim/stats")
        return dict(r.json())


async def sim_reset(addr: str) -> None:
    async with httpx2.AsyncClient() as c:
        await c.post(f"http://{addr}/sim/reset")


async def wait_for_stat(addr: str, key: str, value: int, within: float = 3.0) -> dict[str, Any]:
    """Poll the sim's stats until ``key`` reaches ``value`` (real time, bounded)."""
    with trio.move_on_after(within):
        while True:
            stats = await sim_stats(addr)
            if stats[key] >= value:
                return stats
            await trio.sleep(0.02)
    return await sim_stats(addr)


def retries(app: App) -> float:
    v = app.metrics.registry.get_sample_value("aiserve_upstream_retries_total", {"adapter": "up"})
    return v or 0.0


def upstream_errors(app: App, code: str) -> float:
    labels = {"adapter": "up", "code": code}
    return app.metrics.registry.get_sample_value("aiserve_upstream_errors_total", labels) or 0.0


def error_event(r: Response) -> dict[str, Any] | None:
    for ev in r.events():
        if ev != "[DONE]" and "error" in (obj := json.loads(ev)):
            return dict(obj["error"])
    return None


def finish_reasons(r: Response) -> list[str]:
    out = []
    for ev in r.events():
        if ev == "[DONE]":
            continue
        for ch in json.loads(ev).get("choices", []):
            if ch.get("finish_reason"):
                out.append(ch["finish_reason"])
    return out
