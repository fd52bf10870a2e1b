"""Budgets per key and tenant: calendar periods, 429 budget_exceeded naming the budget and its
reset, spend charged at request end, the overshoot bound, and the spend shared through Redis
(with a local fallback merged back when Redis returns)."""

from __future__ import annotations

import datetime as dt
import math
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import trio
from prometheus_client import CollectorRegistry

from aiserve_trio.config import ConfigError
from aiserve_trio.core.errors import BudgetExceeded
from aiserve_trio.runtime.asgi import App
from aiserve_trio.spend.budget import Limit, check, window
from aiserve_trio.spend.ledger import Ledger, LedgerMetrics

from .asgi_client import chat_body
from .redis_server import RedisServer
from .spendcfg import KEY_CAROL, KEY_DAN, auth, running, spend_config

RULES = Path(__file__).parent.parent / "configs" / "prometheus"


def utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0) -> float:
    return dt.datetime(year, month, day, hour, minute, tzinfo=dt.UTC).timestamp()


# --- periods and the check (pure) ----------------------------------------------------


def test_calendar_periods_in_utc():
    now = utc(2026, 12, 2, 15, 30)  # a Wednesday
    assert window("day", now).name == "2026-12-02"
    assert window("day", now).resets_at == utc(2026, 12, 3)
    assert window("week", now).resets_at == utc(2026, 12, 7)  # the next Monday
    assert window("month", now).name == "2026-12"
    assert window("month", now).resets_at == utc(2027, 1, 1)
    assert window("month", utc(2026, 1, 31, 23)).resets_at == utc(2026, 2, 1)
    assert window("total", now).resets_at == math.inf


def test_a_spent_budget_is_refused_naming_it_and_its_reset():
    limit = Limit("key", "carol", 1.0, "day", 0.8)
    now = utc(2026, 12, 2, 23, 0)
    check([limit], [0.99], now, "USD")  # below: admitted
    with pytest.raises(BudgetExceeded) as info:
        check([limit], [1.0], now, "USD")
    err = info.value
    assert (err.status, err.code, err.param) == (429, "budget_exceeded", "key:carol")
    assert "day budget of API key 'carol' (1 USD)" in err.message
    assert "resets at 2026-12-03T00:00:00Z" in err.message
    assert err.headers == {"Retry-After": "3600"}


def test_a_total_budget_never_resets_and_sends_no_retry_after():
    limit = Limit("tenant", "shop", 5.0, "total", 0.8)
    with pytest.raises(BudgetExceeded) as info:
        check([limit], [7.5], utc(2026, 12, 2), "EUR")
    assert "does not reset" in info.value.message
    assert info.value.param == "tenant:shop"
    assert info.value.headers == {}


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ("budget = -1.0", "budget"),
        ('budget_period = "year"', "budget_period"),
        ("budget_alert_at = 1.5", "budget_alert_at"),
    ],
)
def test_bad_budgets_are_refused_naming_the_key(toml, key):
    with pytest.raises(ConfigError, match=f"tenants.*{key}"):
        spend_config(tenant=f"[tenants.shop]\n{toml}\n")


# --- in the gateway -------------------------------------------------------------------------


async def test_a_key_over_its_budget_gets_429_until_the_day_resets(autojump_clock):
    app = App(spend_config())
    async with running(app) as client:
        ok = await client.chat(chat_body("echo: spend it"), headers=auth(KEY_CAROL))
        assert ok.status == 200
        refused = await client.chat(chat_body("echo: more"), headers=auth(KEY_CAROL))
        assert refused.status == 429
        error = refused.json()["error"]
        assert (error["code"], error["param"], error["type"]) == (
            "budget_exceeded", "key:carol", "insufficient_quota",
        )
        assert "resets at" in error["message"]
        assert 0 < int(refused.headers["retry-after"]) <= 86_400
        # Another key of the same tenant has no budget of its own.
        assert (await client.chat(chat_body("echo: hi"), headers=auth(KEY_DAN))).status == 200
        # A streamed request is refused before its head, in the same envelope.
        streamed = await client.chat(chat_body("echo: s", stream=True), headers=auth(KEY_CAROL))
        assert streamed.status == 429
    ratio = app.metrics.registry.get_sample_value(
        "aiserve_budget_used_ratio", {"scope": "key", "name": "carol"}
    )
    assert ratio is not None
    assert ratio >= 1.0


