"""The console's steps change through the app's real reloader, in process: the file is
rewritten with its comments, the next request runs the new order, a refused chain
writes nothing and shows up as the last refusal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aiserve_trio.runtime.asgi import App

from .asgi_client import Client
from .authcfg import KEY_A, KEY_ADMIN, OFF, auth_toml, bearer
from .conftest import config_text
from .test_reload import read, running

CHAIN = """
# The bank's chain; keep the comments.
[[routes]]
path = "/v1/bank"
name = "bank"
adapter = "mock"
default_model = "aiserve-mock"

# What the customer talks about.
[[routes.steps]]
name = "topic"
kind = "classify"
key = "topic"
[[routes.steps.rules]]
label = "card"
pattern = 'card'

# What the customer wants.
[[routes.steps]]
name = "intent"
kind = "classify"
[[routes.steps.rules]]
label = "greeting"
pattern = 'hello'

[[routes.steps]]
name = "answer"
kind = "generate"
"""


@pytest.fixture
def path(tmp_path: Path) -> Path:
    p = tmp_path / "gateway.toml"
    text = config_text(reload_watch_s="0").replace(OFF, auth_toml())
    assert "reload_watch_s = 0" in text
    p.write_text(text + CHAIN)
    return p


async def steps_run(app: App) -> str:
    body = {"messages": [{"role": "user", "content": "hello, my card"}]}
    r = await Client(app).request("POST", "/v1/bank", json_body=body, headers=bearer(KEY_ADMIN))
    assert r.status == 200, r.body
    return r.headers["x-aiserve-steps"]


async def routes(app: App, key: str = KEY_ADMIN) -> dict[str, Any]:
    r = await Client(app).request("GET", "/admin/api/routes", headers=bearer(key))
    assert r.status == 200, r.body
    out: dict[str, Any] = r.json()
    return out


async def put(app: App, version: str, *steps: tuple[str, bool], key: str = KEY_ADMIN) -> Any:
    body = {"path": "/v1/bank", "version": version,
            "steps": [{"name": n, "enabled": e} for n, e in steps]}
    return await Client(app).request(
        "PUT", "/admin/api/routes/steps", json_body=body, headers=bearer(key)
    )


async def test_a_new_order_is_written_applied_and_run(path: Path) -> None:
    before = read(path)
    async with running(path) as app:
        assert await steps_run(app) == "topic,intent,answer"
        listed = await routes(app)
        assert listed["writable"] is True
        assert listed["reload"]["version"] == listed["version"]
        r = await put(app, listed["version"], ("intent", True), ("topic", True), ("answer", True))
        assert r.status == 200, r.body
        assert r.json()["applied"] is True
        assert await steps_run(app) == "intent,topic,answer"
        after = await routes(app)
        assert after["version"] == r.json()["version"] != listed["version"]
        assert after["reload"]["loaded_by"] == "console:ops"
        bank = next(rt for rt in after["routes"] if rt["path"] == "/v1/bank")
        assert [s["name"] for s in bank["steps"]] == ["intent", "topic", "answer"]
        text = read(path)
        assert sorted(text.splitlines()) == sorted(before.splitlines())
        assert "# What the customer wants.\n[[routes.steps]]\nname = \"intent\"" in text

        # Switched off: it does not run, and the file says so.
        r = await put(app, after["version"], ("intent", True), ("topic", False), ("answer", True))
        assert r.status == 200, r.body
        assert await steps_run(app) == "intent,answer"
        assert 'key = "topic"\nenabled = false\n' in read(path)


async def test_a_refused_chain_writes_nothing_and_is_the_last_refusal(path: Path) -> None:
    before = read(path)
    async with running(path) as app:
        version = (await routes(app))["version"]
        r = await put(app, version, ("answer", True), ("topic", True), ("intent", True))
        assert r.status == 422
        err = r.json()["error"]
        assert err["code"] == "config_refused"
        assert "only policy rewrites may follow 'answer'" in err["message"]
        assert str(path) in err["message"]  # the reloader's line names the file and key
        assert read(path) == before
        assert await steps_run(app) == "topic,intent,answer"
        listed = await routes(app)
        assert listed["version"] == version
        refused = listed["reload"]["last_refused"]
        assert refused["by"] == "console:ops"
        assert "only policy rewrites may follow" in refused["error"]


async def test_a_stale_page_is_refused_and_a_non_admin_key_cannot_change_steps(path: Path) -> None:
    async with running(path) as app:
        old = (await routes(app))["version"]
        r = await put(app, old, ("intent", True), ("topic", True), ("answer", True))
        assert r.status == 200
        r = await put(app, old, ("topic", True), ("intent", True), ("answer", True))
        assert r.status == 409
        assert r.json()["error"]["code"] == "stale_version"
        assert await steps_run(app) == "intent,topic,answer"
        r = await put(app, r.json()["error"]["message"], ("topic", True), key=KEY_A)
        assert r.status == 403


async def test_a_console_token_survives_the_reload_it_made(path: Path) -> None:
    async with running(path) as app:
        c = Client(app)
        r = await c.request("POST", "/admin/api/login", headers=bearer(KEY_ADMIN))
        token = r.json()["token"]
        version = (await routes(app, token))["version"]
        r = await put(app, version, ("intent", True), ("topic", True), ("answer", True), key=token)
        assert r.status == 200, r.body
        # The new runtime's gate carries the secret: the same token still works.
        assert (await routes(app, token))["version"] == r.json()["version"]
