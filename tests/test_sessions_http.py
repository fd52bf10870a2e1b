"""Cross-channel sessions through the gateway, on both backends: the seed scenario,
the session endpoints, live events with Last-Event-ID resume, isolation, and faults."""

from __future__ import annotations

import gc
import json
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from aiserve_trio.adapters.base import DeltaSink, InferenceRequest
from aiserve_trio.adapters.retry import Progress
from aiserve_trio.config import parse_config
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client, Exchange, Response, chat_body
from .conftest import config_text
from .redis_server import RedisServer

SID = "session:20240521:abc789"
_SESSIONS = '[sessions]\nbackend = "memory"'


def build(backend: str, url: str = "", *, degrade: bool = False, tenant: str = "") -> App:
    """The default config on a zero-delay mock, with the given session backend."""
    text = config_text(ttft_ms="0", inter_token_ms="0")
    assert _SESSIONS in text
    text = text.replace(
        _SESSIONS,
        f'[sessions]\nbackend = "{backend}"\nurl = "{url}"\n'
        f'key_prefix = "t{secrets.token_hex(4)}"\nheartbeat_ms = 200\n'
        "outbox_retry_ms = 50\noutbox_retry_max_ms = 200\nconnect_timeout_ms = 300",
    )
    if degrade:
        text = text.replace('on_context_timeout = "fail"', 'on_context_timeout = "degrade"')
    if tenant:
        text = text.replace('default_tenant = "default"', f'default_tenant = "{tenant}"')
    return App(parse_config(text, source="<test>"))


@asynccontextmanager
async def running(a: App) -> AsyncIterator[App]:
    """The app started with its background tasks, and shut down even if the test fails."""
    async with trio.open_nursery() as nursery:
        await a.startup(nursery)
        try:
            yield a
        finally:
            await a.shutdown()


@pytest.fixture(params=["memory", "redis"])
async def app(request: pytest.FixtureRequest) -> AsyncIterator[App]:
    url = ""
    if request.param == "redis":
        url = request.getfixturevalue("redis_up").url
    async with running(build(request.param, url)) as a:
        yield a


def headers(channel: str, sid: str = SID, **extra: str) -> dict[str, str]:
    return {"x-session-id": sid, "x-channel": channel, **extra}


async def ask(client: Client, text: str, channel: str, **body: object) -> Response:
    r = await client.chat(chat_body(text, **body), headers(channel))
    assert r.status == 200, r.body
    return r


async def test_seed_scenario_app_then_wechat_then_ivr(app: App) -> None:
    client = Client(app)
    # The app sets income and term, and asks about a mortgage.
    meta = {"monthly_income": "8000 CNY", "loan_term": "20 years"}
    r1 = await ask(client, "I'd like a mortgage", "app", metadata=meta)
    assert "8000 CNY" in r1.json()["choices"][0]["message"]["content"]
    # WeChat, same session id, no metadata: the answer uses what the app set.
    r2 = await ask(client, "what about the loan then?", "wechat", stream=True)
    assert "8000 CNY" in r2.text()
    assert "20 years" in r2.text()
    # IVR continues the same conversation: it sees all earlier turns.
    r3 = await ask(client, "tell me about my session", "ivr")
    assert (
        "monthly income 8000 CNY, loan term 20 years"
        in r3.json()["choices"][0]["message"]["content"]
    )
    view = await client.request("GET", f"/v1/sessions/{SID}")
    assert view.status == 200
    got = view.json()
    assert got["variables"] == meta
    assert [(t["role"], t["channel"]) for t in got["turns"]] == [
        ("user", "app"), ("assistant", "app"),
        ("user", "wechat"), ("assistant", "wechat"),
        ("user", "ivr"), ("assistant", "ivr"),
    ]  # fmt: skip
    assert got["turns"][3]["content"] == r2.text()
    assert got["turns"][0]["request_id"] == r1.headers["x-request-id"]
    assert all(not t.get("truncated") for t in got["turns"])


