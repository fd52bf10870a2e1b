"""The admin audit trail (issue 47, item 5): every admin action -- a key created, updated,
rotated, revoked; a team's or tenant's grant (its budget) changed; the config reloaded; a
chain's steps edited -- writes one row (who, when, from where, what changed; never a
secret) in the audit database, read at ``/admin/audit`` with filters."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from .asgi_client import Client
from .authcfg import OFF, auth_toml
from .conftest import config_text
from .keyscfg import KEY_ADMIN, KEY_TADMIN, KEY_VIEW, ROLE_KEYS, create, h
from .test_console_reload import CHAIN, put, routes
from .test_reload import running


@pytest.fixture
def path(tmp_path: Path) -> Path:
    p = tmp_path / "gateway.toml"
    audit = f'\n[audit]\npath = "{tmp_path / "audit.db"}"\nflush_ms = 50\n'
    text = config_text(reload_watch_s="0").replace(OFF, auth_toml() + ROLE_KEYS + audit)
    p.write_text(text + CHAIN)
    return p


def trail(db: Path) -> list[dict[str, Any]]:
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute("SELECT * FROM aiserve_admin_audit ORDER BY ts")]
    finally:
        conn.close()


async def test_each_admin_action_writes_one_row_without_secrets(path: Path) -> None:
    db = path.parent / "audit.db"
    async with running(path) as app:
        client = Client(app)
        made = (await create(client, label="app", team="payments")).json()
        key_id, secrets = made["id"], [made["key"]]
        base = f"/admin/keys/{key_id}"
        steps: list[tuple[str, Any]] = [
            ("key.updated", client.request(
                "PATCH", base, json_body={"rpm": 7}, headers=h(KEY_ADMIN))),
            ("key.rotated", client.request(
                "POST", base + "/rotate", json_body={"grace_s": 60}, headers=h(KEY_ADMIN))),
            ("key.revoked", client.request("POST", base + "/revoke", headers=h(KEY_ADMIN))),
            ("tenant.changed", client.request(
                "PUT", "/admin/tenants/bank-a", json_body={"budget": 500.0},
                headers=h(KEY_ADMIN))),
            ("team.changed", client.request(
                "PUT", "/admin/teams/payments", json_body={"budget": 50.0, "budget_period": "day"},
                headers=h(KEY_ADMIN))),
            ("config.reloaded", client.request(
                "POST", "/admin/config/reload", headers=h(KEY_ADMIN))),
        ]  # fmt: skip
        assert [r["action"] for r in trail(db)] == ["key.created"]
        for action, call in steps:
            r = await call
            assert r.status == 200, (action, r.body)
            if action == "key.rotated":
                secrets.append(r.json()["key"])
            rows = trail(db)
            assert rows[-1]["action"] == action, rows
        listed = await routes(app)
        r = await put(app, listed["version"], ("intent", True), ("topic", True), ("answer", True))
        assert r.status == 200, r.body
        rows = trail(db)
        assert [r["action"] for r in rows] == [
            "key.created", "key.updated", "key.rotated", "key.revoked", "tenant.changed",
            "team.changed", "config.reloaded", "chain.edited",
        ]  # fmt: skip
        for row in rows:
            assert row["actor"] == "ops"
            assert row["tenant"] == "bank-a"
            assert row["client"] == "127.0.0.1"
            assert time.time() - 60 < row["ts"] <= time.time()
        assert json.loads(rows[1]["detail"]) == {"rpm": {"from": 0, "to": 7}}
        assert json.loads(rows[5]["detail"])["budget"] == 50.0
        assert json.loads(rows[7]["detail"])["steps"][0] == {"name": "intent", "enabled": True}
        assert rows[7]["target"] == "/v1/bank"
        # Never a secret: neither plain key nor any hash.
        everything = json.dumps(rows)
        for secret in secrets:
            assert secret not in everything
            assert secret.split("_")[-1] not in everything
        assert "sha256$" not in everything


async def test_the_trail_is_read_with_filters_and_by_tenant(path: Path) -> None:
    async with running(path) as app:
        client = Client(app)
        one = (await create(client)).json()["id"]
        await create(client, tenant="bank-b")
        await client.request("POST", f"/admin/keys/{one}/revoke", headers=h(KEY_ADMIN))

        async def read(query: str, key: str = KEY_ADMIN) -> list[dict[str, Any]]:
            r = await client.request("GET", "/admin/audit" + query, headers=h(key))
            assert r.status == 200, r.body
            rows: list[dict[str, Any]] = r.json()["rows"]
            return rows

        assert [r["action"] for r in await read("")] == [
            "key.revoked",
            "key.created",
            "key.created",
        ]  # newest first
        assert [r["target"] for r in await read("?action=key.revoked")] == [one]
        assert [r["tenant"] for r in await read("?action=key.created")] == ["bank-b", "bank-a"]
        assert await read(f"?since={time.time() + 10}") == []
        assert len(await read("?limit=1")) == 1
        assert await read("?actor=nobody") == []
        # An admin of bank-a, and a viewer of it, read bank-a's rows only.
        for key in (KEY_TADMIN, KEY_VIEW):
            assert {r["tenant"] for r in await read("", key)} == {"bank-a"}
        r = await client.request("GET", "/admin/audit?since=soon", headers=h(KEY_ADMIN))
        assert (r.status, r.json()["error"]["param"]) == (400, "since")


async def test_a_config_reload_while_the_database_is_away_is_written_when_it_is_back(
    path: Path,
) -> None:
    db = path.parent / "audit.db"
    async with running(path) as app:
        client = Client(app)
        await create(client)
        keys = app.gateway.keys
        assert keys is not None
        away = path.parent / "away.db"
        # A database that cannot be opened: the key service's connections fail.
        keys.connector.path = away.parent / "missing" / "audit.db"  # type: ignore[attr-defined]
        r = await client.request("POST", "/admin/config/reload", headers=h(KEY_ADMIN))
        assert r.status == 200
        assert [r["action"] for r in trail(db)] == ["key.created"]
        keys.connector.path = db  # type: ignore[attr-defined]
        await keys.flush()
        assert [r["action"] for r in trail(db)] == ["key.created", "config.reloaded"]
