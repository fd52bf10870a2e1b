"""An admin key sees its own tenant; a ``global_admin`` key sees every tenant (issue 51,
item 5): ``/admin/usage`` and the console's cache and spend views are scoped to the admin key's
tenant, and the config (``/admin/config``, its reload, the console's steps), ``/debug/``
and ``/metrics`` are a global admin's only."""

from __future__ import annotations

from pathlib import Path

import trio
import trio.testing

from aiserve_trio.config import parse_config
from aiserve_trio.runtime.asgi import App
from aiserve_trio.security.auth import hash_key

from .asgi_client import Client, chat_body
from .authcfg import KEY_A, KEY_ADMIN, KEY_B, OFF, auth_toml, bearer
from .cachefakes import ask, cache_config_text, opened
from .spendcfg import KEY_CAROL, KEY_OPS, auth, running, spend_config
from .test_cache_semantic import SEMANTIC, VEC, Q
from .test_console_api import call

KEY_EVE = "aik_eve_" + "7" * 32  # admin of tenant shop only
KEY_FRANK = "aik_frank_" + "8" * 32  # tenant other
KEY_BEA = "aik_bea_" + "9" * 32  # admin of tenant bank-b only (the cache view's test)

_MORE_KEYS = f"""
[[auth.keys]]
id = "eve"
hash = "{hash_key(KEY_EVE)}"
tenant = "shop"
admin = true

[[auth.keys]]
id = "frank"
hash = "{hash_key(KEY_FRANK)}"
tenant = "other"
"""


async def test_an_admin_of_one_tenant_reads_that_tenants_usage_only(tmp_path: Path) -> None:
    app = App(spend_config(tmp_path, carol_budget="100.0", tenant=_MORE_KEYS))
    async with running(app) as client:
        for key in (KEY_CAROL, KEY_CAROL, KEY_FRANK):
            assert (await client.chat(chat_body("echo: hi"), headers=auth(key))).status == 200
        assert app.audit is not None
        await app.audit.settle()
        path = "/admin/usage?group_by=tenant"
        everyone = await client.request("GET", path, headers=auth(KEY_OPS))
        assert {g["group"]: g["requests"] for g in everyone.json()["groups"]} == {
            "shop": 2,
            "other": 1,
        }
        own = await client.request("GET", path, headers=auth(KEY_EVE))
        assert own.status == 200
        assert {g["group"]: g["requests"] for g in own.json()["groups"]} == {"shop": 2}
        by_key = await client.request("GET", "/admin/usage?group_by=key", headers=auth(KEY_EVE))
        assert "frank" not in {g["group"] for g in by_key.json()["groups"]}
        assert by_key.json()["total"]["requests"] == 2


async def test_the_consoles_spend_view_shows_an_admin_its_own_tenant(tmp_path: Path) -> None:
    frank_budget = _MORE_KEYS + "budget = 5.0\nbudget_period = \"day\"\n"
    app = App(spend_config(tmp_path, carol_budget="100.0", tenant=frank_budget))
    async with running(app) as client:
        for key in (KEY_CAROL, KEY_FRANK):
            assert (await client.chat(chat_body("echo: hi"), headers=auth(key))).status == 200
        assert app.audit is not None
        await app.audit.settle()

        async def spend(key: str) -> dict[str, set[str]]:
            r = await client.request("GET", "/admin/api/spend", headers=auth(key))
            assert r.status == 200, r.body
            out = r.json()
            return {
                "tenants": {g["group"] for g in out["tenants"]},
                "keys": {g["group"] for g in out["keys"]},
                "budgets": {b["name"] for b in out["budgets"]},
            }

        assert await spend(KEY_OPS) == {
            "tenants": {"shop", "other"},
            "keys": {"carol", "frank"},
            "budgets": {"carol", "frank"},
        }
        assert await spend(KEY_EVE) == {"tenants": {"shop"}, "keys": {"carol"}, "budgets": {"carol"}}


async def test_the_config_and_debug_endpoints_are_a_global_admins(tmp_path: Path) -> None:
    app = App(spend_config(tmp_path, tenant=_MORE_KEYS))
    async with running(app) as client:
        for method, path in (
            ("GET", "/admin/config"),
            ("POST", "/admin/config/reload"),
            ("GET", "/debug/profile?seconds=0.01"),
            ("GET", "/metrics"),  # every tenant's key ids and spend
        ):
            r = await client.request(method, path, headers=auth(KEY_EVE))
            assert r.status == 403, (path, r.body)
            assert r.json()["error"]["code"] == "global_admin_only"
        for path in ("/admin/config", "/metrics"):
            assert (await client.request("GET", path, headers=auth(KEY_OPS))).status == 200
        steps = await client.request(
            "PUT",
            "/admin/api/routes/steps",
            headers={**auth(KEY_EVE), "content-type": "application/json"},
            body=b'{"path": "/v1/chat/completions", "version": "x", "steps": []}',
        )
        assert steps.status == 403
        assert steps.json()["error"]["code"] == "global_admin_only"


async def test_the_cache_view_shows_an_admin_its_own_tenants_questions(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    bea = f'\n[[auth.keys]]\nid = "bea"\nhash = "{hash_key(KEY_BEA)}"\ntenant = "bank-b"\nadmin = true\n'
    text = cache_config_text(SEMANTIC, VEC.format(ttft=0)).replace(OFF, auth_toml() + bea)
    app = App(parse_config(text, source="<t>"))
    await opened(app, nursery)
    client = Client(app)
    for key, again in ((KEY_A, Q.upper()), (KEY_B, Q.lower() + "?")):
        await client.chat(ask(Q), headers=bearer(key))
        r = await client.chat(ask(again), headers=bearer(key))
        assert r.headers["x-aiserve-cache"] == "semantic-hit"

    async def asked(key: str) -> set[str]:
        r = await call(app, "GET", "/admin/api/cache", headers=bearer(key))
        assert r.status == 200, r.body
        return {h["asked"] for h in r.json()["recent"]}

    assert await asked(KEY_ADMIN) == {Q.upper(), Q.lower() + "?"}  # global_admin
    assert await asked(KEY_BEA) == {Q.lower() + "?"}
