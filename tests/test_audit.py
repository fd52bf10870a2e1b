"""The audit log: a row per request (served, refused, failed) in SQLite, written off the
request path by a writer task; versioned schema; retention; drops counted; usage read back."""

from __future__ import annotations

import io
import itertools
import json
import os
import sqlite3
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry

from aiserve_trio.audit import sqlite as sqlite_module
from aiserve_trio.audit.log import AuditLog, AuditMetrics
from aiserve_trio.audit.row import Row, RowBuilder
from aiserve_trio.audit.schema import COLUMNS, MIGRATIONS, VERSION, SchemaTooNew
from aiserve_trio.audit.settings import AuditConfig
from aiserve_trio.audit.sqlite import SQLiteDatabase
from aiserve_trio.audit.usage import UsageEndpoints, UsageQuery, parse_query
from aiserve_trio.config import parse_config
from aiserve_trio.core.api import encoder
from aiserve_trio.core.errors import BadRequest, Overloaded, Unauthorized
from aiserve_trio.runtime.asgi import App
from aiserve_trio.stages.outcome import Outcome

from .asgi_client import chat_body
from .authcfg import OFF
from .conftest import config_text
from .spendcfg import KEY_CAROL, KEY_DAN, KEY_OPS, auth, running, spend_config, spend_toml


def rows(path: Path, where: str = "1=1") -> list[dict[str, Any]]:
    conn = sqlite3.connect(path)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(f"SELECT * FROM audit_requests WHERE {where}")]
    finally:
        conn.close()


# --- the schema ---------------------------------------------------------------------


def test_a_new_database_is_migrated_to_the_current_version(tmp_path):
    db = SQLiteDatabase(tmp_path / "a.db")
    assert db.open() == VERSION
    db.close()
    cols = [r[1] for r in sqlite3.connect(tmp_path / "a.db").execute("PRAGMA table_info(audit_requests)")]
    assert sorted(cols) == sorted(COLUMNS)


def test_an_older_database_gets_the_later_migrations_and_keeps_its_rows(tmp_path):
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE audit_schema (version INTEGER NOT NULL)")
    for stmt in MIGRATIONS[0][1]:
        conn.execute(stmt)
    conn.execute("INSERT INTO audit_schema VALUES (1)")
    conn.execute(
        "INSERT INTO audit_requests (request_id, ts, tenant, route, api, channel, model, "
        "served_model, status, prompt_tokens, completion_tokens, cost, total_ms) VALUES "
        "('old', 1.0, 't', 'chat', 'chat', 'api', 'm', 'm', 'ok', 1, 2, 0.5, 3.0)"
    )
    conn.commit()
    conn.close()
    db = SQLiteDatabase(path)
    assert db.open() == VERSION
    db.close()
    (old,) = rows(path)
    assert old["request_id"] == "old"
    assert old["saved"] == 0
    assert old["prompt"] is None
    assert (old["prompt_chars"], old["requests"], old["client"]) == (None, 1, None)
    assert (old["cache_read_tokens"], old["cache_write_tokens"], old["cache_cost"]) == (0, 0, 0)


def test_a_database_from_a_newer_gateway_is_refused(tmp_path):
    path = tmp_path / "new.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE audit_schema (version INTEGER NOT NULL)")
    conn.execute("INSERT INTO audit_schema VALUES (?)", (VERSION + 1,))
    conn.commit()
    conn.close()
    with pytest.raises(SchemaTooNew, match="schema version"):
        SQLiteDatabase(path).open()


# --- the gateway writes a row per request ------------------------------------------


async def test_every_request_has_a_row_the_budget_429_included(tmp_path):
    app = App(spend_config(tmp_path))
    async with running(app) as client:
        first = await client.chat(chat_body("echo: one"), headers=auth(KEY_CAROL))
        assert first.status == 200
        assert float(first.headers["x-aiserve-cost"]) > 0
        # The first reply spent carol's tiny budget: the next is refused.
        refused = await client.chat(chat_body("echo: two"), headers=auth(KEY_CAROL))
        assert refused.status == 429
        assert refused.json()["error"]["code"] == "budget_exceeded"
        bad_key = await client.chat(chat_body("echo: three"), headers=auth("aik_x_" + "z" * 32))
        assert bad_key.status == 401
        other = await client.chat(chat_body("echo: four"), headers=auth(KEY_DAN))
        assert other.status == 200
    got = rows(tmp_path / "audit.db")
    assert len(got) == 4
    by_status = {r["status"]: r for r in got if r["key_id"] != "dan"}
    ok = by_status["ok"]
    assert ok["key_id"] == "carol"
    assert ok["tenant"] == "shop"
    assert ok["request_id"] == first.headers["x-request-id"]
    assert ok["cost"] == pytest.approx(float(first.headers["x-aiserve-cost"]))
    assert ok["prompt_tokens"] > 0
    assert ok["served_model"] == "aiserve-mock"
    assert ok["api"] == "chat"
    assert ok["total_ms"] >= ok["ttft_ms"] > 0
    assert ok["prompt"] is None  # no content by default
    assert ok["reply"] is None
    limited = by_status["too_many_requests"]
    assert (limited["key_id"], limited["error_code"], limited["cost"]) == ("carol", "budget_exceeded", 0)
    assert by_status["unauthorized"]["error_code"] == "invalid_api_key"


async def test_redacted_content_is_the_prompt_and_reply_after_the_routes_policies(tmp_path):
    app = App(spend_config(tmp_path, audit_extra='content = "redacted"\n'))
    async with running(app) as client:
        r = await client.chat(chat_body("echo: hello auditor"), headers=auth(KEY_DAN))
        assert r.status == 200
    (row,) = rows(tmp_path / "audit.db")
    assert row["prompt"] == "echo: hello auditor"
    assert row["reply"] == r.json()["choices"][0]["message"]["content"]


