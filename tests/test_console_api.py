"""The console's endpoints in process: the page and its files, who may call the API (admin
keys, console tokens, loopback with auth off), and the live numbers it serves."""

from __future__ import annotations

import fnmatch
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import trio

from aiserve_trio.console.handlers import FILES
from aiserve_trio.core.budgets import STAGES
from aiserve_trio.runtime.asgi import App
from aiserve_trio.security.gate import CONSOLE_SUBJECT

from .asgi_client import Client, Exchange, Response, chat_body, make_scope
from .authcfg import KEY_A, KEY_ADMIN, auth_app, bearer
from .conftest import make_config

API = ["/admin/api/overview", "/admin/api/slow", "/admin/api/routes", "/admin/api/cache"]


async def call(app: App, method: str, path: str, *, headers: dict[str, str] | None = None,
               client: tuple[str, int] | None = ("127.0.0.1", 40000), body: bytes = b"") -> Response:
    path, _, query = path.partition("?")
    scope = make_scope(method, path, headers)
    scope["query_string"] = query.encode()
    scope["client"] = client
    ex = Exchange(app, scope, [body])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ex.run)
        await ex.done.wait()
        ex.disconnect()
    return ex.response


def error(r: Response) -> dict[str, Any]:
    assert set(r.json()) == {"error"}, r.body
    body: dict[str, Any] = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return body


async def login(app: App, key: str = KEY_ADMIN) -> str:
    r = await call(app, "POST", "/admin/api/login", headers=bearer(key))
    assert r.status == 200, r.body
    token: str = r.json()["token"]
    return token


# --- the page ----------------------------------------------------------------------


async def test_the_page_and_its_files_need_no_key_and_load_nothing_from_elsewhere() -> None:
    app = auth_app()
    page = await call(app, "GET", "/admin/")
    assert page.status == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp
    assert "script-src 'self'" in csp
    assert "frame-ancestors 'none'" in csp
    html = page.body.decode()
    assert '<script type="module" src="static/console.js">' in html
    assert "//" not in html.replace("<!doctype html>", "")  # no CDN, no other origin
    for name, ctype in (("console.js", "text/javascript"), ("console.css", "text/css")):
        r = await call(app, "GET", f"/admin/static/{name}")
        assert r.status == 200
        assert r.headers["content-type"].startswith(ctype)
        assert r.headers["x-content-type-options"] == "nosniff"
        assert b"http://" not in r.body
        assert b"https://" not in r.body
    r = await call(app, "GET", "/admin")
    assert (r.status, r.headers["location"]) == (308, "/admin/")


@pytest.mark.parametrize("name", ["nope.js", "index.html", "..", "%2e%2e"])
async def test_only_the_pages_own_files_are_served(name: str) -> None:
    r = await call(auth_app(), "GET", f"/admin/static/{name}")
    assert r.status == 404
    assert error(r)["type"] == "invalid_request_error"


# --- who may call ------------------------------------------------------------------


@pytest.mark.parametrize("path", API)
async def test_the_api_needs_an_admin_key_or_a_console_token(path: str) -> None:
    app = auth_app()
    r = await call(app, "GET", path)
    assert r.status == 401
    assert error(r)["code"] == "missing_api_key"
    r = await call(app, "GET", path, headers=bearer(KEY_A))
    assert r.status == 403
    assert error(r)["code"] == "admin_only"
    r = await call(app, "GET", path, headers=bearer(KEY_ADMIN))
    assert r.status == 200
    token = await login(app)
    r = await call(app, "GET", path, headers=bearer(token), client=("203.0.113.9", 5555))
    assert r.status == 200


async def test_login_refuses_a_key_that_is_not_an_admin_key() -> None:
    app = auth_app()
    r = await call(app, "POST", "/admin/api/login", headers=bearer(KEY_A))
    assert r.status == 403
    assert error(r)["code"] == "admin_only"
    r = await call(app, "POST", "/admin/api/login", headers=bearer(KEY_ADMIN[:-1] + "x"))
    assert r.status == 401
    r = await call(app, "POST", "/admin/api/login")
    assert r.status == 401
    r = await call(app, "GET", "/admin/api/login", headers=bearer(KEY_ADMIN))
    assert r.status == 405


async def test_login_hands_out_a_short_lived_token_for_the_key() -> None:
    app = auth_app()
    r = await call(app, "POST", "/admin/api/login", headers=bearer(KEY_ADMIN))
    body = r.json()
    assert body["key_id"] == "ops"
    assert body["auth"] is True
    assert body["expires_in"] == 900
    assert r.headers["cache-control"] == "no-store"
    assert not body["token"].startswith("aik_")
    assert KEY_ADMIN not in r.body.decode()


