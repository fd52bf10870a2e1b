"""Budgets hold across workers without Redis (issue 50, item 3): two workers on one SQLite
audit database see each other's spend through it -- each reads every budget's period back
every ``sync_every_s`` -- and a config whose audit log would delete rows a budget still
counts is refused at start, saying why."""

from __future__ import annotations

import http.client
import itertools
import json
import time
from pathlib import Path

import pytest
import trio
import trio.testing

from aiserve_trio.config import parse_config
from aiserve_trio.core.errors import ConfigError
from aiserve_trio.runtime.asgi import App
from aiserve_trio.spend.budget import Limit
from aiserve_trio.spend.ledger import SYNC_EVERY_S, SYNC_SHARE, Ledger

from .asgi_client import chat_body
from .authcfg import OFF
from .conftest import config_text
from .pg_server import postgres_server, postgres_up  # noqa: F401
from .servers import hypercorn_gateway
from .spendcfg import KEY_CAROL, KEY_DAN, KEY_OPS, auth, running, spend_config, spend_toml
from .test_audit_postgres import database  # noqa: F401


async def test_a_budget_spent_on_one_worker_is_refused_on_the_other(tmp_path: Path) -> None:
    one, two = App(spend_config(tmp_path)), App(spend_config(tmp_path))  # one audit file
    two.gate.ledger.sync_every_s = 0.05  # the bound under test, shortened
    async with running(one) as first, running(two) as second:
        with trio.fail_after(5):
            await one.gate.ledger.seeded.wait()
            await two.gate.ledger.seeded.wait()
        ok = await first.chat(chat_body("echo: spend it"), headers=auth(KEY_CAROL))
        assert ok.status == 200
        assert (await first.chat(chat_body("echo: more"), headers=auth(KEY_CAROL))).status == 429
        assert one.audit is not None
        await one.audit.flush()  # the other worker's rows: written within its flush_ms
        with trio.fail_after(5):
            await two.gate.ledger.synced()  # one read may have begun before the flush
            await two.gate.ledger.synced()
        refused = await second.chat(chat_body("echo: there"), headers=auth(KEY_CAROL))
        assert refused.status == 429
        assert refused.json()["error"]["param"] == "key:carol"
        # The tenant has no budget: another key of it is still served on both.
        assert (await second.chat(chat_body("echo: hi"), headers=auth(KEY_DAN))).status == 200


