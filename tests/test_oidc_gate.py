"""Single sign-on through the gate (issue 47, item 3), against a real OIDC issuer on
loopback (tests/oidc_issuer.py): its discovery document and JWKS fetched over HTTP, its
tokens on model, admin and console endpoints, each refusal a 401 with its reason, a key
rotation picked up (one fetch however many wait), and cached keys serving while the
issuer is down."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
import trio.testing

from aiserve_trio.runtime.asgi import App

from .asgi_client import Client, Response, chat_body
from .authcfg import KEY_ADMIN, auth_app, auth_toml
from .oidc_issuer import Issuer, SigningKey, oidc_toml, running_issuer
from .sim_gateway import running
from .test_console_api import call


def sso_app(iss: Issuer, audit: Path | None = None, **values: Any) -> App:
    """The default app with the issuer's ``[[auth.oidc]]`` beside the config keys, and an
    audit log in ``audit`` (a folder) when given."""
    text = auth_toml(extra=oidc_toml(iss.url, **values))
    if audit is not None:
        text += f'\n[audit]\npath = "{audit / "audit.db"}"\nretention_days = 30\n'
    return auth_app(text)


def bearer(token: str, **extra: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}", **extra}


def code(r: Response) -> str:
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "authentication_error" or r.status != 401
    return str(body["error"]["code"])


async def until(done: Callable[[], bool], within_s: float = 5.0) -> None:
    """Let the run go on (real I/O included) until ``done()``: the clock may be frozen."""
    give_up = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < give_up, "never happened"
        await trio.testing.wait_all_tasks_blocked()
        await trio.lowlevel.checkpoint()


async def test_a_token_of_the_issuer_acts_with_its_claims_tenant_team_and_roles(
    tmp_path: Path,
) -> None:
    async with running_issuer() as iss, running(sso_app(iss, tmp_path)) as client:
        user = iss.token(team="cards")
        r = await client.chat(chat_body(), bearer(user))
        assert r.status == 200, r.body
        # Discovery, then the JWKS: both fetched, once.
        assert (iss.discovery_fetches, iss.jwks_fetches) == (1, 1)
        # A user is no admin; an admin token is, of its own tenant only.
        r = await client.request("GET", "/admin/usage", headers=bearer(user))
        assert r.status == 403, r.body
        admin = iss.token(sub="olga", groups=["gateway-admins"])
        r = await client.request("GET", "/admin/usage", headers=bearer(admin))
        assert r.status == 200, r.body
        r = await client.request("GET", "/admin/config", headers=bearer(admin))
        assert (r.status, code(r)) == (403, "global_admin_only")
        root = iss.token(sub="root", groups=["gateway-root"])
        r = await client.request("GET", "/admin/config", headers=bearer(root))
        assert r.status == 200, r.body
        # An admin without the user role calls no model (its routes are none).
        r = await client.chat(chat_body(), bearer(admin))
        assert r.status == 403, r.body
        assert iss.jwks_fetches == 1
        # Config keys still work beside the tokens.
        r = await client.request("GET", "/admin/usage", headers=bearer(KEY_ADMIN))
        assert r.status == 200, r.body


async def test_a_tokens_requests_are_its_tenants_and_an_admin_reads_its_own(
    tmp_path: Path,
) -> None:
    async with running_issuer() as iss:
        app = sso_app(iss, tmp_path)
        async with running(app) as client:
            for sub, tenant in (("alice", "bank-a"), ("bea", "bank-b"), ("bea", "bank-b")):
                r = await client.chat(chat_body("hi"), bearer(iss.token(sub=sub, tenant=tenant)))
                assert r.status == 200, r.body
            assert app.audit is not None
            await app.audit.settle()
            admin_b = iss.token(sub="boss", tenant="bank-b", groups=["gateway-admins"])
            r = await client.request("GET", "/admin/usage?group_by=key", headers=bearer(admin_b))
            assert r.status == 200, r.body
            assert {g["group"]: g["requests"] for g in r.json()["groups"]} == {"sso:bea": 2}
            root = iss.token(sub="root", groups=["gateway-root"])
            r = await client.request("GET", "/admin/usage?group_by=tenant", headers=bearer(root))
            assert {g["group"]: g["requests"] for g in r.json()["groups"]} == {
                "bank-a": 1,
                "bank-b": 2,
            }


async def test_each_refusal_is_a_401_in_the_envelope_with_its_reason() -> None:
    async with running_issuer() as iss:
        client = Client(sso_app(iss))
        now = time.time()
        stranger = SigningKey.new("k1")  # the issuer's key id, not its key
        unpublished = SigningKey.new("k9")
        claims = {"iss": iss.url, "aud": "aiserve-gateway", "sub": "m", "exp": int(now) + 60}
        head = {"alg": "none", "typ": "JWT", "kid": "k1"}
        unsigned = ".".join(_b64(p) for p in (head, claims)) + "."
        cases = {
            "token_bad_signature": iss.token(key=stranger),
            "token_wrong_audience": iss.token(aud="another-app"),
            "token_wrong_issuer": iss.token(iss="https://login.evil.example"),
            "token_expired": iss.token(now=now - 3600),
            "token_not_yet_valid": iss.token(nbf=int(now) + 600, lifetime_s=900),
            "token_alg_none": unsigned,
            "token_unknown_kid": iss.token(key=unpublished),
        }
        for reason, token in cases.items():
            for method, path in (("POST", "/v1/chat/completions"), ("GET", "/admin/usage")):
                if method == "POST":
                    r = await client.chat(chat_body(), bearer(token))
                else:
                    r = await client.request(method, path, headers=bearer(token))
                assert (r.status, code(r)) == (401, reason), (path, r.body)
                # An OAuth client reads the refusal from the challenge too (RFC 6750 3.1).
                assert r.headers["www-authenticate"] == (
                    f'Bearer realm="aiserve-trio", error="invalid_token", error_description="{reason}"'
                )
        # Fetched once: the unknown key id came within min_refresh_s of that fetch.
        assert iss.jwks_fetches == 1


def _b64(part: dict[str, Any]) -> str:
    import base64

    return base64.urlsafe_b64encode(json.dumps(part).encode()).rstrip(b"=").decode()


async def test_a_rotation_is_picked_up_with_one_fetch_per_interval(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with running_issuer() as iss:
        client = Client(sso_app(iss, min_refresh_s=30))
        r = await client.request("GET", "/v1/models", headers=bearer(iss.token()))
        assert r.status == 200, r.body
        assert iss.jwks_fetches == 1
        first = iss.keys[0]
        iss.rotate("k2")
        new = iss.token()
        # Within min_refresh_s of the last fetch an unknown key id fetches nothing.
        for _ in range(5):
            r = await client.request("GET", "/v1/models", headers=bearer(new))
            assert (r.status, code(r)) == (401, "token_unknown_kid")
        assert iss.jwks_fetches == 1
        mock_clock.jump(31)
        # Past it: ten requests at once with the new key id -- one fetch, all served.
        statuses: list[int] = []

        async def one() -> None:
            got = await client.request("GET", "/v1/models", headers=bearer(new))
            statuses.append(got.status)

        async with trio.open_nursery() as nursery:
            for _ in range(10):
                nursery.start_soon(one)
        assert statuses == [200] * 10
        assert iss.jwks_fetches == 2
        # The old key is gone from the issuer's JWKS: its tokens are refused now.
        r = await client.request("GET", "/v1/models", headers=bearer(iss.token(key=first)))
        assert (r.status, code(r)) == (401, "token_unknown_kid")


async def test_keys_are_prefetched_refreshed_and_kept_while_the_issuer_is_down(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with running_issuer() as iss:
        app = sso_app(iss, refresh_s=600, min_refresh_s=30)
        async with running(app) as client:
            # Fetched at start-up, before any token came.
            await until(lambda: iss.jwks_fetches == 1)
            token = iss.token(lifetime_s=7200)
            r = await client.request("GET", "/v1/models", headers=bearer(token))
            assert r.status == 200, r.body
            assert iss.jwks_fetches == 1
            # Refreshed in the background when due.
            mock_clock.jump(601)
            await until(lambda: iss.jwks_fetches == 2)
            jwks = app.gate.oidc.issuers[iss.url]
            # The issuer goes down: the refresh fails, the cached keys keep serving.
            await iss.down()
            mock_clock.jump(601)
            await until(lambda: jwks.failures == 1)
            r = await client.request("GET", "/v1/models", headers=bearer(token))
            assert r.status == 200, r.body
            # A token of a key not yet seen gets a clear 401, not a hang or a 500 ...
            iss.rotate("k2", keep_old=True)
            rotated = iss.token()
            mock_clock.jump(31)
            r = await client.request("GET", "/v1/models", headers=bearer(rotated))
            assert (r.status, code(r)) == (401, "token_unknown_kid")
            assert jwks.failures == 2
            # ... and is served once the issuer is back (after min_refresh_s).
            await iss.up()
            mock_clock.jump(31)
            r = await client.request("GET", "/v1/models", headers=bearer(rotated))
            assert r.status == 200, r.body
            assert (iss.jwks_fetches, jwks.fetches) == (3, 5)


async def test_a_jwks_file_needs_no_issuer_on_the_network(tmp_path: Any) -> None:
    iss = Issuer()
    iss.port = 9  # nothing listens there: the keys come from the file
    (tmp_path / "jwks.json").write_text(json.dumps(iss.jwks()))
    app = sso_app(iss, jwks_file=str(tmp_path / "jwks.json"))
    client = Client(app)
    r = await client.request("GET", "/v1/models", headers=bearer(iss.token()))
    assert r.status == 200, r.body
    r = await client.request(
        "GET", "/v1/models", headers=bearer(iss.token(key=SigningKey.new("k2")))
    )
    assert (r.status, code(r)) == (401, "token_unknown_kid")


async def test_the_console_signs_in_with_a_token_and_logs_it_out() -> None:
    async with running_issuer() as iss:
        app = sso_app(iss)
        admin = iss.token(sub="olga", groups=["gateway-admins"], lifetime_s=600)
        r = await call(app, "POST", "/admin/api/login", headers=bearer(admin))
        assert r.status == 200, r.body
        out = r.json()
        assert (out["token"], out["key_id"]) == (admin, "sso:olga")
        assert 590 <= out["expires_in"] <= 600
        # The console's API takes it (pasted, or set by a reverse proxy: the same header).
        r = await call(app, "GET", "/admin/api/overview", headers=bearer(admin))
        assert r.status == 200, r.body
        user = iss.token(sub="ulla")
        r = await call(app, "POST", "/admin/api/login", headers=bearer(user))
        assert r.status == 403, r.body
        r = await call(app, "POST", "/admin/api/logout", headers=bearer(admin))
        assert r.status == 200, r.body
        assert r.json()["until"] == json.loads(_payload(admin))["exp"]
        r = await call(app, "GET", "/admin/api/overview", headers=bearer(admin))
        assert (r.status, code(r)) == (401, "revoked_console_token")


def _payload(token: str) -> bytes:
    import base64

    body = token.split(".")[1]
    return base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))


async def test_a_reload_keeps_the_fetched_keys() -> None:
    async with running_issuer() as iss:
        app = sso_app(iss)
        client = Client(app)
        r = await client.request("GET", "/v1/models", headers=bearer(iss.token()))
        assert r.status == 200, r.body
        held = app.gate.oidc.issuers[iss.url]
        successor = app.gate.successor(app.config)
        assert successor.oidc.issuers[iss.url] is held
        assert len(held.keys) == 1
        # Another issuer's audience, same keys' source: the rules change, the keys stay.
        text = auth_toml(extra=oidc_toml(iss.url, audience=["other-app"]))
        changed = app.gate.successor(auth_app(text).config)
        # Staged, not yet committed (it may still be refused): the old rules hold.
        r = await client.request("GET", "/v1/models", headers=bearer(iss.token(sub="bo")))
        assert r.status == 200, r.body
        changed.activate()
        jwks = changed.oidc.issuers[iss.url]
        assert jwks is held
        assert jwks.rules.audiences == {"other-app"}
        assert iss.jwks_fetches == 1
        r = await client.request("GET", "/v1/models", headers=bearer(iss.token(sub="cy")))
        assert (r.status, code(r)) == (401, "token_wrong_audience")