async def test_a_100_kb_prompt_is_stored_cut_to_the_cap_and_says_so(tmp_path):
    # Issue 55 (disk bounded): a 100 KB prompt was an 87.6 KB row; content is now cut to
    # max_content_chars (8,192 by default) each, and the row keeps the length it had.
    assert AuditConfig().max_content_chars == 8192
    app = App(spend_config(tmp_path, audit_extra='content = "redacted"\n'))
    big = "lorem ipsum " * 8_500  # 102,000 characters
    async with running(app) as client:
        r = await client.chat(chat_body(big), headers=auth(KEY_DAN))
        assert r.status == 200
        small = await client.chat(chat_body("echo: short"), headers=auth(KEY_DAN))
        assert small.status == 200
    got = {row["request_id"]: row for row in rows(tmp_path / "audit.db")}
    cut = got[r.headers["x-request-id"]]
    assert cut["prompt"] == big[:8192]
    assert cut["prompt_chars"] == len(big)  # cut: the original length
    assert cut["reply"] == r.json()["choices"][0]["message"]["content"]  # short: whole
    assert cut["reply_chars"] is None
    whole = got[small.headers["x-request-id"]]
    assert whole["prompt"] == "echo: short"
    assert (whole["prompt_chars"], whole["reply_chars"]) == (None, None)  # not cut


def wrong_key(i: int, address: str | None) -> Outcome:
    now = trio.current_time()
    return Outcome(request_id=f"refused-{i}", route="chat", channel="api", arrival=now,
                   ended=now, status="unauthorized", tenant="t", client=address,
                   error=Unauthorized("bad key"))


async def test_wrong_key_requests_are_a_bounded_number_of_rows_that_count_them_all(thread_clock):
    # Issue 55 (disk bounded): 38,875 wrong keys from as many addresses were 38,875 rows.
    # Now: per interval (60 s), a row per (route, address) for 16 addresses, the rest one
    # "others" row, each with its count.
    db = FlakyDatabase()
    log = AuditLog(AuditConfig(flush_ms=0), db, RowBuilder(b"k"), AuditMetrics(CollectorRegistry()))
    async with trio.open_nursery() as nursery:
        await nursery.start(log.run)
        for i in range(1000):  # 1,000 addresses ...
            log.offer(wrong_key(i, f"10.0.{i // 250}.{i % 250}"))
        for i in range(500):  # ... the first of them 500 times more
            log.offer(wrong_key(1000 + i, "10.0.0.0"))
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(59)
        assert db.rows == []  # counted, not written: the interval is not over
        assert log.unwritten(log.offered) == 1500  # a usage read now says so
        await trio.sleep(2)
        assert len(db.rows) == 17
        long = "f" * 500  # a proxy's header may say anything: cut
        for i in range(500):  # the next interval: 500 more addresses, one unknown
            address = {0: None, 1: long}.get(i, f"10.1.{i // 250}.{i % 250}")
            log.offer(wrong_key(1500 + i, address))
        await log.aclose()  # shutdown writes the interval not over yet
    got = [dict(zip(COLUMNS, r, strict=True)) for r in db.rows]
    assert len(got) == 34  # 17 an interval however many addresses
    assert sum(r["requests"] for r in got) == 2000  # every request counted
    first = {r["client"]: r["requests"] for r in got[:17]}
    assert first["10.0.0.0"] == 501
    assert first["others"] == 1000 - 16
    assert {r["status"] for r in got} == {"unauthorized"}
    assert {r["error_code"] for r in got} == {"invalid_api_key"}
    assert len({r["request_id"] for r in got}) == 34
    assert {"unknown", "f" * 64} <= {r["client"] for r in got[17:]}


async def test_2000_wrong_keys_through_the_gateway_are_few_rows_and_usage_counts_them(tmp_path):
    text = config_text().replace(OFF, spend_toml(audit=f'[audit]\npath = "{tmp_path / "audit.db"}"\n'))
    text = text.replace('client_address_header = ""', 'client_address_header = "x-forwarded-for"')
    app = App(parse_config(text, source="<test>"))
    async with running(app) as client:
        for i in range(2000):
            address = f"192.0.{i // 200}.{i % 200}"
            headers = {**auth("aik_x_" + "z" * 32), "x-forwarded-for": address}
            r = await client.chat(chat_body("echo: hi"), headers=headers)
            assert r.status == 401
        ok = await client.chat(chat_body("echo: hi"), headers=auth(KEY_DAN))
        assert ok.status == 200
        usage = await client.request("GET", "/admin/usage?group_by=route", headers=auth(KEY_OPS))
        # The interval's requests are counted, not written yet: the answer says so.
        assert usage.json()["total"]["requests"] == 1
        assert (usage.json()["partial"], usage.json()["unwritten_rows"]) == (True, 2000)
    got = rows(tmp_path / "audit.db", "status = 'unauthorized'")
    assert len(got) == 17
    assert sum(r["requests"] for r in got) == 2000
    assert {r["client"] for r in got} >= {"192.0.0.0", "others"}


def arrived(i: int) -> Outcome:
    """Request ``i``, arrived ``i`` seconds into the run: later requests have later ts."""
    return Outcome(request_id=f"r{i}", route="chat", channel="api", arrival=float(i) - 10_000,
                   ended=float(i) - 10_000, status="ok", tenant="t", model="m")


def metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def test_a_database_past_max_rows_loses_its_oldest_rows_first(tmp_path, thread_clock):
    # Issue 55 (disk bounded): age was the only bound. Past max_rows the oldest rows go,
    # down to 90 % of it: at start-up, after this worker's batches, and at the hourly
    # count for the rows other workers wrote.
    path = tmp_path / "audit.db"
    seed = SQLiteDatabase(path)
    seed.open()
    builder = RowBuilder(b"k")
    old = time.time() - 86_400
    seed.insert([builder.row(arrived(i), old + i) for i in range(130)])  # a day old
    seed.close()
    registry = CollectorRegistry()
    log = AuditLog(AuditConfig(flush_ms=0, max_rows=100), SQLiteDatabase(path), builder,
                   AuditMetrics(registry))
    async with trio.open_nursery() as nursery:
        await nursery.start(log.run)  # reached: 130 rows, past 100
        assert len(rows(path)) == 130  # counted once the worker serves, not before
        await trio.sleep(1)
        assert [r["request_id"] for r in rows(path, "1=1 ORDER BY ts")][:1] == ["r40"]
        assert metric(registry, "aiserve_audit_database_rows") == 90
        assert metric(registry, "aiserve_audit_database_max_rows") == 100
        assert metric(registry, "aiserve_audit_database_bytes") > 0
        for i in range(200, 215):  # this worker's rows: 105 after the batch
            log.offer(arrived(i))
        await log.settle()
        assert len(rows(path)) == 90
        assert metric(registry, "aiserve_audit_rows_purged_total", reason="max_rows") == 40 + 15
        ids = [r["request_id"] for r in rows(path, "1=1 ORDER BY ts")]
        assert (ids[0], ids[-1]) == ("r55", "r214")  # the oldest went, the new stayed
        # Another worker's rows (the same file): seen at the hourly count.
        other = SQLiteDatabase(path)
        other.open()
        other.insert([builder.row(arrived(i), time.time() + i) for i in range(300, 330)])
        other.close()
        await trio.sleep(3599)
        assert len(rows(path)) == 120  # not counted yet
        await trio.sleep(2)
        await trio.testing.wait_all_tasks_blocked()
        assert len(rows(path)) == 90
        assert metric(registry, "aiserve_audit_database_rows") == 90
        await log.aclose()
    assert metric(registry, "aiserve_audit_rows_purged_total", reason="max_rows") == 40 + 15 + 30


def test_a_long_reply_is_cut_to_the_cap_too():
    builder = RowBuilder(b"k", content=True, max_chars=10)
    o = Outcome(request_id="r", route="chat", channel="api", arrival=0.0, ended=0.1,
                status="ok", tenant="t", model="m", delivered="x" * 25)
    row = dict(zip(COLUMNS, builder.row(o, 1.0), strict=True))
    assert (row["reply"], row["reply_chars"]) == ("x" * 10, 25)
    assert (row["prompt"], row["prompt_chars"]) == (None, None)


async def test_usage_read_back_by_key_and_the_callers_own(tmp_path):
    app = App(spend_config(tmp_path, carol_budget="100.0"))
    async with running(app) as client:
        spent = 0.0
        for i in range(3):
            r = await client.chat(chat_body(f"echo: request {i}"), headers=auth(KEY_CAROL))
            spent += float(r.headers["x-aiserve-cost"])
        await client.chat(chat_body("echo: dan"), headers=auth(KEY_DAN))
        # Rows are written by the writer task, in a thread: let it catch up.
        assert app.audit is not None
        await app.audit.settle()
        admin = await client.request("GET", "/admin/usage?group_by=key", headers=auth(KEY_OPS))
        assert admin.status == 200
        body = admin.json()
        groups = {g["group"]: g for g in body["groups"]}
        assert groups["carol"]["requests"] == 3
        assert groups["carol"]["cost"] == pytest.approx(spent)
        assert groups["dan"]["requests"] == 1
        assert body["currency"] == "USD"
        assert body["total"]["requests"] == 4
        mine = await client.request("GET", "/v1/usage?group_by=model", headers=auth(KEY_CAROL))
        assert mine.status == 200
        (model,) = mine.json()["groups"]
        assert (model["group"], model["requests"]) == ("aiserve-mock", 3)
        day = await client.request("GET", "/admin/usage?group_by=day", headers=auth(KEY_OPS))
        assert [g["group"] for g in day.json()["groups"]] == [time.strftime("%Y-%m-%d", time.gmtime())]
        not_admin = await client.request("GET", "/admin/usage", headers=auth(KEY_CAROL))
        assert not_admin.status == 403
        bad = await client.request("GET", "/admin/usage?group_by=colour", headers=auth(KEY_OPS))
        assert bad.status == 400
        assert bad.json()["error"]["param"] == "group_by"


def test_usage_queries_take_days_or_unix_seconds():
    q = parse_query({"from": "2026-12-01", "to": "2026-12-01", "group_by": "tenant"}, now=0.0)
    assert (q.start, q.end - q.start, q.group_by) == (1796083200.0, 86400.0, "tenant")
    assert parse_query({"from": "10", "to": "20"}, now=0.0) == UsageQuery(10.0, 20.0, "day")
    for bad in ({"from": "yesterday"}, {"from": "20", "to": "10"}, {"group_by": "x"}):
        with pytest.raises(BadRequest):
            parse_query(bad, now=0.0)


async def test_usage_with_the_audit_log_off_says_so(autojump_clock):
    app = App(spend_config())
    async with running(app) as client:
        r = await client.request("GET", "/admin/usage", headers=auth(KEY_OPS))
        assert r.status == 404
        assert r.json()["error"]["code"] == "audit_off"


