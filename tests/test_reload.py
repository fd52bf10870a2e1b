"""Reloading the configuration without a restart, in-process on Trio's virtual clock:
in-flight requests finish on the config they started with, new ones see the new one,
a bad file is refused with its key while serving goes on, unchanged adapters are the
same objects, the watcher, who may reload, revoked keys, removed routes, admission
counts across a swap."""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from aiserve_trio.adapters.base import Adapter
from aiserve_trio.config import load_config
from aiserve_trio.reload import write_atomically
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client, Exchange, Response, make_scope
from .authcfg import KEY_A, KEY_ADMIN, KEY_B, auth_toml, bearer

OFF = "[auth]\nenabled = false\n"


def conf(
    *,
    a_reply: str = "alpha one two three four five six seven eight nine",
    b_reply: str = "bravo one two three",
    auth: str = OFF,
    watch: float = 0,
    extra: str = "",
    max_inflight: int = 1024,
    routes: str = "",
) -> str:
    """A small config: two mock adapters (``a`` paced slowly, ``b``), two chat routes."""
    return f"""
[server]
reload_watch_s = {watch}

[limits]
max_inflight = {max_inflight}

{auth}

[adapters.a]
kind = "mock"
models = ["model-a"]
ttft_ms = 10
inter_token_ms = 50
default_reply = "{a_reply}"

[adapters.b]
kind = "mock"
models = ["model-b"]
ttft_ms = 5
inter_token_ms = 5
default_reply = "{b_reply}"

[[routes]]
path = "/v1/chat/completions"
name = "chat"
adapter = "a"

[[routes]]
path = "/v1/b"
name = "b"
adapter = "b"
{routes}
{extra}
"""


def body(model: str = "model-a", text: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "stream": True, **extra}


@pytest.fixture
def path(tmp_path: Path) -> Path:
    p = tmp_path / "gateway.toml"
    write(p, conf())
    return p


@asynccontextmanager
async def running(path: Path) -> AsyncIterator[App]:
    """The app of ``path``, started (its background tasks and watcher run)."""
    app = App(load_config(path))
    async with trio.open_nursery() as nursery:
        await app.startup(nursery)
        try:
            yield app
        finally:
            await app.shutdown()
            nursery.cancel_scope.cancel()


def read(path: Path) -> str:
    return path.read_text()


def write(path: Path, text: str) -> None:
    path.write_text(text)


async def reload_now(
    app: App, clock: trio.testing.MockClock, *, by: str = "test", candidate: str | None = None
) -> Any:
    """A reload during which virtual time stands still: the new config is read and
    validated in a worker thread, and the autojump clock would jump while it runs."""
    clock.autojump_threshold = math.inf
    try:
        return await app.reloader.reload(by=by, candidate=candidate)
    finally:
        clock.autojump_threshold = 0


async def until(done: Any) -> None:
    """Wait until ``done()`` is true: what it waits for is finished by a worker thread,
    which no event of the app reports to a test. The thread runs in real time while the
    autojump clock jumps whenever the loop is idle, so the bound is real time (a loaded CI
    machine made a bound of virtual seconds run out before the thread had parsed the file)."""
    give_up = time.monotonic() + 30.0
    while not done():
        if time.monotonic() > give_up:
            raise AssertionError("still not done after 30 s")
        await trio.sleep(0.01)


def complete(r: Response) -> bool:
    """A stream that ended as it should: a finish reason, then [DONE]."""
    events = r.events()
    if not events or events[-1] != "[DONE]":
        return False
    return any(
        c.get("finish_reason") == "stop" for e in events[:-1] for c in json.loads(e)["choices"]
    )


async def chat_b(app: App, headers: dict[str, str] | None = None) -> Response:
    """A stream on the route of adapter ``b`` (fast)."""
    return await Client(app).request("POST", "/v1/b", json_body=body("model-b"), headers=headers)


async def post(app: App, path: str, **kw: Any) -> Response:
    return await Client(app).request("POST", path, **kw)


async def get(app: App, path: str, **kw: Any) -> Response:
    return await Client(app).request("GET", path, **kw)


# --- in flight on the old config, new requests on the new one ------------------------