async def test_a_tenant_budget_counts_every_key_of_the_tenant(autojump_clock):
    tenant = '[tenants.shop]\nbudget = 0.00003\nbudget_period = "month"\n'
    app = App(spend_config(carol_budget="100.0", tenant=tenant))
    async with running(app) as client:
        a = await client.chat(chat_body("echo: one"), headers=auth(KEY_CAROL))
        b = await client.chat(chat_body("echo: two"), headers=auth(KEY_DAN))
        assert (a.status, b.status) == (200, 200)
        c = await client.chat(chat_body("echo: three"), headers=auth(KEY_DAN))
        assert c.status == 429
        assert c.json()["error"]["param"] == "tenant:shop"


async def test_racers_on_the_last_of_a_budget_are_held_off_by_the_first(autojump_clock):
    # Ten requests race the last of the budget: the first admitted holds its maximum
    # cost against it until it ends (issue 50, item 4), so the nine others are refused,
    # and the spend passes the budget by at most the one request's cost.
    app = App(spend_config(carol_budget="0.000001"))
    statuses: list[int] = []
    costs: list[float] = []
    held: list[str] = []

    async def one(client, i: int) -> None:
        r = await client.chat(chat_body(f"echo: racer {i}"), headers=auth(KEY_CAROL))
        statuses.append(r.status)
        costs.append(float(r.headers.get("x-aiserve-cost", "0")))
        if r.status == 429:
            held.append(r.json()["error"]["message"])

    async with running(app) as client:
        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(one, client, i)
        after = await client.chat(chat_body("echo: late"), headers=auth(KEY_CAROL))
        limit = app.gate.budgets.keys["carol"]
        (spent,) = await app.gate.ledger.spent([limit], time.time())
        assert app.gate.ledger.held([limit], time.time()) == [0.0]  # all let go
    assert sorted(statuses) == [200] + [429] * 9
    assert all("is held by its requests in flight" in m for m in held)
    assert after.status == 429
    assert spent == pytest.approx(sum(costs))
    assert spent - limit.amount <= max(costs)


# --- shared through Redis ------------------------------------------------------------


async def test_two_ledgers_share_spend_through_redis(redis_up: RedisServer):
    limit = Limit("key", "shared", 1.0, "day", 0.8)
    a, b = Ledger(redis_up.url, "budgettest1"), Ledger(redis_up.url, "budgettest1")
    await a.aopen()
    await b.aopen()
    try:
        now = time.time()
        await a.charge([limit], 0.4, now)
        await b.charge([limit], 0.7, now)
        assert await a.spent([limit], now) == [pytest.approx(1.1)]
        with pytest.raises(BudgetExceeded):
            check([limit], await b.spent([limit], now), now, "USD")
    finally:  # coredis: closed in the reverse order they were opened
        await b.aclose()
        await a.aclose()


async def test_a_redis_outage_keeps_spend_locally_and_merges_it_back(redis_up: RedisServer):
    limit = Limit("key", "outage", 10.0, "day", 0.8)
    registry = CollectorRegistry()
    ledger = Ledger(redis_up.url, "budgettest2")
    ledger.metrics = LedgerMetrics(registry)
    other = Ledger(redis_up.url, "budgettest2")
    await ledger.aopen()
    await other.aopen()
    try:
        now = time.time()
        await ledger.charge([limit], 1.0, now)
        redis_up.stop()
        await ledger.charge([limit], 2.0, now)  # kept here: never fails the request
        assert await ledger.spent([limit], now) == [pytest.approx(3.0)]
        local = registry.get_sample_value("aiserve_spend_ledger_local_total")
        assert local == 1
        redis_up.start()
        await ledger.charge([limit], 0.5, now)  # reaches Redis: the kept 2.0 goes too
        merged = registry.get_sample_value("aiserve_spend_ledger_merged_total")
        assert merged == 1
        # The test Redis keeps nothing across a restart: the 1.0 before the outage is
        # gone with it; what this gateway kept meanwhile (2.0) is back, with the 0.5.
        assert await other.spent([limit], now) == [pytest.approx(2.5)]
    finally:
        await other.aclose()
        await ledger.aclose()


