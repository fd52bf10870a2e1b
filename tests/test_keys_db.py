"""Virtual keys in the database (issue 47, items 1-3): the admin API's lifecycle (create,
list, show, update, rotate with a grace period, revoke), the secret shown once and only
its hash stored, two workers on one database, a database outage, and teams whose grant a
key may only narrow."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path

import pytest
import trio
import trio.testing

from aiserve_trio.config import ConfigError
from aiserve_trio.runtime.asgi import App
from aiserve_trio.security.auth import hash_key

from .asgi_client import Client, chat_body
from .authcfg import auth_config, auth_toml
from .keyscfg import KEY_ADMIN, KEY_KM, KEY_TADMIN, chat, create, h, keys_app, keys_toml
from .sim_gateway import running


def stored(tmp: Path) -> list[dict[str, object]]:
    conn = sqlite3.connect(tmp / "audit.db")
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute("SELECT * FROM aiserve_keys")]
    finally:
        conn.close()


async def test_a_created_key_works_at_once_and_its_secret_is_shown_once(tmp_path: Path) -> None:
    app = keys_app(tmp_path)
    async with running(app) as client:
        r = await create(client, label="billing app", routes=["/v1/chat/completions"])
        assert r.status == 201, r.body
        made = r.json()
        plain, key_id = made["key"], made["id"]
        assert plain.startswith(f"aik_{key_id}_")
        assert key_id.startswith("vk")
        assert (made["tenant"], made["label"], made["created_by"]) == (
            "bank-a",
            "billing app",
            "ops",
        )
        assert (await chat(client, plain)).status == 200
        # Never again: not in show, not in the list, only its hash in the database.
        shown = await client.request("GET", f"/admin/keys/{key_id}", headers=h(KEY_ADMIN))
        listed = await client.request("GET", "/admin/keys", headers=h(KEY_ADMIN))
        assert shown.status == listed.status == 200
        for body in (shown.body, listed.body):
            assert plain.encode() not in body
            assert b"sha256$" not in body
        assert [k["id"] for k in listed.json()["keys"]] == [key_id]
        (row,) = stored(tmp_path)
        assert row["hash"] == hash_key(plain)
        assert plain not in json.dumps(row)
        # A route the key was not given is refused.
        r = await client.request(
            "POST", "/v1/embeddings", json_body={"model": "aiserve-mock", "input": "x"},
            headers=h(plain),
        )  # fmt: skip
        assert r.status == 403


async def test_last_use_is_written_in_batches(tmp_path: Path) -> None:
    app = keys_app(tmp_path)
    async with running(app) as client:
        plain = (await create(client)).json()["key"]
        before = time.time()
        for _ in range(5):
            assert (await chat(client, plain)).status == 200
        (row,) = stored(tmp_path)
        assert row["last_used"] is None  # no write per request
        assert app.gateway.keys is not None
        await app.gateway.keys.flush(force=True)
        (row,) = stored(tmp_path)
        assert isinstance(row["last_used"], float)
        assert row["last_used"] >= before


async def test_rotation_keeps_the_old_secret_for_the_grace_period(tmp_path: Path) -> None:
    app = keys_app(tmp_path)
    async with running(app) as client:
        made = (await create(client)).json()
        old, key_id = made["key"], made["id"]
        path = f"/admin/keys/{key_id}/rotate"
        r = await client.request("POST", path, json_body={"grace_s": 3600}, headers=h(KEY_ADMIN))
        assert r.status == 200, r.body
        new = r.json()["key"]
        assert new != old
        assert r.json()["old_secret_valid_until"] > time.time() + 3500
        assert (await chat(client, old)).status == 200
        assert (await chat(client, new)).status == 200
        # Rotated again without grace: the previous secret is refused at once.
        r = await client.request("POST", path, json_body={"grace_s": 0}, headers=h(KEY_ADMIN))
        newest = r.json()["key"]
        assert (await chat(client, new)).status == 401
        assert (await chat(client, old)).status == 401
        assert (await chat(client, newest)).status == 200
        bad = await client.request("POST", path, json_body={"grace_s": -1}, headers=h(KEY_ADMIN))
        assert bad.status == 422


async def test_update_expiry_and_revocation(tmp_path: Path) -> None:
    app = keys_app(tmp_path)
    async with running(app) as client:
        made = (await create(client, rpm=5)).json()
        plain, key_id = made["key"], made["id"]
        path = f"/admin/keys/{key_id}"
        r = await client.request(
            "PATCH", path, json_body={"label": "renamed", "rpm": 3}, headers=h(KEY_ADMIN)
        )
        assert (r.status, r.json()["label"], r.json()["rpm"]) == (200, "renamed", 3)
        r = await client.request(
            "PATCH", path, json_body={"expires_at": time.time() - 1}, headers=h(KEY_ADMIN)
        )
        assert r.status == 200
        r = await chat(client, plain)
        assert (r.status, r.json()["error"]["code"]) == (401, "expired_api_key")
        r = await client.request(
            "PATCH", path, json_body={"expires_at": None}, headers=h(KEY_ADMIN)
        )
        assert (await chat(client, plain)).status == 200
        r = await client.request("POST", path + "/revoke", headers=h(KEY_ADMIN))
        assert r.status == 200
        assert r.json()["revoked_at"] is not None
        assert (await chat(client, plain)).status == 401
        assert (await client.request("GET", "/admin/keys", headers=h(KEY_ADMIN))).json()[
            "keys"
        ] == []
        r = await create(client, expires_at=time.time() - 5)
        assert r.status == 422
        r = await client.request("PATCH", path, json_body={"rpm": "many"}, headers=h(KEY_ADMIN))
        assert r.status == 422


async def test_two_workers_see_a_key_and_its_revocation_within_the_bound(
    tmp_path: Path,
) -> None:
    one, two = keys_app(tmp_path), keys_app(tmp_path)  # two workers, one database
    async with running(one) as a, running(two) as b:
        made = (await create(a)).json()
        plain = made["key"]
        assert (await chat(a, plain)).status == 200  # the worker that made it: at once
        assert two.gateway.keys is not None
        bound = two.gateway.keys.poll_s + 0.5
        start = time.monotonic()
        while (await chat(b, plain)).status != 200:
            assert time.monotonic() - start < bound, "the other worker never saw the key"
            await trio.sleep(0.05)
        r = await b.request("POST", f"/admin/keys/{made['id']}/revoke", headers=h(KEY_ADMIN))
        assert r.status == 200
        assert (await chat(b, plain)).status == 401
        start = time.monotonic()
        while (await chat(a, plain)).status != 401:
            assert time.monotonic() - start < bound, "the other worker still takes the key"
            await trio.sleep(0.05)


async def test_a_database_outage_keeps_keys_working_and_refuses_changes(tmp_path: Path) -> None:
    db_dir = tmp_path / "db"
    db_dir.mkdir()
    app = keys_app(db_dir)
    async with running(app) as client:
        plain = (await create(client)).json()["key"]
        away = tmp_path / "away"
        os.rename(db_dir, away)  # the database is gone
        try:
            keys = app.gateway.keys
            assert keys is not None
            with trio.fail_after(keys.poll_s + 2):
                while keys.db_up:  # noqa: ASYNC110 (a poll of the database's state)
                    await trio.sleep(0.05)
            assert (await chat(client, plain)).status == 200  # the last table serves
            r = await create(client)
            assert (r.status, r.json()["error"]["code"]) == (503, "keys_db_unavailable")
            assert "unreachable" in r.json()["error"]["message"]
            health = (await client.request("GET", "/healthz")).json()
            assert health["status"] == "ok"
            assert health["keys"]["database"] == "unreachable"
            metrics = (await client.request("GET", "/metrics", headers=h(KEY_ADMIN))).body.decode()
            assert "aiserve_keys_db_up 0.0" in metrics
        finally:
            os.rename(away, db_dir)
        with trio.fail_after(keys.poll_s + 2):
            while not keys.db_up:  # noqa: ASYNC110
                await trio.sleep(0.05)
        assert (await create(client)).status == 201
        assert (await chat(client, plain)).status == 200
        assert (await client.request("GET", "/healthz")).json()["keys"]["database"] == "ok"
    assert len(stored(db_dir)) == 2  # nothing lost


def test_a_config_key_cannot_take_a_database_keys_id() -> None:
    bad = f'\n[[auth.keys]]\nid = "vkabcdefgh012345"\nhash = "{hash_key("aik_vkabcdefgh012345_" + "x" * 32)}"\ntenant = "t"\n'
    with pytest.raises(ConfigError, match="database key"):
        auth_config(auth_toml() + bad)


async def test_a_key_only_narrows_its_teams_grant(tmp_path: Path) -> None:
    app = keys_app(tmp_path)
    async with running(app) as client:

        async def put(path: str, **grant: object) -> int:
            r = await client.request("PUT", path, json_body=grant, headers=h(KEY_ADMIN))
            return r.status

        assert await put("/admin/tenants/bank-a", models=["m1", "m2", "m3"], rpm=100) == 200
        # A team may not widen its tenant's grant either.
        assert await put("/admin/teams/payments", models=["m1", "m9"]) == 422
        assert (
            await put("/admin/teams/payments", models=["m1", "m2"], rpm=50, channels=["app"]) == 200
        )
        for widening in ({"models": ["m1", "m3"]}, {"rpm": 60}, {"channels": ["app", "web"]}):
            r = await create(client, team="payments", **widening)
            assert (r.status, r.json()["error"]["code"]) == (422, "grant_widened"), widening
        r = await create(client, team="payments", models=["m1"], rpm=20)
        assert r.status == 201
        made = await create(client, team="payments")  # inherits: models m1, m2 and rpm 50
        assert made.status == 201
        keys = app.gateway.keys
        assert keys is not None
        entry = keys.table.get(made.json()["id"])
        assert entry is not None
        assert entry.principal.rpm == 50
        assert entry.principal.channels == {"app"}
        # Raising the key past the team afterwards is refused as well.
        r = await client.request(
            "PATCH", f"/admin/keys/{made.json()['id']}", json_body={"models": ["m3"]},
            headers=h(KEY_ADMIN),
        )  # fmt: skip
        assert (r.status, r.json()["error"]["code"]) == (422, "grant_widened")
        # Lowering the team's rate reaches the keys that inherit it.
        assert (
            await put("/admin/teams/payments", models=["m1", "m2"], rpm=10, channels=["app"]) == 200
        )
        entry = keys.table.get(made.json()["id"])
        assert entry is not None
        assert entry.principal.rpm == 10


async def test_a_key_manager_manages_its_teams_keys_only(tmp_path: Path) -> None:
    app = keys_app(tmp_path)
    async with running(app) as client:
        other = (await create(client, team="lending")).json()["id"]
        r = await create(client, by=KEY_KM)
        assert (r.status, r.json()["team"]) == (201, "payments")
        mine = r.json()["id"]
        r = await create(client, by=KEY_KM, team="lending")
        assert (r.status, r.json()["error"]["code"]) == (403, "team_scope")
        r = await create(client, by=KEY_KM, roles=["admin"])
        assert (r.status, r.json()["error"]["code"]) == (403, "role_not_allowed")
        listed = await client.request("GET", "/admin/keys", headers=h(KEY_KM))
        assert [k["id"] for k in listed.json()["keys"]] == [mine]
        for path in (f"/admin/keys/{other}", f"/admin/keys/{other}/revoke"):
            method = "GET" if path.endswith(other) else "POST"
            r = await client.request(method, path, headers=h(KEY_KM))
            assert r.status == 404
        r = await client.request("POST", f"/admin/keys/{mine}/revoke", headers=h(KEY_KM))
        assert r.status == 200


async def test_an_admin_of_one_tenant_makes_keys_of_its_tenant_only(tmp_path: Path) -> None:
    app = keys_app(tmp_path)
    async with running(app) as client:
        r = await create(client, by=KEY_TADMIN, tenant="bank-b")
        assert (r.status, r.json()["error"]["code"]) == (403, "tenant_scope")
        theirs = (await create(client, tenant="bank-b")).json()["id"]  # the global admin
        r = await client.request("GET", f"/admin/keys/{theirs}", headers=h(KEY_TADMIN))
        assert r.status == 404
        r = await create(client, by=KEY_TADMIN)
        assert (r.status, r.json()["tenant"]) == (201, "bank-a")


async def test_bad_requests_get_clear_errors(tmp_path: Path) -> None:
    app = keys_app(tmp_path)
    async with running(app) as client:
        for body, status in (
            (b"{", 400),
            (b'{"nope": 1}', 422),
            (b'{"roles": ["root"]}', 422),
            (b'{"team": "Bad Team"}', 422),
            (b"", 400),
        ):
            r = await client.request(
                "POST", "/admin/keys", body=body,
                headers={**h(KEY_ADMIN), "content-type": "application/json"},
            )  # fmt: skip
            assert r.status == status, (body, r.body)
            assert "error" in r.json()
        r = await client.request("GET", "/admin/keys/aik_x", headers=h(KEY_ADMIN))
        assert r.status == 404
        r = await client.request("GET", "/admin/keys?limit=0", headers=h(KEY_ADMIN))
        assert r.status == 400


async def test_without_an_audit_database_there_is_no_keys_api() -> None:
    client = Client(auth_config_app())
    r = await client.request("GET", "/admin/keys", headers=h(KEY_ADMIN))
    assert r.status == 404


def auth_config_app() -> object:
    from aiserve_trio.runtime.asgi import App

    return App(auth_config(auth_toml()))


async def test_a_keys_model_allow_list_is_enforced_and_inherited(tmp_path: Path) -> None:
    app = keys_app(tmp_path)
    async with running(app) as client:
        other = (await create(client, models=["some-other-model"])).json()["key"]
        r = await chat(client, other)
        assert (r.status, r.json()["error"]["code"]) == (403, "model_not_allowed")
        mock = (await create(client, models=["aiserve-mock"])).json()["key"]
        assert (await chat(client, mock)).status == 200
        r = await client.request(
            "PUT", "/admin/teams/lending", json_body={"models": ["some-other-model"]},
            headers=h(KEY_ADMIN),
        )  # fmt: skip
        assert r.status == 200
        inherits = (await create(client, team="lending")).json()["key"]
        r = await chat(client, inherits)
        assert (r.status, r.json()["error"]["code"]) == (403, "model_not_allowed")
        r = await client.request(
            "POST", "/v1/messages", headers=h(inherits),
            json_body={"model": "aiserve-mock", "max_tokens": 8,
                       "messages": [{"role": "user", "content": "hi"}]},
        )  # fmt: skip
        assert r.status == 403
        r = await client.request(
            "POST", "/v1/embeddings", headers=h(inherits),
            json_body={"model": "aiserve-mock", "input": "hi"},
        )  # fmt: skip
        assert (r.status, r.json()["error"]["code"]) == (403, "model_not_allowed")
        r = await client.request(
            "POST", "/v1/embeddings", headers=h(mock),
            json_body={"model": "aiserve-mock", "input": "hi"},
        )  # fmt: skip
        assert r.status == 200


async def test_a_database_keys_budget_is_enforced(tmp_path: Path) -> None:
    from .spendcfg import PRICES

    app = keys_app(tmp_path, PRICES)
    async with running(app) as client:
        made = (await create(client, budget=0.00001, budget_period="day")).json()
        assert (await chat(client, made["key"])).status == 200  # it spends the budget
        r = await chat(client, made["key"])
        assert r.status == 429
        assert r.json()["error"]["param"] == f"key:{made['id']}"
        # A key of a team whose record caps its keys inherits that cap.
        r = await client.request(
            "PUT", "/admin/teams/tiny", json_body={"budget": 0.00001, "budget_period": "day"},
            headers=h(KEY_ADMIN),
        )  # fmt: skip
        assert r.status == 200
        capped = (await create(client, team="tiny")).json()["key"]
        assert (await chat(client, capped)).status == 200
        assert (await chat(client, capped)).status == 429
        free = (await create(client)).json()["key"]
        assert [(await chat(client, free)).status for _ in range(3)] == [200] * 3


async def test_a_database_keys_max_streams_is_enforced(tmp_path: Path) -> None:
    # The mock's first token after a second: a stream stays open while others are asked.
    app = App(auth_config(keys_toml(tmp_path), ttft_ms="1000"))
    async with running(app) as client:
        one = (await create(client, max_streams=1)).json()["key"]
        other = (await create(client)).json()["key"]
        body = chat_body(stream=True)
        async with client.open(
            "POST", "/v1/chat/completions", json_body=body, headers=h(one)
        ) as first:
            await trio.testing.wait_all_tasks_blocked()
            second = await client.chat(body, h(one))
            assert second.status == 429
            assert second.json()["error"]["code"] == "key_stream_limit"
            assert second.headers["retry-after"]
            assert (await client.chat(body, h(other))).status == 200  # its own cap only
        assert first.response.status == 200
        assert (await client.chat(body, h(one))).status == 200  # the slot given back
        assert app.gate.admission.by_key == {}