async def test_in_flight_streams_finish_on_their_config_new_requests_use_the_new_one(
    path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    new_route = '\n[[routes]]\npath = "/v1/new"\nname = "new"\nadapter = "b"\n'
    async with running(path) as app:
        client = Client(app)
        async with trio.open_nursery() as nursery:
            streams = []
            headers = {"content-type": "application/json"}
            for _ in range(5):
                scope = make_scope("POST", "/v1/chat/completions", headers)
                ex = Exchange(app, scope, [json.dumps(body()).encode()])
                streams.append(ex)
                nursery.start_soon(ex.run)
            for ex in streams:
                await ex.wait_for_bytes(2)  # streaming, a few words in
            result = await reload_now(
                app, autojump_clock, candidate=conf(a_reply="zulu new words", routes=new_route)
            )
            assert result.applied, result.error
            for ex in streams:
                assert not ex.done.is_set()  # still streaming on the old adapter
            after = await client.request("POST", "/v1/chat/completions", json_body=body())
            assert after.text() == "zulu new words"
            new = await client.request("POST", "/v1/new", json_body=body("model-b"))
            assert new.text() == "bravo one two three"
            for ex in streams:
                await ex.done.wait()
                ex.disconnect()
        for ex in streams:
            assert complete(ex.response)
            assert ex.response.text() == "alpha one two three four five six seven eight nine"
        assert read(path) == conf(a_reply="zulu new words", routes=new_route)


async def test_a_removed_route_is_404_for_new_requests_while_its_stream_finishes(
    path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with running(path) as app:
        client = Client(app)
        async with client.open("POST", "/v1/chat/completions", json_body=body()) as ex:
            await ex.wait_for_bytes(2)
            without_chat = conf().replace(
                '[[routes]]\npath = "/v1/chat/completions"\nname = "chat"\nadapter = "a"\n', ""
            )
            assert (await reload_now(app, autojump_clock, candidate=without_chat)).applied
            gone = await client.request("POST", "/v1/chat/completions", json_body=body())
            assert gone.status == 404
            assert gone.json()["error"]["type"] == "invalid_request_error"
            await ex.done.wait()
        assert complete(ex.response)
        assert ex.response.text().startswith("alpha one")


async def test_a_route_gains_a_chain_for_new_requests_while_a_stream_on_it_goes_on_without(
    path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    steps = (
        '\n[[routes.steps]]\nname = "intent"\nkind = "classify"\n'
        'rules = [{ label = "greeting", pattern = "hi" }]\n'
        '[[routes.steps]]\nname = "answer"\nkind = "generate"\n'
    )
    async with running(path) as app:
        client = Client(app)
        async with client.open("POST", "/v1/chat/completions", json_body=body()) as ex:
            await ex.wait_for_bytes(2)
            chat = 'name = "chat"\nadapter = "a"\n'
            chained = conf().replace(chat, chat + steps)
            assert chained != conf()
            assert (await reload_now(app, autojump_clock, candidate=chained)).applied
            after = await client.request("POST", "/v1/chat/completions", json_body=body())
            assert after.headers["x-aiserve-steps"] == "intent,answer"
            assert complete(after)
            await ex.done.wait()
        assert "x-aiserve-steps" not in ex.response.headers
        assert complete(ex.response)


# --- refused: the running config stays -------------------------------------------------


async def test_an_invalid_file_is_refused_naming_the_key_and_serving_goes_on(
    path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with running(path) as app:
        before_version = app.reloader.version
        assert (await chat_b(app)).status == 200
        write(path, conf(max_inflight=-1))
        r = await post(app, "/admin/config/reload")
        assert r.status == 422
        err = r.json()["error"]
        assert err["code"] == "config_refused"
        assert err["param"] == "limits.max_inflight"
        assert str(path) in err["message"]
        assert "`limits.max_inflight`" in err["message"]
        assert r.headers["x-aiserve-config-version"] == before_version
        after = await chat_b(app)
        assert after.status == 200
        assert after.text() == "bravo one two three"
        status = (await get(app, "/admin/config")).json()
        assert status["version"] == before_version
        assert status["loaded_by"] == "startup"
        assert status["last_refused"]["by"] == "api:loopback"
        assert "limits.max_inflight" in status["last_refused"]["error"]
        metrics = app.metrics.render().decode()
        assert 'aiserve_config_reloads_total{result="refused"} 1.0' in metrics


async def test_a_refused_candidate_is_not_written(
    path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with running(path) as app:
        text = read(path)
        r = await post(
            app,
            "/admin/config/reload",
            body=conf(extra='[adapters.c]\nkind = "mock"\nmodels = []\n').encode(),
            headers={"content-type": "application/toml"},
        )
        assert r.status == 422
        assert r.json()["error"]["param"] == "adapters.c.models"
        assert read(path) == text


async def test_a_key_that_needs_a_restart_is_refused_by_name(
    path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with running(path) as app:
        changed = conf(extra='[sessions]\nurl = "redis://127.0.0.1:1/0"\n')
        result = await app.reloader.reload(by="test", candidate=changed)
        assert not result.applied
        assert result.error is not None
        assert "`sessions.url`" in result.error
        assert "restart" in result.error
        assert app.config.sessions.url != "redis://127.0.0.1:1/0"


async def test_the_embedded_default_cannot_save_a_candidate(
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AISERVE_CONFIG", raising=False)
    app = App(load_config())
    async with trio.open_nursery() as nursery:
        await app.startup(nursery)
        result = await app.reloader.reload(by="test", candidate=conf())
        assert result.error is not None
        assert "started on the embedded default; start with a config file to save" in result.error
        again = await app.reloader.reload(by="test")
        assert again.unchanged
        await app.shutdown()
        nursery.cancel_scope.cancel()


async def test_the_same_settings_are_unchanged(
    path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with running(path) as app:
        rt = app.runtime
        write(path, "# a comment only\n" + conf())
        r = await post(app, "/admin/config/reload")
        assert r.status == 200
        assert r.json() == {
            "applied": False,
            "unchanged": True,
            "version": app.reloader.version,
            "error": None,
        }
        assert app.runtime is rt
        assert 'aiserve_config_reloads_total{result="unchanged"} 1.0' in app.metrics.render().decode()


# --- adapters: the same object when unchanged, closed once unused ------------------------


async def test_an_unchanged_adapter_is_kept_a_changed_one_replaced_and_closed_after_its_requests(
    path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed: list[str] = []
    real_close = Adapter.aclose

    async def spy(self: Adapter) -> None:
        closed.append(self.name)
        await real_close(self)

    monkeypatch.setattr(Adapter, "aclose", spy)
    async with running(path) as app:
        old_a, old_b = app.adapters["a"], app.adapters["b"]
        client = Client(app)
        async with client.open("POST", "/v1/chat/completions", json_body=body()) as ex:
            await ex.wait_for_bytes(2)
            assert (await reload_now(app, autojump_clock, candidate=conf(a_reply="new"))).applied
            assert app.adapters["b"] is old_b
            assert app.adapters["a"] is not old_a
            assert app.routes["/v1/b"].adapter is old_b
            await trio.testing.wait_all_tasks_blocked()
            assert closed == []  # the old `a` still serves the stream in flight
            assert app.reloader.status()["draining"] == 1
            await ex.done.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert closed == ["a"]
        assert app.reloader.status()["draining"] == 0
        assert complete(ex.response)


async def test_cached_answers_outlive_a_reload_that_keeps_the_cache_backend(
    path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    def cached(ttl: int = 300, table: str = "") -> str:
        return conf(
            routes=f'\n[[routes]]\npath = "/v1/c"\nname = "c"\nadapter = "b"\n'
            f"cache = {{ deterministic_only = false, ttl_s = {ttl} }}\n",
            extra=table,
        )

    async def ask() -> str:
        r = await Client(app).request("POST", "/v1/c", json_body=body("model-b"))
        assert r.text() == "bravo one two three"
        return r.headers["x-aiserve-cache"]

    write(path, cached())
    async with running(path) as app:
        assert [await ask(), await ask()] == ["miss", "hit"]
        cache = app.cache
        assert cache is not None
        # Another route's adapter changes: the same cache object.
        other = cached().replace('default_reply = "alpha', 'default_reply = "alfa')
        assert (await reload_now(app, autojump_clock, candidate=other)).applied
        assert app.cache is cache
        # The route's cache settings change: a new plan on the same backend, entries kept.
        assert (await reload_now(app, autojump_clock, candidate=cached(ttl=600))).applied
        assert app.cache is not cache
        assert app.cache is not None
        assert app.cache.backend is cache.backend
        assert await ask() == "hit"
        # [cache] changes: a new backend, starting empty.
        smaller = cached(600, "[cache]\nmax_bytes = 1000000\n")
        assert (await reload_now(app, autojump_clock, candidate=smaller)).applied
        assert app.cache.backend is not cache.backend
        assert await ask() == "miss"


# --- the watcher ----------------------------------------------------------------------


async def test_the_watcher_loads_a_changed_file_on_the_virtual_clock(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = tmp_path / "gateway.toml"
    write(path, conf(watch=2))
    async with running(path) as app:
        first = app.reloader.version
        write_atomically(path, conf(watch=2, b_reply="watched reply"))
        await trio.sleep(1)
        assert app.reloader.version == first  # not yet: it looks every 2 s
        await until(lambda: app.reloader.version != first)
        assert trio.current_time() >= 2  # at the watcher's first look after the change
        assert app.reloader.status()["loaded_by"] == "watch"
        assert (await chat_b(app)).text() == "watched reply"
        # A bad file is refused once, not again every interval.
        write_atomically(path, conf(watch=2, max_inflight=0))
        await until(lambda: app.reloader.last_refused is not None)
        await trio.sleep(10)  # five more looks at the same bad file
        assert 'aiserve_config_reloads_total{result="refused"} 1.0' in app.metrics.render().decode()
        assert "limits.max_inflight" in str(app.reloader.status()["last_refused"])


# --- who may reload -------------------------------------------------------------------


def _exchange(app: App, method: str, path: str, client: str, headers: dict[str, str]) -> Exchange:
    scope = make_scope(method, path, headers)
    scope["client"] = (client, 40000)
    return Exchange(app, scope, [b""])


async def _call(
    app: App,
    method: str,
    path: str,
    client: str = "127.0.0.1",
    headers: dict[str, str] | None = None,
) -> Response:
    ex = _exchange(app, method, path, client, headers or {})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ex.run)
        await ex.done.wait()
        ex.disconnect()
    return ex.response


async def test_auth_off_answers_loopback_only(
    path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with running(path) as app:
        for method, where in (("POST", "/admin/config/reload"), ("GET", "/admin/config")):
            far = await _call(app, method, where, client="10.1.2.3")
            assert far.status == 403
            assert far.json()["error"]["code"] == "loopback_only"
            assert (await _call(app, method, where)).status == 200


async def test_only_admin_keys_may_reload_and_a_revoked_key_stops_working(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = tmp_path / "gateway.toml"
    write(path, conf(auth=auth_toml()))
    async with running(path) as app:
        refused = await _call(app, "POST", "/admin/config/reload", headers=bearer(KEY_B))
        assert refused.status == 403
        assert refused.json()["error"]["code"] == "admin_only"
        assert (await _call(app, "GET", "/admin/config", headers=bearer(KEY_A))).status == 403
        assert (await _call(app, "GET", "/admin/config")).status == 401
        assert (await chat_b(app, bearer(KEY_B))).status == 200
        # Revoke bob: his key is gone from the file.
        text = auth_toml()
        start = text.index('[[auth.keys]]\nid = "bob"')
        revoked = text[:start] + text[text.index("[[auth.keys]]\nid = \"ops\""):]
        write(path, conf(auth=revoked))
        ok = await _call(app, "POST", "/admin/config/reload", headers=bearer(KEY_ADMIN))
        assert ok.status == 200, ok.body
        assert ok.json()["applied"] is True
        assert app.reloader.status()["loaded_by"] == "api:ops"
        gone = await chat_b(app, bearer(KEY_B))
        assert gone.status == 401
        assert gone.json()["error"]["message"] == "the API key is not valid"


# --- admission across a swap ----------------------------------------------------------


async def test_admission_counts_carry_over_and_new_caps_apply_to_new_requests(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = tmp_path / "gateway.toml"
    write(path, conf(max_inflight=3))
    async with running(path) as app:
        client = Client(app)
        async with (
            client.open("POST", "/v1/chat/completions", json_body=body()) as one,
            client.open("POST", "/v1/chat/completions", json_body=body()) as two,
        ):
            await one.wait_for_bytes(1)
            await two.wait_for_bytes(1)
            # Two in flight; the new cap is two: a third request is refused, not admitted
            # on a fresh count.
            assert (await reload_now(app, autojump_clock, candidate=conf(max_inflight=2))).applied
            assert app.gate.admission.inflight == 2
            third = await chat_b(app)
            assert third.status == 503
            await one.done.wait()
            await two.done.wait()
        assert app.gate.admission.inflight == 0
        assert (await chat_b(app)).status == 200