async def test_rows_older_than_retention_are_deleted_at_start(tmp_path):
    db = SQLiteDatabase(tmp_path / "audit.db")
    db.open()
    base = dict.fromkeys(COLUMNS)
    base.update(tenant="t", route="chat", api="chat", channel="api", model="m",
                served_model="m", status="ok", prompt_tokens=0, completion_tokens=0,
                cost=0.0, saved=0.0, total_ms=1.0, requests=1, cache_read_tokens=0,
                cache_write_tokens=0, cache_cost=0.0)
    stale = {**base, "request_id": "stale", "ts": time.time() - 40 * 86400}
    fresh = {**base, "request_id": "fresh", "ts": time.time() - 86400}
    db.insert([tuple(stale[c] for c in COLUMNS), tuple(fresh[c] for c in COLUMNS)])
    db.close()
    app = App(spend_config(tmp_path))
    async with running(app):
        pass
    assert [r["request_id"] for r in rows(tmp_path / "audit.db")] == ["fresh"]


# --- the writer: drops, recovery, the access log (a fake database) --------------------


class FlakyDatabase:
    placeholder = "?"
    day_sql = "ts"

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.down = False

    def open(self) -> int:
        return VERSION

    def insert(self, rows: Sequence[Row]) -> None:
        if self.down:
            raise OSError("connection refused")
        self.rows.extend(rows)

    def purge(self, before: float) -> int:
        return 0

    def measure(self) -> tuple[int, int]:
        return len(self.rows), 0

    def trim(self, keep: int) -> int:
        return 0

    def query(self, sql: str, params: Sequence[Any], timeout: float) -> list[tuple[Any, ...]]:
        return []

    def transient(self, exc: BaseException) -> bool:
        return isinstance(exc, OSError)

    def close(self) -> None:
        pass


def outcome(i: int) -> Outcome:
    return Outcome(request_id=f"r{i}", route="chat", channel="api", arrival=0.0, ended=0.1,
                   status="ok", tenant="t", model="m")