async def test_a_console_token_opens_the_console_api_and_nothing_else() -> None:
    app = auth_app()
    token = await login(app)
    # Not a key: not for chat, other admin endpoints, or minting more tokens.
    r = await Client(app).request(
        "POST", "/v1/chat/completions", json_body=chat_body(), headers=bearer(token)
    )
    assert r.status == 401
    r = await call(app, "GET", "/debug/profile?seconds=0.1", headers=bearer(token))
    assert r.status == 401
    r = await call(app, "POST", "/admin/api/login", headers=bearer(token))
    assert r.status == 401
    r = await call(app, "GET", "/v1/models", headers=bearer(token))
    assert r.status == 401


async def test_stream_tokens_and_console_tokens_do_not_pass_for_each_other() -> None:
    app = auth_app()
    gate = app.gate
    ops = gate._principals["ops"]
    # A stream token for a session named like the console's subject.
    stream = gate.tokens.issue(ops, CONSOLE_SUBJECT)
    r = await call(app, "GET", "/admin/api/overview", headers=bearer(stream))
    assert r.status == 401
    assert error(r)["code"] == "invalid_console_token"
    console = gate.console_token(ops)
    r = await call(app, "GET", f"/v1/sessions/{CONSOLE_SUBJECT}/events?token={console}")
    assert r.status == 401
    assert error(r)["code"] == "invalid_stream_token"


async def test_an_expired_or_forged_console_token_is_refused() -> None:
    app = auth_app()
    gate = app.gate
    ops = gate._principals["ops"]
    old = gate.console_tokens.issue(ops, CONSOLE_SUBJECT, now=time.time() - 901)
    r = await call(app, "GET", "/admin/api/overview", headers=bearer(old))
    assert r.status == 401
    assert error(r)["code"] == "expired_console_token"
    expiry, key_id, sig = gate.console_token(ops).split(".")
    longer = f"{int(expiry) + 3600}.{key_id}.{sig}"
    r = await call(app, "GET", "/admin/api/overview", headers=bearer(longer))
    assert r.status == 401
    assert error(r)["code"] == "invalid_console_token"
    # Signed for a key that is not an admin: the key's rights decide, not the token.
    alice = gate.console_token(gate._principals["alice"])
    r = await call(app, "GET", "/admin/api/overview", headers=bearer(alice))
    assert r.status == 403
    # Another worker's secret (none shared): not valid here.
    other = auth_app().gate.console_token(ops)
    r = await call(app, "GET", "/admin/api/overview", headers=bearer(other))
    assert r.status == 401


@pytest.mark.parametrize("path", API)
@pytest.mark.parametrize(
    ("client", "status"),
    [(("127.0.0.1", 1), 200), (("::1", 1), 200), (("10.0.0.5", 1), 403), (None, 403)],
)
async def test_with_auth_off_only_loopback_clients(
    path: str, client: tuple[str, int] | None, status: int
) -> None:
    app = App(make_config())
    r = await call(app, "GET", path, client=client)
    assert r.status == status
    if status == 403:
        assert error(r)["code"] == "loopback_only"
    # The page itself is open: it is the API that holds what matters.
    assert (await call(app, "GET", "/admin/", client=client)).status == 200


async def test_with_auth_off_login_gives_no_token() -> None:
    app = App(make_config())
    r = await call(app, "POST", "/admin/api/login")
    assert r.json() == {"token": None, "expires_in": None, "key_id": None, "auth": False}
    r = await call(app, "POST", "/admin/api/login", client=("10.0.0.5", 1))
    assert r.status == 403


# --- the numbers -------------------------------------------------------------------


async def test_the_overview_counts_a_chat_request_by_model_and_stage() -> None:
    app = auth_app()
    c = Client(app)
    for _ in range(3):
        r = await c.chat(chat_body("echo: one two three"), headers=bearer(KEY_ADMIN))
        assert r.status == 200
    r = await call(app, "GET", "/admin/api/overview", headers=bearer(KEY_ADMIN))
    out = r.json()
    (row,) = out["total"]["models"]
    assert (row["route"], row["model"], row["requests"], row["errors"]) == (
        "chat", "aiserve-mock", 3, 0  # the model's own name, as everywhere else
    )
    assert row["error_rate"] == 0.0
    assert row["p95_s"] > 0
    assert row["tokens_per_request"] > 0
    stages = {s["stage"]: s for s in out["total"]["stages"]}
    assert set(stages) == {"parse", "context", "inference", "sse"}
    assert all(s["runs"] == 3 for s in stages.values())
    assert stages["inference"]["p99_s"] > 0
    assert out["open_streams"] == 0
    # The first look opens the window: nothing in it yet.
    assert out["window"]["models"] == []


