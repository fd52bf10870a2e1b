"""Console tokens logged out on the server (issue 55, item 2): ``POST /admin/api/logout``
refuses the token until its expiry -- the other tokens still work, the deny-list stays
bounded, and with a Redis session bus every worker refuses it."""

from __future__ import annotations

import time

import pytest
import trio

from aiserve_trio.config import parse_config
from aiserve_trio.runtime.asgi import App
from aiserve_trio.security.gate import CONSOLE_SUBJECT, Revoked

from .authcfg import KEY_ADMIN, OFF, auth_app, auth_toml, bearer
from .conftest import config_text
from .redis_server import RedisServer
from .sim_gateway import running
from .test_console_api import call, error, login


async def test_a_logged_out_token_is_refused_and_the_others_still_work() -> None:
    app = auth_app()
    token = await login(app)
    ops = app.gate._principals["ops"]
    # Another tab's token (the same key, logged in a minute ago): a different token.
    other = app.gate.console_tokens.issue(ops, CONSOLE_SUBJECT, now=time.time() - 60)
    assert (await call(app, "GET", "/admin/api/overview", headers=bearer(token))).status == 200
    out = await call(app, "POST", "/admin/api/logout", headers=bearer(token))
    assert out.status == 200, out.body
    body = out.json()
    assert (body["revoked"], body["shared"]) == (True, False)
    assert body["until"] == int(token.partition(".")[0])
    refused = await call(app, "GET", "/admin/api/overview", headers=bearer(token))
    assert refused.status == 401
    assert error(refused)["code"] == "revoked_console_token"
    # Logged out for good: not a second logout, not a route.
    again = await call(app, "POST", "/admin/api/logout", headers=bearer(token))
    assert again.status == 401
    for credential in (other, KEY_ADMIN):
        r = await call(app, "GET", "/admin/api/overview", headers=bearer(credential))
        assert r.status == 200, r.body
    # Log out takes the token, not the key it was made from.
    r = await call(app, "POST", "/admin/api/logout", headers=bearer(KEY_ADMIN))
    assert r.status == 400
    assert error(r)["code"] == "not_a_console_token"


async def test_a_reload_keeps_the_logged_out_tokens() -> None:
    app = auth_app()
    token = await login(app)
    assert (await call(app, "POST", "/admin/api/logout", headers=bearer(token))).status == 200
    successor = app.gate.successor(app.config)
    assert successor.revoked is app.gate.revoked


async def test_the_deny_list_stays_bounded_and_drops_expired_tokens() -> None:
    revoked = Revoked(max_entries=3)
    now = 1_000_000.0
    for i in range(3):
        await revoked.add(f"{int(now) + 10 + i}.ops.sig{i}", "ops", int(now) + 10 + i, now)
    assert len(revoked) == 3
    # Full of live tokens: the next logout denies every token of its key expiring no
    # later than it -- never grows, never lets the logged-out token through.
    await revoked.add(f"{int(now) + 900}.ops.new", "ops", int(now) + 900, now)
    assert len(revoked) == 3
    assert await revoked.denied(f"{int(now) + 900}.ops.new", "ops", int(now) + 900)
    assert await revoked.denied(f"{int(now) + 500}.ops.tab2", "ops", int(now) + 500)
    assert not await revoked.denied(f"{int(now) + 500}.bob.tab", "bob", int(now) + 500)
    assert not await revoked.denied(f"{int(now) + 901}.ops.later", "ops", int(now) + 901)
    # Once their tokens have expired, the entries go at the next logout.
    later = now + 1000
    await revoked.add(f"{int(later) + 900}.bob.x", "bob", int(later) + 900, later)
    assert len(revoked) == 1
    assert not await revoked.denied(f"{int(later) + 500}.ops.y", "ops", int(later) + 500)


async def test_with_many_logouts_the_list_never_passes_its_bound() -> None:
    app = auth_app()
    app.gate.revoked.max_entries = 50
    ops = app.gate._principals["ops"]
    tokens = [
        app.gate.console_tokens.issue(ops, CONSOLE_SUBJECT, now=time.time() - i) for i in range(80)
    ]
    for token in reversed(tokens):  # the oldest first: each is still valid at its logout
        r = await call(app, "POST", "/admin/api/logout", headers=bearer(token))
        assert r.status == 200, r.body
    assert len(app.gate.revoked) <= 50
    for token in tokens:  # every one of them refused all the same
        r = await call(app, "GET", "/admin/api/overview", headers=bearer(token))
        assert r.status == 401


def shared_app(redis_url: str) -> App:
    auth = auth_toml().replace("AISERVE_TEST_TOKEN_SECRET_UNSET", "AISERVE_TEST_CONSOLE_SECRET")
    text = config_text().replace(OFF, auth)
    sessions = f'[sessions]\nbackend = "redis"\nurl = "{redis_url}"\nkey_prefix = "logouttest"\n'
    text = text.replace('[sessions]\nbackend = "memory"\n', sessions, 1)
    return App(parse_config(text, source="<test>"))


async def test_with_redis_every_worker_refuses_a_logged_out_token(
    redis_up: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AISERVE_TEST_CONSOLE_SECRET", "s" * 32)
    one, two = shared_app(redis_up.url), shared_app(redis_up.url)
    async with running(one), running(two):
        token = await login(one)
        other = one.gate.console_tokens.issue(
            one.gate._principals["ops"], CONSOLE_SUBJECT, now=time.time() - 60
        )
        assert (await call(two, "GET", "/admin/api/slow", headers=bearer(token))).status == 200
        out = await call(one, "POST", "/admin/api/logout", headers=bearer(token))
        assert out.json()["shared"] is True
        refused = await call(two, "GET", "/admin/api/slow", headers=bearer(token))
        assert refused.status == 401
        assert error(refused)["code"] == "revoked_console_token"
        assert (await call(two, "GET", "/admin/api/slow", headers=bearer(other))).status == 200
        # Redis away: the worker that took a logout still refuses; the console stays open.
        redis_up.stop()
        try:
            with trio.fail_after(5):
                r = await call(two, "GET", "/admin/api/slow", headers=bearer(other))
            assert r.status == 200
            with trio.fail_after(5):
                r = await call(one, "GET", "/admin/api/slow", headers=bearer(token))
            assert r.status == 401
        finally:
            redis_up.start()


async def test_a_page_on_another_origin_cannot_log_a_token_out() -> None:
    # The console's browser rules: a cross-site form or fetch cannot end an operator's
    # session (nor learn whether a token is valid).
    app = auth_app()
    token = await login(app)
    headers = {**bearer(token), "origin": "https://evil.example"}
    r = await call(app, "POST", "/admin/api/logout", headers=headers)
    assert r.status == 403
    assert (await call(app, "GET", "/admin/api/overview", headers=bearer(token))).status == 200