def dropped(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value("aiserve_audit_dropped_total", {"reason": reason}) or 0.0


@pytest.fixture
def thread_clock(mock_clock: trio.testing.MockClock) -> trio.testing.MockClock:
    """Virtual time that moves only after a quarter of a real second with every task
    blocked: not while the writer's thread is still inserting (a few microseconds)."""
    mock_clock.autojump_threshold = 0.25
    return mock_clock


class TimedDatabase(FlakyDatabase):
    """Notes the virtual time of each insert tried (asked of the loop from the thread)."""

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        super().__init__()
        self.token = token
        self.tries: list[float] = []

    def insert(self, rows: Sequence[Row]) -> None:
        self.tries.append(trio.from_thread.run_sync(trio.current_time, trio_token=self.token))
        super().insert(rows)


def all_dropped(registry: CollectorRegistry) -> float:
    return sum(dropped(registry, r) for r in ("buffer_full", "db_error", "unwritable", "shutdown"))


async def test_a_failed_batch_stays_queued_and_is_tried_again_with_a_backoff(thread_clock):
    # Issue 55 (5.3): a batch that failed was dropped; PostgreSQL stopped 21 s lost a third
    # of the rows although the buffer could hold 160 s of them.
    registry = CollectorRegistry()
    db = TimedDatabase(trio.lowlevel.current_trio_token())
    access = io.BytesIO()
    log = AuditLog(AuditConfig(flush_ms=0), db, RowBuilder(b"k"), AuditMetrics(registry),
                   access=access)
    async with trio.open_nursery() as nursery:
        await nursery.start(log.run)
        log.offer(outcome(0))
        await log.settle()
        db.down = True
        start = trio.current_time()
        log.offer(outcome(1))
        log.offer(outcome(2))
        await trio.sleep(20)
        assert registry.get_sample_value("aiserve_audit_rows_pending") == 2
        assert registry.get_sample_value("aiserve_audit_database_up") == 0
        db.down = False
        await log.settle()
        assert trio.current_time() - start == pytest.approx(22.5)  # the try after 17.5 s
        log.offer(outcome(3))
        await log.aclose()
    tried = db.tries[1:-1]  # r1 and r2 from the first failure to their write (r3 after)
    gaps = [b - a for a, b in itertools.pairwise(tried)]
    assert gaps == pytest.approx([0.5, 1, 2, 4, 5, 5, 5])  # doubling, at most 5 s
    assert registry.get_sample_value("aiserve_audit_write_failures_total") == 7
    assert all_dropped(registry) == 0
    assert [r[0] for r in db.rows] == ["r0", "r1", "r2", "r3"]  # none lost, in order
    lines = [json.loads(line) for line in access.getvalue().splitlines()]
    assert [line["request_id"] for line in lines] == ["r0", "r1", "r2", "r3"]  # each once
    assert lines[0]["tenant"] == "t"
    assert registry.get_sample_value("aiserve_audit_rows_pending") == 0
    assert registry.get_sample_value("aiserve_audit_database_up") == 1


async def test_rows_are_dropped_only_when_the_buffer_overflows(thread_clock):
    registry = CollectorRegistry()
    db = FlakyDatabase()
    db.down = True
    log = AuditLog(AuditConfig(buffer=4, flush_ms=0), db, RowBuilder(b"k"), AuditMetrics(registry))
    async with trio.open_nursery() as nursery:
        await nursery.start(log.run)
        for i in range(6):
            log.offer(outcome(i))
        await trio.sleep(30)
        assert dropped(registry, "buffer_full") == 2  # the buffer held 4
        assert registry.get_sample_value("aiserve_audit_rows_pending") == 4
        db.down = False
        await log.settle()
        await log.aclose()
    assert [r[0] for r in db.rows] == ["r0", "r1", "r2", "r3"]
    assert all_dropped(registry) == 2


class RefusingDatabase(FlakyDatabase):
    def insert(self, rows: Sequence[Row]) -> None:
        if any(r[0] == "r1" for r in rows):
            raise ValueError("a row it will never take")
        super().insert(rows)


async def test_a_batch_the_database_refuses_for_good_is_dropped_and_counted(thread_clock):
    # Kept, it would stop every row behind it.
    registry = CollectorRegistry()
    db = RefusingDatabase()
    log = AuditLog(AuditConfig(flush_ms=0), db, RowBuilder(b"k"), AuditMetrics(registry))
    with trio.fail_after(60):  # kept and tried again, it would never settle
        async with trio.open_nursery() as nursery:
            await nursery.start(log.run)
            log.offer(outcome(0))
            await log.settle()
            log.offer(outcome(1))
            await log.settle()
            log.offer(outcome(2))
            await log.aclose()
    assert [r[0] for r in db.rows] == ["r0", "r2"]
    assert dropped(registry, "db_error") == 1


class LateDatabase(FlakyDatabase):
    """Cannot be reached until ``down`` is False; then opens (and migrates) once."""

    def __init__(self) -> None:
        super().__init__()
        self.down = True
        self.opened = 0

    def open(self) -> int:
        if self.down:
            raise OSError("connection refused")
        self.opened += 1
        return VERSION


async def test_a_database_away_at_start_up_does_not_hold_the_start(thread_clock):
    # Issue 55 (5.2): the worker did not start, and exited 0, while PostgreSQL was down.
    registry = CollectorRegistry()
    db = LateDatabase()
    log = AuditLog(AuditConfig(flush_ms=0), db, RowBuilder(b"k"), AuditMetrics(registry))
    usage = UsageEndpoints(log, "USD")
    async with trio.open_nursery() as nursery:
        started = trio.current_time()
        await nursery.start(log.run)
        assert trio.current_time() == started  # serving at once
        log.offer(outcome(0))
        log.offer(outcome(1))
        await trio.sleep(10)
        assert registry.get_sample_value("aiserve_audit_rows_pending") == 2
        with pytest.raises(Overloaded) as away:
            await usage.read(UsageQuery(0.0, 1e10, "day"))
        assert (away.value.status, away.value.code) == (503, "audit_unavailable")
        assert int(away.value.headers["Retry-After"]) >= 1
        db.down = False
        await log.settle()
        await log.aclose()
    assert db.opened == 1  # connected (and migrated) once it answered
    assert [r[0] for r in db.rows] == ["r0", "r1"]
    assert all_dropped(registry) == 0


async def test_a_database_a_newer_gateway_migrated_still_stops_the_start(autojump_clock):
    class Newer(FlakyDatabase):
        def open(self) -> int:
            raise SchemaTooNew("schema version 99")

    log = AuditLog(AuditConfig(), Newer(), RowBuilder(b"k"), AuditMetrics(CollectorRegistry()))
    async with trio.open_nursery() as nursery:
        with pytest.raises(SchemaTooNew):
            await nursery.start(log.run)


async def test_a_usage_answer_says_it_is_partial_while_rows_wait_or_were_dropped(thread_clock):
    registry = CollectorRegistry()
    db = FlakyDatabase()
    log = AuditLog(AuditConfig(flush_ms=0, buffer=3), db, RowBuilder(b"k"), AuditMetrics(registry))
    usage = UsageEndpoints(log, "USD")
    q = UsageQuery(0.0, 1e10, "day")
    async with trio.open_nursery() as nursery:
        await nursery.start(log.run)
        log.offer(outcome(0))
        whole = await usage.read(q)
        assert not whole.partial
        assert "partial" not in json.loads(encoder.encode(whole))
        db.down = True
        log.offer(outcome(1))
        log.offer(outcome(2))
        await trio.sleep(1)
        started = trio.current_time()
        waiting = await usage.read(q)
        assert trio.current_time() == started  # no wait for a database that is away
        assert (waiting.partial, waiting.unwritten_rows) == (True, 2)
        db.down = False
        await log.settle()
        assert not (await usage.read(q)).partial  # written: whole again
        db.down = True
        for i in range(3, 7):
            log.offer(outcome(i))  # the buffer (3) holds three of them
        await trio.sleep(1)
        lost = await usage.read(q)
        assert (lost.partial, lost.unwritten_rows) == (True, 4)
        db.down = False
        await log.settle()
        after = await usage.read(q)
        assert (after.partial, after.unwritten_rows) == (True, 1)  # the dropped row stays missing
        await log.aclose()


class SlowReads(FlakyDatabase):
    """Reads that wait (a locked table) until released."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def query(self, sql: str, params: Sequence[Any], timeout: float) -> list[tuple[Any, ...]]:
        self.release.wait(timeout)
        return []


async def test_usage_reads_have_threads_of_their_own_and_a_503_beyond_them(thread_clock):
    # Issue 55 (5.1): reads ran in Trio's shared threads, which name resolution needs too.
    db = SlowReads()
    registry = CollectorRegistry()
    log = AuditLog(AuditConfig(usage_threads=2), db, RowBuilder(b"k"), AuditMetrics(registry))
    usage = UsageEndpoints(log, "USD")
    shared = trio.to_thread.current_default_thread_limiter()
    q = UsageQuery(0.0, 1e10, "day")
    outcomes: list[object] = []

    async def read() -> None:
        try:
            outcomes.append(await usage.read(q))
        except Overloaded as exc:
            outcomes.append(exc)

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(log.run)
            async with trio.open_nursery() as reads:
                for _ in range(5):
                    reads.start_soon(read)
                await trio.testing.wait_all_tasks_blocked()
                busy = [o for o in outcomes if isinstance(o, Overloaded)]
                assert len(busy) == 3  # at once: no queue behind the two readers
                assert shared.borrowed_tokens == 0  # name resolution's threads are free
                for exc in busy:
                    assert (exc.status, exc.code, exc.headers) == (503, "usage_busy", {"Retry-After": "1"})
                db.release.set()
            assert len(outcomes) == 5
            db.release.clear()
            # A read whose client went away stops waiting at once; its thread ends with the
            # statement (the database's timeout) and counts against the readers till then.
            with trio.move_on_after(1):
                await usage.read(q)
            with trio.move_on_after(1):
                await usage.read(q)
            with pytest.raises(Overloaded):
                await usage.read(q)
            assert registry.get_sample_value("aiserve_audit_usage_refused_total", {"reason": "busy"}) == 4
            await log.aclose()
    finally:
        db.release.set()


class FailingReads(FlakyDatabase):
    def query(self, sql: str, params: Sequence[Any], timeout: float) -> list[tuple[Any, ...]]:
        raise OSError("connection refused")


async def test_a_usage_read_the_database_does_not_answer_is_a_503_to_retry(thread_clock):
    # Issue 55 (5.4): a 500 with an empty body.
    log = AuditLog(AuditConfig(), FailingReads(), RowBuilder(b"k"), AuditMetrics(CollectorRegistry()))
    async with trio.open_nursery() as nursery:
        await nursery.start(log.run)
        with pytest.raises(Overloaded) as away:
            await UsageEndpoints(log, "USD").read(UsageQuery(0.0, 1e10, "day"))
        await log.aclose()
    assert (away.value.status, away.value.code) == (503, "audit_unavailable")
    assert away.value.headers["Retry-After"] == "1"


async def test_a_full_sqlite_disk_loses_no_row_and_usage_says_it_is_partial_meanwhile(tmp_path):
    # Issue 55 (5.3): a full SQLite disk lost 994 of 3,000 rows, and /v1/usage gave short
    # totals with no sign of the gap. A real SQLITE_FULL: the file may not grow a page.
    app = App(spend_config(tmp_path, audit_extra='content = "redacted"\nflush_ms = 0\n'))
    big = chat_body("hi " + "z" * 20_000)  # each row needs pages of its own
    async with running(app) as client:
        audit = app.audit
        assert audit is not None
        assert (await client.chat(chat_body("echo: first"), headers=auth(KEY_DAN))).status == 200
        await audit.settle()
        conn = audit.db._require()  # type: ignore[attr-defined]  # the writer's connection, idle
        (pages,) = conn.execute("PRAGMA page_count").fetchone()
        conn.execute(f"PRAGMA max_page_count = {pages}")
        for _ in range(5):
            assert (await client.chat(big, headers=auth(KEY_DAN))).status == 200
        registry = app.metrics.registry
        with trio.fail_after(10):
            while not registry.get_sample_value("aiserve_audit_write_failures_total"):  # noqa: ASYNC110
                await trio.sleep(0.05)  # the writer's thread: polled
        mine = await client.request("GET", "/v1/usage", headers=auth(KEY_DAN))
        assert mine.status == 200
        assert mine.json()["total"]["requests"] == 1
        assert (mine.json()["partial"], mine.json()["unwritten_rows"]) == (True, 5)
        assert mine.headers["x-aiserve-usage-partial"] == "5"
        conn.execute("PRAGMA max_page_count = 1073741823")  # room again
        with trio.fail_after(15):
            await audit.settle()
        whole = await client.request("GET", "/v1/usage", headers=auth(KEY_DAN))
        assert whole.json()["total"]["requests"] == 6
        assert "partial" not in whole.json()
        assert "x-aiserve-usage-partial" not in whole.headers
        assert all_dropped(registry) == 0
    assert len(rows(tmp_path / "audit.db")) == 6


def test_a_sqlite_usage_read_gives_up_after_its_timeout(tmp_path):
    db = SQLiteDatabase(tmp_path / "a.db")
    db.open()
    endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
    raised: list[BaseException] = []

    def read() -> None:
        try:
            db.query(endless, [], 0.2)
        except BaseException as exc:
            raised.append(exc)

    reader = threading.Thread(target=read, daemon=True)  # a failure must not hang the run
    started = time.monotonic()
    reader.start()
    reader.join(5.0)
    assert not reader.is_alive(), "the read did not give up"
    assert time.monotonic() - started < 2.0
    assert isinstance(raised[0], sqlite3.OperationalError)
    assert "interrupted" in str(raised[0])
    db.close()


async def test_a_full_queue_drops_instead_of_waiting(autojump_clock):
    registry = CollectorRegistry()
    log = AuditLog(AuditConfig(buffer=2), FlakyDatabase(), RowBuilder(b"k"), AuditMetrics(registry))
    # No writer running: the queue fills and the request path never blocks.
    for i in range(5):
        log.offer(outcome(i))
    assert dropped(registry, "buffer_full") == 3


async def test_shutdown_writes_what_is_queued():
    db = FlakyDatabase()
    log = AuditLog(AuditConfig(), db, RowBuilder(b"k"), AuditMetrics(CollectorRegistry()))
    async with trio.open_nursery() as nursery:
        await nursery.start(log.run)
        for i in range(700):  # more than one batch
            log.offer(outcome(i))
        await log.aclose()
    assert len(db.rows) == 700


def test_a_row_has_its_times_in_milliseconds_and_its_absences_as_null(tmp_path):
    o = Outcome(request_id="r1", route="chat", channel="api", arrival=100.0,
                ended=100.0123456, first_token_at=100.0041234, status="ok", tenant="t",
                model="m", cost=0.25)
    db = SQLiteDatabase(tmp_path / "a.db")
    db.open()
    db.insert([RowBuilder(b"k").row(o, 1_700_000_000.5)])
    conn = sqlite3.connect(tmp_path / "a.db")
    conn.row_factory = sqlite3.Row
    row = dict(conn.execute("SELECT * FROM audit_requests").fetchone())
    assert row["ts"] == 1_700_000_000.5
    assert row["ttft_ms"] == 4.123  # to the microsecond
    assert row["total_ms"] == 12.346
    assert row["served_model"] == "m"  # nothing answered under another name
    assert row["cost"] == 0.25
    for column in ("trace_id", "key_id", "session_hash", "deployment", "fallback",
                   "error_code", "cache", "steps", "policy_actions", "prompt", "reply"):
        assert row[column] is None, column
    assert conn.execute("SELECT count(*) FROM audit_requests WHERE session_hash IS NULL "
                        "AND error_code IS NULL").fetchone()[0] == 1  # real NULLs, not 'None'


def _numbered(n: int) -> list[Row]:
    builder = RowBuilder(b"k")
    return [builder.row(outcome(i), 1_700_000_000.0 + i) for i in range(n)]


def test_a_large_batch_is_inserted_in_chunks_giving_up_the_cpu_between_them(tmp_path, monkeypatch):
    # The writer shares the worker's CPU: between chunks it yields, so the event loop
    # runs while a second's batch goes in.
    yields: list[int] = []
    db = SQLiteDatabase(tmp_path / "a.db")
    db.open()
    monkeypatch.setattr(sqlite_module, "_yield_cpu",
                        lambda: yields.append(len(rows(tmp_path / "a.db"))))
    db.insert(_numbered(2 * sqlite_module.CHUNK + 44))
    assert len(yields) == 2
    assert yields == [0, 0]  # nothing committed in between: one transaction
    assert len(rows(tmp_path / "a.db")) == 2 * sqlite_module.CHUNK + 44


def test_a_batch_that_fails_in_a_later_chunk_leaves_no_row_of_it(tmp_path):
    db = SQLiteDatabase(tmp_path / "a.db")
    db.open()
    batch = _numbered(sqlite_module.CHUNK + 5)
    broken = list(batch[-1])
    broken[COLUMNS.index("tenant")] = None  # NOT NULL
    batch[-1] = tuple(broken)
    with pytest.raises(sqlite3.IntegrityError):
        db.insert(batch)
    assert rows(tmp_path / "a.db") == []  # the batch is dropped whole, as counted
    db.insert(_numbered(3))
    assert len(rows(tmp_path / "a.db")) == 3


def test_session_ids_are_kept_as_a_keyed_hash():
    a, b = RowBuilder(b"key-a"), RowBuilder(b"key-b")
    assert a.session_hash("s1") == a.session_hash("s1") != a.session_hash("s2")
    assert a.session_hash("s1") != b.session_hash("s1")
    assert "s1" not in (a.session_hash("s1") or "")


async def test_redacted_content_never_holds_what_the_routes_redaction_removed(tmp_path):
    audit = f'[audit]\npath = "{tmp_path / "audit.db"}"\ncontent = "redacted"\n'
    toml = config_text().replace("policies = []", 'policies = ["gdpr-redact"]', 1)
    app = App(parse_config(toml.replace(OFF, spend_toml(audit=audit)), source="<test>"))
    async with running(app) as client:
        card = "echo: my card is 4111 1111 1111 1111"
        r = await client.chat(chat_body(card), headers=auth(KEY_DAN))
        assert r.status == 200
    (row,) = rows(tmp_path / "audit.db")
    assert "4111" not in row["prompt"]
    assert "4111" not in row["reply"]
    assert "[CARD]" in row["prompt"]


class PriorityProbe(FlakyDatabase):
    """Notes the nice value and the name of the thread each insert runs in."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int]] = []

    def insert(self, rows: Sequence[Row]) -> None:
        me = threading.current_thread()
        self.seen.append((me.name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        super().insert(rows)


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own nice value is Linux's")
async def test_rows_are_written_by_a_thread_of_their_own_at_the_loops_priority():
    # Its own thread: the inserts run in order on one connection. At the loop's priority:
    # a writer set aside by the scheduler while it holds the GIL would stall the loop
    # (audit/thread.py), and no thread (the loop's, Trio's shared ones) is changed.
    db = PriorityProbe()
    log = AuditLog(AuditConfig(flush_ms=0), db, RowBuilder(b"k"), AuditMetrics(CollectorRegistry()))
    loop_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    async with trio.open_nursery() as nursery:
        await nursery.start(log.run)
        log.offer(outcome(0))
        await log.settle()
        shared = await trio.to_thread.run_sync(
            lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        )
        await log.aclose()
    assert db.seen == [("aiserve-audit-writer", loop_nice)]
    assert [r[0] for r in db.rows] == ["r0"]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == loop_nice
    assert shared == loop_nice


class HungDatabase(FlakyDatabase):
    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.returned = False

    def insert(self, rows: Sequence[Row]) -> None:
        self.release.wait(5)
        self.returned = True


async def test_a_hung_database_holds_shutdown_no_longer_than_the_grace(autojump_clock):
    db = HungDatabase()
    log = AuditLog(AuditConfig(flush_ms=0), db, RowBuilder(b"k"), AuditMetrics(CollectorRegistry()))
    log.grace = 2.0
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(log.run)
            log.offer(outcome(0))
            await trio.testing.wait_all_tasks_blocked()  # the insert is stuck in the thread
            started = trio.current_time()
            await log.aclose()
            assert trio.current_time() - started == pytest.approx(2.0)
            nursery.cancel_scope.cancel()  # the app's nursery ends: the call is abandoned
        assert trio.current_time() - started == pytest.approx(4.0)  # and close's grace
        assert not db.returned  # the app ended without waiting for the stuck insert
    finally:
        db.release.set()


async def test_a_usage_read_sees_the_rows_of_the_requests_made_before_it(mock_clock):
    # Rows gather for flush_ms before their batch is written; a reader does not wait that.
    # The virtual clock stands still while the thread writes (it moves only after a
    # whole real second with every task blocked): only flush() ends the gathering.
    mock_clock.autojump_threshold = 1.0
    db = FlakyDatabase()
    log = AuditLog(AuditConfig(flush_ms=60_000), db, RowBuilder(b"k"), AuditMetrics(CollectorRegistry()))
    async with trio.open_nursery() as nursery:
        await nursery.start(log.run)
        for i in range(3):
            log.offer(outcome(i))
        await trio.testing.wait_all_tasks_blocked()
        assert db.rows == []  # still gathering
        started = trio.current_time()
        await log.flush()
        assert [r[0] for r in db.rows] == ["r0", "r1", "r2"]
        assert trio.current_time() == started
        log.offer(outcome(3))  # and the next batch gathers again
        await trio.testing.wait_all_tasks_blocked()
        assert len(db.rows) == 3
        mock_clock.jump(60)
        await log.settle()
        await log.aclose()
    assert [r[0] for r in db.rows] == ["r0", "r1", "r2", "r3"]


async def test_shutdown_does_not_wait_for_the_batch_to_gather(mock_clock):
    mock_clock.autojump_threshold = 1.0  # time stands still while the thread writes
    db = FlakyDatabase()
    log = AuditLog(AuditConfig(flush_ms=60_000), db, RowBuilder(b"k"), AuditMetrics(CollectorRegistry()))
    async with trio.open_nursery() as nursery:
        await nursery.start(log.run)
        log.offer(outcome(0))
        await trio.testing.wait_all_tasks_blocked()  # gathering
        started = trio.current_time()
        await log.aclose()
        assert [r[0] for r in db.rows] == ["r0"]
        assert trio.current_time() == started


async def test_redacted_content_of_a_route_without_redaction_goes_through_the_defaults(
    tmp_path, caplog
):
    # Issue 51, item 5: `content = "redacted"` stored full card numbers and e-mails for a
    # route without a redaction policy, while start-up said "with redacted content". The
    # writer now puts such a row's prompt and reply through the default gdpr-redact
    # detectors, in its own thread, before it is stored.
    app = App(spend_config(tmp_path, audit_extra='content = "redacted"\n'))
    assert not app.config.routes[0].policies  # the route redacts nothing itself
    secret = "echo: card 4111 1111 1111 1111, mail ada.lovelace@example.com"
    caplog.set_level("INFO", logger="aiserve_trio.audit")
    async with running(app) as client:
        r = await client.chat(chat_body(secret), headers=auth(KEY_DAN))
        assert r.status == 200
        # The client got what the route let through: the echo, card and e-mail included.
        assert "4111 1111 1111 1111" in r.json()["choices"][0]["message"]["content"]
    (row,) = rows(tmp_path / "audit.db")
    for text in (row["prompt"], row["reply"]):
        assert "4111" not in text
        assert "ada.lovelace" not in text
        assert "example.com" not in text
        assert "[CARD]" in text
        assert "[EMAIL]" in text
    # Start-up says what is stored.
    assert "else by the default gdpr-redact detectors" in caplog.text


def test_a_number_across_the_cap_is_redacted_whole_never_stored_in_part():
    # The detectors see the text a little past the cap, so a card number the cap cuts
    # is found whole; one the kept text itself cuts is left out with the held-back tail.
    from aiserve_trio.policies.redact import build_rules
    from aiserve_trio.policies.stream import Rewriter

    rewriter = Rewriter(build_rules())
    builder = RowBuilder(b"k", content=True, max_chars=20, redactor=rewriter)
    card = "4111 1111 1111 1111"

    def stored(reply: str) -> dict[str, Any]:
        o = Outcome(request_id="r", route="chat", channel="api", arrival=0.0, ended=0.1,
                    status="ok", tenant="t", model="m", delivered=reply)
        (row,) = builder.redact([builder.row(o, 1.0)])
        return dict(zip(COLUMNS, row, strict=True))

    across = stored("x" * 10 + " " + card + " and more")  # the cap falls in the number
    assert across["reply"] == ("x" * 10 + " [CARD] and more")[:20]
    assert across["reply_chars"] == len("x" * 10 + " " + card + " and more")
    # The kept text (the cap and the detectors' reach) ends 7 characters into a number;
    # the 50 numbers before it shrink to tokens, which pulls that end within the cap.
    builder = RowBuilder(b"k", content=True, max_chars=1000, redactor=rewriter)
    # Words, not one long run: a long run of letters could still be an e-mail's local part.
    filler = ("yy " * rewriter.max_holdback)[: rewriter.max_holdback - 8]
    edge = (card + " ") * 50 + filler + " " + card + " end"
    assert edge[: 1000 + rewriter.max_holdback].endswith(" 4111 11")
    cut = stored(edge)
    assert "4111" not in cut["reply"]  # the half number is not stored ...
    # ... and what came before it is (the separator before a number may go with it,
    # as a match may start there).
    assert cut["reply"].rstrip() == ("[CARD] " * 50 + filler).rstrip()  # < 1000
    assert cut["reply_chars"] == len(edge)
    builder = RowBuilder(b"k", content=True, max_chars=20, redactor=rewriter)
    assert stored("short")["reply"] == "short"
    assert (stored("short")["reply_chars"]) is None
