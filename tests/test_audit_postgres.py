"""The audit log on a real PostgreSQL (started by the tests: tests/pg_server.py): rows from
two gateway processes into one database, and a database killed mid-run -- requests keep
being served, their rows wait (counted as pending) and are written when it is back."""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psycopg
import pytest

from aiserve_trio.audit.postgres import PostgresDatabase
from aiserve_trio.audit.row import RowBuilder
from aiserve_trio.audit.schema import COLUMNS, VERSION
from aiserve_trio.runtime.asgi import App
from aiserve_trio.stages.outcome import Outcome

from .asgi_client import chat_body
from .authcfg import OFF
from .conftest import config_text
from .pg_server import PostgresServer, postgres_server, postgres_up  # noqa: F401
from .redis_server import RedisServer
from .servers import hypercorn_gateway
from .spendcfg import KEY_CAROL, KEY_DAN, KEY_OPS, PRICES, auth, running, spend_config, spend_toml

pytestmark = pytest.mark.slow

#: Bounded waits for what a writer task in another process does (rows, counters).
WAIT_S = 20.0


@pytest.fixture
def database(postgres_up: PostgresServer) -> str:  # noqa: F811
    """A fresh database on the test server; its DSN."""
    name = f"audit_{secrets.token_hex(4)}"
    with psycopg.connect(postgres_up.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return postgres_up.dsn.rsplit("/", 1)[0] + "/" + name


def gateway_config(tmp_path: Path) -> Path:
    path = tmp_path / "audit-pg.toml"
    audit = '[audit]\nbackend = "postgres"\ndsn_env = "AISERVE_TEST_AUDIT_DSN"\nbuffer = 64\n'
    path.write_text(config_text() + PRICES + audit)
    return path


def count(dsn: str, where: str = "1=1") -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(f"SELECT count(*) FROM audit_requests WHERE {where}").fetchone()
    return int(row[0]) if row else 0


def eventually(check: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {WAIT_S} s: {what}")


def chat(base: str, text: str, key: str | None = None) -> httpx.Response:
    body = {"model": "aiserve-mock", "messages": [{"role": "user", "content": f"echo: {text}"}]}
    headers = auth(key) if key is not None else {}
    return httpx.post(base + "/v1/chat/completions", json=body, headers=headers, timeout=10)


def dropped(base: str) -> float:
    text = httpx.get(base + "/metrics", timeout=5).text
    m = re.search(r'^aiserve_audit_dropped_total\{reason="db_error"\} (\S+)$', text, re.M)
    return float(m[1]) if m else 0.0


def budget_used(base: str) -> float:
    """The largest share of a budget the gateway has seen spent (0: none charged yet)."""
    text = httpx.get(base + "/metrics", headers=auth(KEY_OPS), timeout=5).text
    return max(
        (float(v) for v in re.findall(r"^aiserve_budget_used_ratio\{.*\} (\S+)$", text, re.M)),
        default=0.0,
    )


def pending(base: str) -> float:
    text = httpx.get(base + "/metrics", timeout=5).text
    m = re.search(r"^aiserve_audit_rows_pending (\S+)$", text, re.M)
    return float(m[1]) if m else 0.0


def test_the_schema_is_migrated_once_and_rows_go_in(database: str):
    db = PostgresDatabase(database)
    assert db.open() == VERSION
    second = PostgresDatabase(database)
    assert second.open() == VERSION  # a second gateway: nothing left to apply
    second.close()
    row = dict.fromkeys(
        [
            "trace_id",
            "key_id",
            "session_hash",
            "deployment",
            "fallback",
            "error_code",
            "ttft_ms",
            "cache",
            "steps",
            "policy_actions",
            "prompt",
            "reply",
            "prompt_chars",
            "reply_chars",
            "client",
        ]
    )
    row.update(
        request_id="r1",
        ts=time.time(),
        tenant="t",
        route="chat",
        api="chat",
        channel="api",
        model="m",
        served_model="m",
        status="ok",
        prompt_tokens=3,
        completion_tokens=4,
        cost=0.5,
        saved=0.0,
        total_ms=12.5,
        requests=1,
        cache_read_tokens=2,
        cache_write_tokens=1,
        cache_cost=0.25,
        usage_source="counted",
    )
    db.insert([tuple(row[c] for c in COLUMNS)])
    db.close()
    assert count(database, "request_id = 'r1' AND cost = 0.5") == 1
    assert count(database, "request_id = 'r1' AND cache_read_tokens = 2 AND cache_cost = 0.25") == 1
    assert count(database, "request_id = 'r1' AND usage_source = 'counted'") == 1


async def test_a_100_kb_prompt_is_stored_cut_to_the_cap_in_postgres(
    database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # Issue 55 (disk bounded): the same cap as SQLite's, on the real server.
    monkeypatch.setenv("AISERVE_TEST_AUDIT_DSN", database)
    extra = 'backend = "postgres"\ndsn_env = "AISERVE_TEST_AUDIT_DSN"\ncontent = "redacted"\n'
    app = App(spend_config(tmp_path, audit_extra=extra))
    big = "lorem ipsum " * 8_500  # 102,000 characters
    async with running(app) as client:
        r = await client.chat(chat_body(big), headers=auth(KEY_DAN))
        assert r.status == 200
    with psycopg.connect(database) as conn:
        got = conn.execute(
            "SELECT prompt, prompt_chars, reply_chars, requests FROM audit_requests "
            "WHERE request_id = %s", (r.headers["x-request-id"],)
        ).fetchone()  # fmt: skip
    assert got == (big[:8192], len(big), None, 1)


def test_a_database_past_its_bound_is_trimmed_oldest_first_in_postgres(database: str):
    # Issue 55 (disk bounded): what the writer calls past [audit] max_rows, on the server.
    db = PostgresDatabase(database)
    db.open()
    builder = RowBuilder(b"k")
    now = time.time()
    db.insert([
        builder.row(Outcome(request_id=f"r{i}", route="chat", channel="api", arrival=0.0,
                            ended=0.1, status="ok", tenant="t", model="m"), now - 1000 + i)
        for i in range(50)
    ])  # fmt: skip
    rows, size = db.measure()
    assert rows == 50
    assert size > 0
    assert db.trim(20) == 30
    assert db.trim(20) == 0  # already within
    assert db.measure()[0] == 20
    db.close()
    with psycopg.connect(database) as conn:
        ids = [r[0] for r in conn.execute("SELECT request_id FROM audit_requests ORDER BY ts")]
    assert ids == [f"r{i}" for i in range(30, 50)]  # the newest kept


def test_a_batch_tried_again_after_a_broken_connection_is_not_written_twice(database: str):
    # A COMMIT that reached the server just before the connection broke: the writer sees a
    # failure and tries the batch again, with rows the table already holds.
    builder = RowBuilder(b"k")
    rows = [
        builder.row(Outcome(request_id=f"r{i}", route="chat", channel="api", arrival=0.0,
                            ended=0.1, status="ok", tenant="t", model="m"), time.time() + i)
        for i in range(5)
    ]  # fmt: skip
    db = PostgresDatabase(database)
    db.open()
    db.insert(rows[:3])
    assert db._conn is not None
    with psycopg.connect(database, autocommit=True) as admin:  # as a restart would
        admin.execute("SELECT pg_terminate_backend(%s)", (db._conn.info.backend_pid,))
    with pytest.raises(psycopg.OperationalError):
        db.insert(rows)
    db.insert(rows)
    db.close()
    assert count(database) == 5  # r0-r2 once, r3 and r4 written
    assert count(database, "request_id = 'r0'") == 1


def test_rows_from_two_gateway_processes_go_into_one_database(database: str, tmp_path: Path):
    cfg = gateway_config(tmp_path)
    env = {"AISERVE_TEST_AUDIT_DSN": database}
    ids: list[str] = []
    with hypercorn_gateway(cfg, env=env) as (one, _), hypercorn_gateway(cfg, env=env) as (two, _):
        for i in range(4):
            for base in (one, two):
                r = chat(base, f"request {i}")
                assert r.status_code == 200
                assert float(r.headers["x-aiserve-cost"]) > 0
                ids.append(r.headers["x-request-id"])
        eventually(lambda: count(database) == 8, "8 rows from two gateways")
        # Either gateway reads every gateway's rows back (auth off: loopback only).
        usage = httpx.get(f"{one}/admin/usage?group_by=day", timeout=10).json()
        assert usage["total"]["requests"] == 8
        assert usage["groups"][0]["group"] == time.strftime("%Y-%m-%d", time.gmtime())
    quoted = ", ".join(f"'{i}'" for i in ids)
    assert count(database, f"request_id IN ({quoted}) AND cost > 0") == 8


def test_a_tiny_budget_shared_by_two_gateways_with_every_request_in_postgres(
    database: str, tmp_path: Path, redis_up: RedisServer
):
    """The issue's "done": two gateways, one Redis (the budget), one PostgreSQL (the log)."""
    audit = '[audit]\nbackend = "postgres"\ndsn_env = "AISERVE_TEST_AUDIT_DSN"\n'
    path = tmp_path / "budget-pg.toml"
    text = config_text().replace(OFF, spend_toml(audit=audit))
    sessions = f'[sessions]\nbackend = "redis"\nurl = "{redis_up.url}"\nkey_prefix = "pg2gw"\n'
    path.write_text(text.replace('[sessions]\nbackend = "memory"\n', sessions, 1))
    env = {"AISERVE_TEST_AUDIT_DSN": database}
    with hypercorn_gateway(path, env=env) as (one, _), hypercorn_gateway(path, env=env) as (two, _):
        first = chat(one, "spend it", KEY_CAROL)
        assert first.status_code == 200
        assert float(first.headers["x-aiserve-cost"]) > 0
        # The cost is charged once the answer is out: the client can be quicker than the
        # charge's write to Redis (a loaded CI machine was). What is shared is the charge.
        eventually(lambda: budget_used(one) > 0, "the first gateway's charge in Redis")
        refused = chat(two, "on the other gateway", KEY_CAROL)
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "budget_exceeded"
        eventually(lambda: count(database) == 2, "both rows, the 429 included")
        usage = httpx.get(f"{two}/admin/usage?group_by=key", headers=auth(KEY_OPS), timeout=10)
        (carol,) = usage.json()["groups"]
    assert (carol["group"], carol["requests"]) == ("carol", 2)
    assert carol["cost"] == pytest.approx(float(first.headers["x-aiserve-cost"]))
    assert count(database, "key_id = 'carol' AND error_code = 'budget_exceeded'") == 1


def test_a_killed_database_keeps_its_rows_pending_and_rows_resume(
    database: str,
    tmp_path: Path,
    postgres_up: PostgresServer,  # noqa: F811
):
    cfg = gateway_config(tmp_path)
    with hypercorn_gateway(cfg, env={"AISERVE_TEST_AUDIT_DSN": database}) as (base, _):
        for i in range(3):
            assert chat(base, f"before {i}").status_code == 200
        eventually(lambda: count(database) == 3, "the first rows")
        postgres_up.kill()
        try:
            for i in range(3):
                r = chat(base, f"during {i}")
                assert r.status_code == 200  # served while the database is gone
            eventually(lambda: pending(base) == 3, "rows pending")
        finally:
            postgres_up.start()
        eventually(lambda: count(database) == 6, "the pending rows written")
        assert dropped(base) == 0
        after: list[str] = []
        for i in range(3):
            r = chat(base, f"after {i}")
            assert r.status_code == 200
            after.append(r.headers["x-request-id"])
        quoted = ", ".join(f"'{i}'" for i in after)
        eventually(lambda: count(database, f"request_id IN ({quoted})") == 3, "rows resume")