def test_promtool_fires_the_budget_and_audit_alerts():
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool (Debian package prometheus) must be installed"
    out = subprocess.run(
        [promtool, "test", "rules", "aiserve-spend-rules.test.yml"],
        cwd=RULES, capture_output=True, text=True, timeout=60, check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


async def test_a_budget_is_shared_by_two_gateways_over_redis(redis_up: RedisServer):
    one = App(spend_config(redis=redis_up.url))
    two = App(spend_config(redis=redis_up.url))
    assert one.gate.ledger.shared
    async with running(one) as a, running(two) as b:
        assert (await a.chat(chat_body("echo: on one"), headers=auth(KEY_CAROL))).status == 200
        # The other gateway sees what the first one charged.
        refused = await b.chat(chat_body("echo: on two"), headers=auth(KEY_CAROL))
        assert refused.status == 429
        assert refused.json()["error"]["code"] == "budget_exceeded"


async def test_a_redis_outage_never_fails_a_request(redis_up: RedisServer):
    app = App(spend_config(carol_budget="100.0", redis=redis_up.url))
    async with running(app) as client:
        assert (await client.chat(chat_body("echo: before"), headers=auth(KEY_CAROL))).status == 200
        redis_up.stop()
        try:
            during = await client.chat(chat_body("echo: during"), headers=auth(KEY_CAROL))
        finally:
            redis_up.start()
        assert during.status == 200
        assert float(during.headers["x-aiserve-cost"]) > 0
    kept = app.metrics.registry.get_sample_value("aiserve_spend_ledger_local_total")
    assert kept == 1  # carol's charge; the tenant has no budget


@pytest.mark.slow
async def test_spend_kept_in_an_outage_is_merged_back_without_another_charge(
    redis_up: RedisServer,
):
    limit = Limit("key", "quiet", 10.0, "day", 0.8)
    registry = CollectorRegistry()
    ledger = Ledger(redis_up.url, "budgettest3", merge_every_s=0.05)
    ledger.metrics = LedgerMetrics(registry)
    await ledger.aopen()
    try:
        redis_up.stop()
        try:
            await ledger.charge([limit], 2.0, time.time())
        finally:
            redis_up.start()
        # No more charges: the background task merges it within a few of its rounds.
        with trio.move_on_after(1.0):
            await ledger.run()
        assert registry.get_sample_value("aiserve_spend_ledger_merged_total") == 1
    finally:
        await ledger.aclose()
    reader = Ledger(redis_up.url, "budgettest3")
    await reader.aopen()
    try:
        assert await reader.spent([limit], time.time()) == [pytest.approx(2.0)]
    finally:
        await reader.aclose()


async def test_with_auth_off_the_routes_tenant_budget_applies(autojump_clock):
    from aiserve_trio.config import parse_config

    from .conftest import config_text
    from .spendcfg import PRICES

    budget = '[tenants.default]\nbudget = 0.00001\nbudget_period = "week"\n'
    app = App(parse_config(config_text() + PRICES + budget, source="<test>"))
    async with running(app) as client:
        assert (await client.chat(chat_body("echo: first"))).status == 200
        refused = await client.chat(chat_body("echo: second"))
    assert refused.status == 429
    assert refused.json()["error"]["param"] == "tenant:default"
    assert "week budget of tenant 'default'" in refused.json()["error"]["message"]