async def test_on_postgresql_too_across_workers_and_a_restart(
    database: str,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AISERVE_TEST_AUDIT_DSN", database)
    extra = 'backend = "postgres"\ndsn_env = "AISERVE_TEST_AUDIT_DSN"\n'
    one, two = (App(spend_config(tmp_path, audit_extra=extra)) for _ in range(2))
    two.gate.ledger.sync_every_s = 0.05
    async with running(one) as first, running(two) as second:
        with trio.fail_after(5):
            await one.gate.ledger.seeded.wait()
            await two.gate.ledger.seeded.wait()
        assert (await first.chat(chat_body("echo: spend"), headers=auth(KEY_CAROL))).status == 200
        assert one.audit is not None
        await one.audit.flush()
        with trio.fail_after(5):
            await two.gate.ledger.synced()
            await two.gate.ledger.synced()
        refused = await second.chat(chat_body("echo: there"), headers=auth(KEY_CAROL))
        assert refused.status == 429
    restarted = App(spend_config(tmp_path, audit_extra=extra))  # a deploy: a new worker
    async with running(restarted) as client:
        with trio.fail_after(5):
            await restarted.gate.ledger.seeded.wait()
        again = await client.chat(chat_body("echo: after"), headers=auth(KEY_CAROL))
        assert again.status == 429
        assert again.json()["error"]["param"] == "key:carol"


async def test_each_worker_counts_the_others_spend_once(tmp_path: Path) -> None:
    # carol spends on both workers; each one's ledger ends at the sum of the audit rows,
    # neither missing the other's charges nor counting its own twice.
    budget = "1.0"
    one = App(spend_config(tmp_path, carol_budget=budget))
    two = App(spend_config(tmp_path, carol_budget=budget))
    for app in (one, two):
        app.gate.ledger.sync_every_s = 0.05
    async with running(one) as first, running(two) as second:
        with trio.fail_after(5):
            await one.gate.ledger.seeded.wait()
            await two.gate.ledger.seeded.wait()
        costs = []
        for i in range(3):
            for client in (first, second, second):
                r = await client.chat(chat_body(f"echo: word {i}"), headers=auth(KEY_CAROL))
                assert r.status == 200
                costs.append(float(r.headers["x-aiserve-cost"]))
        for app in (one, two):
            assert app.audit is not None
            await app.audit.flush()
        with trio.fail_after(5):
            for app in (one, two):
                await app.gate.ledger.synced()
                await app.gate.ledger.synced()
        limits = one.gate.budgets.limits("carol", "shop")
        for app in (one, two):
            [spent] = await app.gate.ledger.spent(limits, time.time())
            assert spent == pytest.approx(sum(costs), rel=1e-9)


def test_the_stated_bound_is_a_second() -> None:
    # docs/guides/spend.md states flush_ms + SYNC_EVERY_S + a query.
    assert SYNC_EVERY_S == 1.0


_TENANT = '[tenants.shop]\nbudget = 1.0\nbudget_period = "{}"\n'


@pytest.mark.parametrize(
    ("tenant", "retention", "named"),
    [
        (_TENANT.format("month"), 30, "month budget of tenant 'shop'"),
        (_TENANT.format("week"), 6, "week budget of tenant 'shop'"),
        (_TENANT.format("total"), 3650, "total budget of tenant 'shop'"),
    ],
)
def test_an_audit_log_that_forgets_a_budgets_rows_is_refused(
    tmp_path: Path, tenant: str, retention: int, named: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        _config(tmp_path, tenant, f"retention_days = {retention}\n")
    text = str(refused.value)
    assert "audit.retention_days" in text
    assert named in text
    assert "a restart would forget it" in text


def test_a_retention_as_long_as_the_period_or_redis_is_accepted(tmp_path: Path) -> None:
    month = _TENANT.format("month")
    _config(tmp_path, month, "retention_days = 31\n")
    _config(tmp_path, month, "retention_days = 0\n")
    total = _TENANT.format("total")
    _config(tmp_path, total, "retention_days = 0\n")
    spend_config(tmp_path, tenant=total, redis="redis://127.0.0.1:1")  # Redis keeps it


def _config(tmp: Path, tenant: str, retention: str) -> None:
    """spend_config with the audit log's retention replaced."""
    audit = f'[audit]\npath = "{tmp / "audit.db"}"\n{retention}'
    parse_config(config_text().replace(OFF, spend_toml(audit=audit, tenant=tenant)))


def _chat(conn: http.client.HTTPConnection, key: str) -> int:
    """One chat request on ``conn`` (kept alive: the same worker answers): its status."""
    body = json.dumps(chat_body("echo: hi"))
    conn.request(
        "POST", "/v1/chat/completions", body, {**auth(key), "content-type": "application/json"}
    )
    r = conn.getresponse()
    r.read()
    return int(r.status)


def _carol_spent_here(conn: http.client.HTTPConnection) -> bool:
    """Whether the worker ``conn`` is on charged carol itself (its own counter)."""
    conn.request("GET", "/metrics", headers=auth(KEY_OPS))
    r = conn.getresponse()
    text = r.read().decode()
    return any(
        line.startswith("aiserve_spend_total{") and 'key="carol"' in line
        for line in text.splitlines()
    )


def test_two_hypercorn_workers_on_one_audit_file_keep_one_budget(tmp_path: Path) -> None:
    # `--workers 2`, no Redis: carol's tiny daily budget is spent by her first request on
    # one worker; once the rows are written (flush_ms = 100) and read back (1 s), the
    # other worker refuses her too -- before, it served her until it had spent the budget
    # once more itself. The other worker is found by its metrics: it has no spend of
    # carol's of its own.
    audit = f'[audit]\npath = "{tmp_path / "audit.db"}"\nretention_days = 30\nflush_ms = 100\n'
    cfg = tmp_path / "aiserve.toml"
    cfg.write_text(config_text().replace(OFF, spend_toml(audit=audit)))
    with hypercorn_gateway(cfg, extra_args=["--workers", "2"]) as (base, _):
        port = int(base.rsplit(":", 1)[1])
        conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=10) for _ in range(17)]
        try:
            first, rest = conns[0], conns[1:]
            assert _chat(first, KEY_CAROL) == 200
            time.sleep(0.1 + SYNC_EVERY_S + 1.0)  # the stated bound, and a query's margin
            others = [c for c in rest if not _carol_spent_here(c)]
            assert others, "every connection went to the worker that served carol"
            assert [_chat(c, KEY_CAROL) for c in others] == [429] * len(others)
            dan = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conns.append(dan)  # a refusal before the body is read closes its connection
            assert _chat(dan, KEY_DAN) == 200
        finally:
            for c in conns:
                c.close()


async def test_a_slow_read_back_is_made_ten_times_less_often(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A period's sum that takes 0.5 s (a big audit table): the next waits 5 s, not 1 s --
    # the database is read a tenth of the time at most.
    starts: list[float] = []

    async def slow(scope: str, name: str | None, start: float, end: float) -> dict[str, float]:
        starts.append(trio.current_time())
        await trio.sleep(0.5)
        return {"carol": 0.5}

    limit = Limit("key", "carol", 1.0, "day", 0.8)
    ledger = Ledger(seed=slow, limits=[limit])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ledger.run)
        for _ in range(3):
            await ledger.synced()
        nursery.cancel_scope.cancel()
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    # The start-up seed, then reads 10 x 0.5 s after each one ended.
    assert gaps[1:] == [pytest.approx(0.5 + SYNC_SHARE * 0.5)] * (len(gaps) - 1)
    assert SYNC_SHARE * 0.5 > SYNC_EVERY_S
    assert await ledger.spent([limit], time.time()) == [0.5]
