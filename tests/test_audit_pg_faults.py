"""The audit log's faults on a real PostgreSQL (tests/pg_server.py), as a user sees them: a
locked table's usage reads do not starve name resolution of threads, a worker started while
the database is down serves and writes its rows later, a database stopped mid-run loses no
row, and a usage read while it is away is a 503 in the error envelope (issue 55, item 5)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psycopg
import pytest
import trio

from aiserve_trio.runtime.asgi import App

from .asgi_client import Response
from .conftest import config_text, make_config
from .pg_server import PostgresServer, postgres_server, postgres_up  # noqa: F401
from .servers import hypercorn_gateway
from .sim_gateway import running
from .sim_process import run_sim
from .spendcfg import PRICES
from .test_audit_postgres import database  # noqa: F401

pytestmark = pytest.mark.slow

#: Bounded waits for what a writer in another process does (real time: real servers).
WAIT_S = 30.0
DSN_ENV = "AISERVE_TEST_AUDIT_DSN"


def count(dsn: str, where: str = "1=1") -> int:
    """Rows in ``audit_requests`` (0 while the table is not there yet: not migrated)."""
    try:
        with psycopg.connect(dsn, connect_timeout=2) as conn:
            row = conn.execute(f"SELECT count(*) FROM audit_requests WHERE {where}").fetchone()
    except (psycopg.OperationalError, psycopg.errors.UndefinedTable):
        return -1
    return int(row[0]) if row else 0


def eventually(check: Callable[[], bool], what: str, within: float = WAIT_S) -> None:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {within} s: {what}")


def metric(base: str, name: str, labels: str = "") -> float:
    text = httpx.get(base + "/metrics", timeout=5).text
    m = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m[1]) if m else 0.0


def dropped(base: str) -> float:
    text = httpx.get(base + "/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(r"^aiserve_audit_dropped_total\{.*\} (\S+)$", text, re.M))


def chat(base: str, text: str) -> httpx.Response:
    body = {"model": "aiserve-mock", "messages": [{"role": "user", "content": f"echo: {text}"}]}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=10)


def pg_config(tmp_path: Path, audit: str = "") -> Path:
    path = tmp_path / "audit-pg.toml"
    path.write_text(
        config_text() + PRICES + f'[audit]\nbackend = "postgres"\ndsn_env = "{DSN_ENV}"\n{audit}'
    )
    return path


def ids_in(dsn: str, ids: list[str]) -> int:
    quoted = ", ".join(f"'{i}'" for i in ids)
    return count(dsn, f"request_id IN ({quoted})")


def assert_unavailable(r: httpx.Response) -> None:
    """A usage read while the database is away: 503 in the error envelope, with Retry-After."""
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "audit_unavailable"


# --- 1. usage reads on a locked table leave name resolution its threads -------------------


def usage_app(dsn: str, sim: str, monkeypatch: pytest.MonkeyPatch) -> App:
    """The app: a route whose upstream is named ``localhost`` (resolved in a thread, as a
    provider's name is), the audit log in ``dsn``."""
    monkeypatch.setenv(DSN_ENV, dsn)
    port = sim.rsplit(":", 1)[1]
    extra = f"""
[adapters.up]
kind = "openai"
base_url = "http://localhost:{port}/v1"
models = ["sim-model"]

[[routes]]
path = "/v1/up"
name = "up"
adapter = "up"
default_model = "sim-model"

[audit]
backend = "postgres"
dsn_env = "{DSN_ENV}"
usage_timeout_ms = 3000
"""
    return App(make_config(extra))


def waiting_on_locks(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query LIKE '%audit_requests%'"
        ).fetchone()
    return int(row[0]) if row else 0


async def test_usage_reads_on_a_locked_table_leave_a_new_upstream_connection_its_name_resolution(
    database: str, monkeypatch: pytest.MonkeyPatch  # noqa: F811
):
    # Issue 55 (5.1): 40 usage reads stuck on a slow database held every thread of Trio's
    # shared limiter, and a chat that needed a new connection (getaddrinfo in a thread)
    # ended 504 while pooled ones passed.
    with run_sim() as sim:
        app = usage_app(database, sim, monkeypatch)
        async with running(app) as client:
            lock = psycopg.connect(database)
            try:
                lock.execute("LOCK TABLE audit_requests IN ACCESS EXCLUSIVE MODE")
                reads: list[Response] = []
                answer: Response | None = None
                ended_while_locked: list[Response] = []

                async def read() -> None:
                    reads.append(await client.request("GET", "/v1/usage"))

                async with trio.open_nursery() as nursery:
                    for _ in range(45):
                        nursery.start_soon(read)
                    try:
                        # Each read that got a thread waits for the lock in PostgreSQL.
                        end = trio.current_time() + 10
                        while waiting_on_locks(database) < 4 and trio.current_time() < end:  # noqa: ASYNC110
                            await trio.sleep(0.05)  # PostgreSQL's state: polled
                        body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
                        with trio.move_on_after(15):
                            answer = await client.request(
                                "POST", "/v1/up", json_body=body,
                                headers={"x-request-timeout-ms": "5000"},
                            )
                        # The reads that got a thread end in the database after
                        # usage_timeout_ms (3 s), the table still locked.
                        with trio.move_on_after(10):
                            while len(reads) < 45:  # noqa: ASYNC110
                                await trio.sleep(0.05)
                        ended_while_locked = list(reads)
                    finally:
                        lock.rollback()  # the reads still waiting go on
            finally:
                lock.close()
    assert answer is not None, "the chat did not answer within 15 s"
    assert answer.status == 200, answer.body
    assert len(ended_while_locked) == 45  # every read answered, none waits for the lock
    codes = sorted(r.json()["error"]["code"] for r in ended_while_locked)
    # 4 threads: 4 statements timed out in the database, 41 reads refused at once.
    assert codes == ["audit_unavailable"] * 4 + ["usage_busy"] * 41
    for r in ended_while_locked:
        assert r.status == 503
        assert int(r.headers["retry-after"]) >= 1


# --- 2. a worker started while PostgreSQL is down ----------------------------------------


def test_a_worker_started_while_postgres_is_down_serves_and_writes_the_rows_once_it_is_up(
    database: str, tmp_path: Path, postgres_up: PostgresServer  # noqa: F811
):
    cfg = pg_config(tmp_path)
    postgres_up.kill()
    try:
        with hypercorn_gateway(cfg, env={DSN_ENV: database}) as (base, _):
            ids = []
            for i in range(5):
                r = chat(base, f"while down {i}")
                assert r.status_code == 200
                ids.append(r.headers["x-request-id"])
            eventually(lambda: metric(base, "aiserve_audit_rows_pending") == 5, "5 rows pending")
            assert_unavailable(httpx.get(base + "/v1/usage", timeout=10))
            postgres_up.start()
            # Connected later: the schema migrated, the rows written.
            eventually(lambda: ids_in(database, ids) == 5, "the rows, once it is up")
            eventually(lambda: metric(base, "aiserve_audit_rows_pending") == 0, "none pending")
            usage = httpx.get(base + "/v1/usage", timeout=10)
            assert usage.status_code == 200
            assert usage.json()["total"]["requests"] == 5
            assert "partial" not in usage.json()
            assert dropped(base) == 0
    finally:
        if not (postgres_up.data / "postmaster.pid").exists():
            postgres_up.start()


# --- 3. PostgreSQL stopped while requests flow: no row lost ------------------------------


def test_postgres_stopped_while_requests_flow_loses_no_row(
    database: str, tmp_path: Path, postgres_up: PostgresServer  # noqa: F811
):
    cfg = pg_config(tmp_path, "flush_ms = 200\n")
    with hypercorn_gateway(cfg, env={DSN_ENV: database}) as (base, _):
        ids: list[str] = []

        def send(n: int, what: str) -> None:
            for i in range(n):
                r = chat(base, f"{what} {i}")
                assert r.status_code == 200
                ids.append(r.headers["x-request-id"])

        send(20, "before")
        eventually(lambda: ids_in(database, ids) == 20, "the first rows")
        postgres_up.kill()
        try:
            stopped = time.monotonic()
            while time.monotonic() - stopped < 6.0 and len(ids) < 400:  # ~6 s, bounded
                send(5, "while stopped")
                time.sleep(0.02)
            pending = metric(base, "aiserve_audit_rows_pending")
            assert pending > 0
            during = httpx.get(base + "/v1/usage", timeout=10)
            assert_unavailable(during)
        finally:
            postgres_up.start()
        send(20, "after")
        eventually(lambda: ids_in(database, ids) == len(ids), f"all {len(ids)} rows")
        assert count(database) == len(ids)  # each once
        assert dropped(base) == 0
        eventually(lambda: metric(base, "aiserve_audit_rows_pending") == 0, "none pending")
        usage = httpx.get(base + "/v1/usage", timeout=10).json()
        assert usage["total"]["requests"] == len(ids)
        assert "partial" not in usage
