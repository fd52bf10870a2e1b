"""Budgets survive lost spend (issue 55, item 5): Redis restarted empty, a FLUSHALL, or a
worker restarted with the memory ledger -- a spent key stays refused, its period's spend
re-seeded from the audit log (a real SQLite audit database, a real Redis, through the app)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import trio

from aiserve_trio.runtime.asgi import App
from aiserve_trio.spend.budget import Limit, window
from aiserve_trio.spend.ledger import Ledger

from .asgi_client import chat_body
from .redis_server import RedisServer
from .spendcfg import KEY_CAROL, KEY_DAN, auth, running, spend_config


def carol_key() -> str:
    """carol's day in the test Redis (spend_config's key_prefix)."""
    return f"spendtest:spend:key:shop/carol:{window('day', time.time()).name}"


async def spend_carols_budget(app: App) -> None:
    async with running(app) as client:
        ok = await client.chat(chat_body("echo: spend it"), headers=auth(KEY_CAROL))
        assert ok.status == 200
        refused = await client.chat(chat_body("echo: more"), headers=auth(KEY_CAROL))
        assert refused.status == 429


def redis_get(redis: RedisServer, key: str | None = None) -> float | None:
    """A spend key's value in Redis, carol's by default (None: the key is missing)."""
    with socket.create_connection(("127.0.0.1", redis.port), timeout=1) as s:
        s.sendall(f"GET {key or carol_key()}\r\n".encode())
        head, _, rest = s.recv(4096).partition(b"\r\n")
    return None if head == b"$-1" else float(rest.split(b"\r\n")[0])


async def seeded_value(redis: RedisServer, key: str | None = None, within: float = 5.0) -> float:
    """A spend key's value (carol's) once some worker has written it back to Redis."""
    with trio.fail_after(within):
        while True:  # another process's state: nothing to wait on but a poll
            if (value := redis_get(redis, key)) is not None:
                return value
            await trio.sleep(0.02)


async def test_redis_restarted_empty_a_spent_key_stays_refused(
    redis_up: RedisServer, tmp_path: Path
) -> None:
    redis_up.command("FLUSHALL")
    app = App(spend_config(tmp_path, redis=redis_up.url))
    async with running(app) as client:
        assert (await client.chat(chat_body("echo: a"), headers=auth(KEY_CAROL))).status == 200
        refused = await client.chat(chat_body("echo: b"), headers=auth(KEY_CAROL))
        assert refused.status == 429
        spent = await seeded_value(redis_up)
        assert spent > 0.00001
        redis_up.restart()  # no persistence: every spend key is gone
        assert redis_up.command("EXISTS", carol_key()) == b":0"
        again = await client.chat(chat_body("echo: c"), headers=auth(KEY_CAROL))
        assert again.status == 429, "the spent key spent its budget again"
        assert again.json()["error"]["code"] == "budget_exceeded"
        # Another key of the tenant has no budget: still served.
        assert (await client.chat(chat_body("echo: d"), headers=auth(KEY_DAN))).status == 200
        # The period's spend is back in Redis, from the audit log.
        assert await seeded_value(redis_up) >= spent * 0.999
    # A worker that never saw carol's spend reads it from Redis.
    fresh = App(spend_config(tmp_path, redis=redis_up.url))
    async with running(fresh) as client:
        late = await client.chat(chat_body("echo: e"), headers=auth(KEY_CAROL))
        assert late.status == 429


async def test_a_flushall_then_a_new_worker_a_spent_key_stays_refused(
    redis_up: RedisServer, tmp_path: Path
) -> None:
    redis_up.command("FLUSHALL")
    await spend_carols_budget(App(spend_config(tmp_path, redis=redis_up.url)))
    before = await seeded_value(redis_up)
    redis_up.command("FLUSHALL")
    fresh = App(spend_config(tmp_path, redis=redis_up.url))
    async with running(fresh) as client:
        # The first check finds the key missing and queues a re-seed (it does not wait
        # for the database); once seeded, the key is refused.
        first = await client.chat(chat_body("echo: first"), headers=auth(KEY_CAROL))
        cost = float(first.headers.get("x-aiserve-cost", "0")) if first.status == 200 else 0.0
        await seeded_value(redis_up)
        late = await client.chat(chat_body("echo: second"), headers=auth(KEY_CAROL))
        assert late.status == 429
    # Seeded once (SET NX), from the audit rows: the spend before the flush, plus what
    # the fresh worker's first request cost if it was admitted in the reseed's lag.
    assert await seeded_value(redis_up) == pytest.approx(before + cost, rel=1e-6)


async def test_the_memory_ledger_restarted_a_spent_key_stays_refused(tmp_path: Path) -> None:
    await spend_carols_budget(App(spend_config(tmp_path)))
    restarted = App(spend_config(tmp_path))  # a new worker on the same audit database
    async with running(restarted) as client:
        with trio.fail_after(5):
            await restarted.gate.ledger.seeded.wait()
        refused = await client.chat(chat_body("echo: after"), headers=auth(KEY_CAROL))
        assert refused.status == 429
        assert refused.json()["error"]["param"] == "key:carol"
        assert (await client.chat(chat_body("echo: hi"), headers=auth(KEY_DAN))).status == 200


def test_a_period_knows_where_it_began() -> None:
    # The re-seed sums the audit rows from the period's start.
    w = window("week", 1_764_979_200.0 + 3 * 86_400 + 5)  # Sat 2025-12-06 + ...
    assert w.resets_at - w.starts_at == 7 * 86_400
    assert w.starts_at <= 1_764_979_200.0 + 3 * 86_400 + 5 < w.resets_at
    assert window("total", 5.0).starts_at == 0.0


async def test_redis_back_empty_after_an_outage_the_kept_spend_is_seeded_not_lost(
    redis_up: RedisServer,
) -> None:
    # Spend charged before the outage (in Redis) and during it (kept here); Redis comes
    # back without persistence. The merge finds the key missing: the period is seeded
    # from the audit log -- which holds every one of those requests -- not restarted
    # from what this worker kept.
    limit = Limit("key", "outage", 10.0, "day", 0.8)
    asked: list[tuple[str, str | None]] = []

    async def audit_sum(scope: str, name: str | None, start: float, end: float) -> dict[str, float]:
        asked.append((scope, name))
        assert start <= time.time() < end
        return {"outage": 3.0}  # the 1.0 before the outage and the 2.0 during it

    ledger = Ledger(redis_up.url, "reseedtest", merge_every_s=0.05)
    ledger.seed_from(audit_sum, [limit])
    await ledger.aopen()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ledger.run)
            now = time.time()
            redis_up.command("SET", f"reseedtest:spend:{limit.slot(now)[0]}", "1.0")
            assert await ledger.spent([limit], now) == [pytest.approx(1.0)]
            redis_up.stop()
            await ledger.charge([limit], 2.0, now)  # kept here
            redis_up.start()  # empty
            assert await seeded_value(redis_up, f"reseedtest:spend:{limit.slot(now)[0]}") == 3.0
            assert await ledger.spent([limit], now) == [pytest.approx(3.0)]
            nursery.cancel_scope.cancel()
    finally:
        await ledger.aclose()
    assert asked[:1] == [("key", "outage")]