async def test_the_window_counts_what_finished_since_an_earlier_look(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = auth_app()
    await call(app, "GET", "/admin/api/overview", headers=bearer(KEY_ADMIN))
    await trio.sleep(10)
    await Client(app).chat(chat_body("hello"), headers=bearer(KEY_ADMIN))
    out = (await call(app, "GET", "/admin/api/overview", headers=bearer(KEY_ADMIN))).json()
    window = out["window"]
    assert window["window_s"] >= 10
    (row,) = window["models"]
    assert row["requests"] == 1
    assert row["rps"] == pytest.approx(1 / window["window_s"])


async def test_a_started_worker_keeps_the_last_minute_before_any_page_looks(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = auth_app()
    async with trio.open_nursery() as nursery:
        await app.startup(nursery)
        try:
            for _ in range(2):
                await Client(app).chat(chat_body("hello"), headers=bearer(KEY_ADMIN))
            await trio.sleep(20)
            # The first look: the requests of 20 s ago are in the last minute.
            window = (await call(app, "GET", "/admin/api/overview", headers=bearer(KEY_ADMIN))).json()["window"]
            assert 20 <= window["window_s"] <= 60
            (row,) = window["models"]
            assert (row["model"], row["requests"]) == ("aiserve-mock", 2)
            assert {s["stage"]: s["runs"] for s in window["stages"]} == dict.fromkeys(STAGES, 2)
            await trio.sleep(60)
            # A minute later they have left the window, and not the totals.
            out = (await call(app, "GET", "/admin/api/overview", headers=bearer(KEY_ADMIN))).json()
            assert out["window"]["models"] == []
            assert out["window"]["window_s"] == pytest.approx(60, abs=2)
            assert out["total"]["models"][0]["requests"] == 2
        finally:
            await app.shutdown()
            nursery.cancel_scope.cancel()


async def test_slow_requests_have_stage_times_without_debug_requests() -> None:
    app = auth_app()
    assert not app.config.observability.debug_requests
    c = Client(app)
    await c.chat(chat_body("hello"), headers=bearer(KEY_ADMIN))
    await c.chat(chat_body("echo: x"), headers=bearer(KEY_ADMIN))
    r = await call(app, "GET", "/admin/api/slow", headers=bearer(KEY_ADMIN))
    requests = r.json()["requests"]
    assert len(requests) == 2
    assert requests[0]["total_ms"] >= requests[1]["total_ms"]
    assert set(requests[0]["stages_ms"]) == {"parse", "context", "inference", "sse"}
    assert requests[0]["request_id"].startswith("chatcmpl-")
    # The debug endpoint stays off unless asked for.
    r = await call(app, "GET", "/debug/requests/recent", headers=bearer(KEY_ADMIN))
    assert r.status == 404


async def test_an_admin_of_one_tenant_sees_its_tenants_slow_requests_only() -> None:
    from .authcfg import KEY_B, auth_toml
    from .keyscfg import KEY_TADMIN, ROLE_KEYS

    app = auth_app(auth_toml() + ROLE_KEYS)
    c = Client(app)
    a = await c.chat(chat_body("hello from bank-a"), headers=bearer(KEY_A))
    b = await c.chat(chat_body("hello from bank-b"), headers=bearer(KEY_B))
    ids = {a.json()["id"]: "bank-a", b.json()["id"]: "bank-b"}
    every = await call(app, "GET", "/admin/api/slow", headers=bearer(KEY_ADMIN))
    assert {r["request_id"]: r["tenant"] for r in every.json()["requests"]} == ids
    token = await login(app, KEY_TADMIN)  # tara: an admin of bank-a only
    own = await call(app, "GET", "/admin/api/slow", headers=bearer(token))
    assert [r["request_id"] for r in own.json()["requests"]] == [a.json()["id"]]


def test_every_file_of_the_page_is_package_data() -> None:
    """A non-editable install ships what ``static_files()`` serves (pyproject's package-data)."""
    root = Path(__file__).resolve().parent.parent
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["aiserve_trio"]
    static = root / "src" / "aiserve_trio" / "console" / "static"
    shipped = sorted(p.name for p in static.iterdir())
    assert shipped == sorted(FILES)
    for name in shipped:
        assert any(fnmatch.fnmatch(f"console/static/{name}", p) for p in patterns), name


CHAIN = """
[[routes]]
path = "/v1/bank"
name = "bank"
adapter = "mock"

[[routes.steps]]
name = "intent"
kind = "classify"
[[routes.steps.rules]]
label = "greeting"
pattern = 'hello'

[[routes.steps]]
kind = "generate"

[[routes.steps]]
name = "comply"
kind = "rewrite"
policy = "no-rate-figures"
enabled = false
"""


async def test_the_routes_with_their_steps_as_the_active_config_has_them() -> None:
    app = App(make_config(CHAIN))
    r = await call(app, "GET", "/admin/api/routes")
    assert r.status == 200
    out = r.json()
    # Built from a text, not a file: shown, not saved.
    assert out["writable"] is False
    assert "without a config file" in out["reason"]
    assert out["version"] == out["reload"]["version"] == app.reloader.version
    routes = {rt["path"]: rt for rt in out["routes"]}
    assert routes["/v1/chat/completions"]["steps"] == []
    assert routes["/v1/bank"] == {
        "path": "/v1/bank",
        "name": "bank",
        "steps": [
            {"name": "intent", "kind": "classify", "enabled": True},
            {"name": "generate", "kind": "generate", "enabled": True},
            {"name": "comply", "kind": "rewrite", "enabled": False},
        ],
        "adapters": ["mock"],
        "models": {"aiserve-mock": "mock"},
    }