async def test_history_reaches_the_model_as_prompt(
    app: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = Client(app)
    await ask(client, "echo: first words", "app")
    sent: list[InferenceRequest] = []
    adapter = app.routes["/v1/chat/completions"].adapter
    inner = adapter.attempt

    # The base's (final) ``stream`` hands each try the request as the model gets it.
    async def spy(request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        sent.append(request)
        await inner(request, send, progress)

    monkeypatch.setattr(adapter, "attempt", spy)
    await ask(client, "echo: second", "wechat", metadata={"loan_term": "5y"})
    msgs = [(m.role, m.content) for m in sent[0].messages]
    assert msgs == [
        ("system", "Known facts about this customer:\nloan_term: 5y"),
        ("user", "echo: first words"),
        ("assistant", "first words"),
        ("user", "echo: second"),
    ]


async def test_put_vars_then_chat_uses_them(app: App) -> None:
    client = Client(app)
    r = await client.request(
        "PUT", f"/v1/sessions/{SID}/vars", json_body={"monthly_income": "12000"}
    )
    assert (r.status, r.json()) == (200, {"id": SID, "updated": ["monthly_income"]})
    r2 = await ask(client, "mortgage please", "pad")
    assert "12000" in r2.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("GET", "/v1/sessions/bad%20id", None, 400),
        ("GET", "/v1/sessions/a}{b/events", None, 400),
        ("PUT", f"/v1/sessions/{SID}/vars", {"bad name": "x"}, 400),
        ("PUT", f"/v1/sessions/{SID}/vars", {"x": 1}, 400),
        ("PUT", f"/v1/sessions/{SID}/vars", ["x"], 400),
        ("POST", f"/v1/sessions/{SID}/vars", {"x": "1"}, 405),
        ("PUT", f"/v1/sessions/{SID}", {"x": "1"}, 405),
        ("GET", f"/v1/sessions/{SID}/other", None, 404),
    ],
)
async def test_session_endpoints_refuse_bad_requests(
    app: App, method: str, path: str, body: object, status: int
) -> None:
    r = await Client(app).request(method, path, json_body=body)
    assert r.status == status
    assert "error" in r.json()


async def test_bad_session_header_is_400_and_touches_nothing(app: App) -> None:
    r = await Client(app).chat(chat_body("hi"), headers("app", sid="x}{y:turns"))
    assert r.status == 400
    assert r.json()["error"]["param"] == "X-Session-Id"


async def test_bad_metadata_is_400(app: App) -> None:
    r = await Client(app).chat(chat_body("hi", metadata={"no spaces": "x"}), headers("app"))
    assert (r.status, r.json()["error"]["param"]) == (400, "metadata")


async def test_the_same_session_id_under_two_tenants_shares_nothing(
    request: pytest.FixtureRequest, app: App
) -> None:
    url = request.getfixturevalue("redis_up").url if app.bus.kind == "redis" else ""
    other = build(app.bus.kind, url, tenant="other-bank")
    other.config.sessions.key_prefix = app.config.sessions.key_prefix
    async with running(other):
        await ask(Client(app), "mortgage", "app", metadata={"monthly_income": "999"})
        r = await ask(Client(other), "mortgage", "app")
        assert "999" not in r.json()["choices"][0]["message"]["content"]
        view = (await Client(other).request("GET", f"/v1/sessions/{SID}")).json()
        assert view["variables"] == {}
        assert [t["role"] for t in view["turns"]] == ["user", "assistant"]


async def test_a_cut_stream_is_stored_as_truncated(app: App) -> None:
    client = Client(app)
    app.routes["/v1/chat/completions"].adapter.config.inter_token_ms = 20  # type: ignore[attr-defined]
    async with client.open(
        "POST",
        "/v1/chat/completions",
        json_body=chat_body("echo: one two three four five six seven", stream=True),
        headers=headers("app"),
    ) as ex:
        await ex.wait_for_bytes(3)
        ex.disconnect()
    got = (await client.request("GET", f"/v1/sessions/{SID}")).json()["turns"]
    assert [t["role"] for t in got] == ["user", "assistant"]
    assert got[1]["truncated"] is True
    assert 0 < len(got[1]["content"]) < len("one two three four five six seven")
    assert "one two three four five six seven".startswith(got[1]["content"])


# --- live events ----------------------------------------------------------------


