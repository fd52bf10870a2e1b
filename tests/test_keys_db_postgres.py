"""The database keys on a real PostgreSQL (tests/pg_server.py): two workers on one
database see a key created on either and its revocation within the bound, and both
migrate the key tables at once without a clash (issue 47, items 1-2)."""

from __future__ import annotations

import secrets
import time

import psycopg
import pytest
import trio

from aiserve_trio.runtime.asgi import App

from .authcfg import auth_config, auth_toml
from .keyscfg import KEY_ADMIN, ROLE_KEYS, chat, create, h
from .pg_server import PostgresServer, postgres_server, postgres_up  # noqa: F401
from .sim_gateway import running

pytestmark = pytest.mark.slow

AUDIT = '\n[audit]\nbackend = "postgres"\ndsn_env = "AISERVE_TEST_KEYS_DSN"\nflush_ms = 50\n'


@pytest.fixture
def database(postgres_up: PostgresServer) -> str:  # noqa: F811
    name = f"keys_{secrets.token_hex(4)}"
    with psycopg.connect(postgres_up.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return postgres_up.dsn.rsplit("/", 1)[0] + "/" + name


def app() -> App:
    return App(auth_config(auth_toml(metrics="admin") + ROLE_KEYS + AUDIT))


async def test_two_workers_on_postgresql(database: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AISERVE_TEST_KEYS_DSN", database)
    one, two = app(), app()
    async with running(one) as a, running(two) as b:
        made = (await create(b, label="pg")).json()
        plain = made["key"]
        assert (await chat(b, plain)).status == 200
        assert one.gateway.keys is not None
        bound = one.gateway.keys.poll_s + 1.0
        start = time.monotonic()
        while (await chat(a, plain)).status != 200:
            assert time.monotonic() - start < bound, "the other worker never saw the key"
            await trio.sleep(0.05)
        r = await a.request("POST", f"/admin/keys/{made['id']}/revoke", headers=h(KEY_ADMIN))
        assert r.status == 200
        start = time.monotonic()
        while (await chat(b, plain)).status != 401:
            assert time.monotonic() - start < bound, "the other worker still takes the key"
            await trio.sleep(0.05)
        rows = (await b.request("GET", "/admin/audit", headers=h(KEY_ADMIN))).json()["rows"]
        assert [r["action"] for r in rows] == ["key.revoked", "key.created"]
    with psycopg.connect(database) as conn:
        (hashed,) = conn.execute("SELECT hash FROM aiserve_keys").fetchone() or ("",)
        assert hashed.startswith("sha256$")
        assert plain not in hashed