def parse_sse(raw: bytes) -> list[dict[str, str]]:
    """SSE blocks as dicts (``id``, ``event``, ``data``; ``comment`` for ':' lines)."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        ev: dict[str, str] = {}
        for line in block.split("\n"):
            name, _, value = line.partition(":")
            ev["comment" if name == "" else name] = value.removeprefix(" ")
        out.append(ev)
    return out


async def wait_events(ex: Exchange, n: int) -> list[dict[str, str]]:
    while True:
        turns = [e for e in parse_sse(ex.response.body) if e.get("event") == "turn"]
        if len(turns) >= n or ex.done.is_set():
            return turns
        await ex.wait_for_bytes(len(ex.response.chunks) + 1)


async def test_events_replay_follow_and_resume_with_last_event_id(app: App) -> None:
    client = Client(app)
    await ask(client, "echo: before", "app")
    path = f"/v1/sessions/{SID}/events"
    with trio.fail_after(10):
        async with client.open("GET", path) as watcher:
            first = await wait_events(watcher, 2)  # replay
            assert watcher.response.headers["content-type"].startswith("text/event-stream")
            await ask(client, "echo: live one", "wechat", stream=True)
            live = await wait_events(watcher, 4)  # followed live, turn by turn
            watcher.disconnect()
        assert [json.loads(e["data"])["content"] for e in live] == [
            "echo: before", "before", "echo: live one", "live one",
        ]  # fmt: skip
        assert first == live[:2]
        # The browser reconnects with the last id it saw; turns written meanwhile
        # arrive once each, in order.
        await ask(client, "echo: while away", "ivr")
        async with client.open("GET", path, headers={"last-event-id": live[-1]["id"]}) as again:
            resumed = await wait_events(again, 2)
            again.disconnect()
    assert [json.loads(e["data"])["content"] for e in resumed] == ["echo: while away", "while away"]
    ids = [e["id"] for e in live + resumed]
    assert len(set(ids)) == len(ids)


async def test_events_heartbeat_and_end_cleanly_on_shutdown(app: App) -> None:
    client = Client(app)
    with trio.fail_after(10):
        async with client.open("GET", f"/v1/sessions/{SID}/events") as ex:
            while b": ping" not in ex.response.body:
                await ex.wait_for_bytes(len(ex.response.chunks) + 1)
            app.closing.set()
            await ex.done.wait()
    assert ex.response.complete
    assert ex.response.body.endswith(b"event: close\ndata: {}\n\n")
    assert ex.response.body.startswith(b"retry: ")


async def test_events_refuse_a_bad_last_event_id(app: App) -> None:
    r = await Client(app).request(
        "GET", f"/v1/sessions/{SID}/events", headers={"last-event-id": "x"}
    )
    assert (r.status, r.json()["error"]["param"]) == (400, "Last-Event-ID")


# --- faults (real redis-server) --------------------------------------------------

pytestmark = pytest.mark.filterwarnings(
    # coredis 6.9 leaves a failed connection's anyio streams unclosed (collected below).
    "ignore::pytest.PytestUnraisableExceptionWarning"
)


@pytest.fixture
def collect() -> object:
    yield None
    gc.collect()


@pytest.mark.slow
@pytest.mark.usefixtures("collect")
@pytest.mark.parametrize("mode", ["fail", "degrade"])
async def test_redis_down_fails_or_degrades_as_configured(redis_up: RedisServer, mode: str) -> None:
    a = build("redis", redis_up.url, degrade=mode == "degrade")
    async with running(a):
        client = Client(a)
        await ask(client, "mortgage", "app", metadata={"monthly_income": "7000"})
        redis_up.stop()
        try:
            start = trio.current_time()
            r = await client.chat(chat_body("mortgage"), headers("wechat"))
            elapsed = trio.current_time() - start
            ready = await client.request("GET", "/readyz")
        finally:
            redis_up.start()
        assert elapsed < 3.0
        assert ready.status == 503
        if mode == "fail":
            assert r.status == 503
            assert r.json()["error"]["code"] == "session_bus_unavailable"
        else:
            assert r.status == 200
            assert r.headers["x-aiserve-degraded"] == "context"
            assert "7000" not in r.json()["choices"][0]["message"]["content"]


@pytest.mark.slow
@pytest.mark.usefixtures("collect")
async def test_slow_redis_is_bounded_by_the_context_budget(redis_up: RedisServer) -> None:
    a = build("redis", redis_up.url, degrade=True)
    async with running(a):
        client = Client(a)
        await ask(client, "hello", "app")  # warm the pool
        redis_up.freeze()
        try:
            start = trio.current_time()
            r = await client.chat(
                chat_body("hello"), headers("app", **{"x-request-timeout-ms": "500"})
            )
            elapsed = trio.current_time() - start
        finally:
            redis_up.resume()
        # Degraded at the context cut (40 % of 400 ms), not hung.
        assert r.status == 200
        assert r.headers["x-aiserve-degraded"] == "context"
        assert elapsed < 1.0


@pytest.mark.slow
@pytest.mark.usefixtures("collect")
async def test_turns_survive_a_redis_restart_exactly_once(redis_up: RedisServer) -> None:
    a = build("redis", redis_up.url, degrade=True)
    async with running(a):
        client = Client(a)
        await ask(client, "echo: before", "app")
        redis_up.stop()
        try:
            sent = []
            async with trio.open_nursery() as load:  # a burst of requests while Redis is down
                for i in range(20):
                    load.start_soon(ask, client, f"echo: down {i}", "wechat")
                    sent.append(f"echo: down {i}")
            assert len(a.writeback.outbox) == 20
            assert b"aiserve_session_outbox_size 20.0" in a.metrics.render()
        finally:
            redis_up.start()
        for _ in range(200):  # the drain loop backs off at most 200 ms here
            if not a.writeback.outbox:
                break
            await trio.sleep(0.05)
        assert len(a.writeback.outbox) == 0
        view = (await client.request("GET", f"/v1/sessions/{SID}")).json()
        users = [t["content"] for t in view["turns"] if t["role"] == "user"]
        # The test's redis-server keeps nothing across a kill (no persistence), so
        # "before" is gone; the outbox owes exactly the turns written while it was down.
        assert sorted(users) == sorted(sent)  # every turn, exactly once
        assert len(view["turns"]) == 40
        assert b"aiserve_session_outbox_size 0.0" in a.metrics.render()
