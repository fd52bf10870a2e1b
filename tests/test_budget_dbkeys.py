"""A database key's budget holds across a restart and across workers without Redis, as a
config key's does (issue 47's keys, issue 50 item 3): the memory ledger seeds and re-reads
the database keys' budgets from the audit log too, not only the config's."""

from __future__ import annotations

from pathlib import Path

import trio

from aiserve_trio.config import parse_config
from aiserve_trio.runtime.asgi import App

from .authcfg import OFF
from .conftest import config_text
from .keyscfg import chat, create, keys_app, keys_toml
from .redis_server import RedisServer
from .sim_gateway import running
from .spendcfg import PRICES


async def settled(app: App) -> None:
    """The ledger seeded, then one full read of the audit log's sums done since."""
    with trio.fail_after(5):
        await app.gate.ledger.seeded.wait()
        await app.gate.ledger.synced()  # one may have begun before the last rows
        await app.gate.ledger.synced()


async def test_a_spent_database_key_stays_spent_after_a_restart(tmp_path: Path) -> None:
    first = keys_app(tmp_path, PRICES)
    async with running(first) as client:
        made = (await create(client, budget=0.00001, budget_period="day")).json()
        assert (await chat(client, made["key"])).status == 200  # it spends the budget
        assert (await chat(client, made["key"])).status == 429
    restarted = keys_app(tmp_path, PRICES)  # a deploy: a new worker, the same database
    restarted.gate.ledger.sync_every_s = 0.05
    async with running(restarted) as client:
        await settled(restarted)
        r = await chat(client, made["key"])
        assert r.status == 429, r.body
        assert r.json()["error"]["param"] == f"key:{made['id']}"


async def test_a_database_key_spent_on_one_worker_is_refused_on_the_other(
    tmp_path: Path,
) -> None:
    one, two = keys_app(tmp_path, PRICES), keys_app(tmp_path, PRICES)
    two.gate.ledger.sync_every_s = 0.05
    async with running(one) as first, running(two) as second:
        made = (await create(first, budget=0.00001, budget_period="day")).json()
        assert (await chat(first, made["key"])).status == 200
        assert one.audit is not None
        await one.audit.flush()
        with trio.fail_after(5):  # the other worker's table has the key
            while made["id"] not in (two.gate.dbkeys or ()):  # noqa: ASYNC110 (its poll)
                await trio.sleep(0.05)
        await settled(two)
        assert (await chat(second, made["key"])).status == 429


def redis_app(tmp: Path, redis: str) -> App:
    text = config_text().replace(OFF, keys_toml(tmp, PRICES))
    sessions = f'[sessions]\nbackend = "redis"\nurl = "{redis}"\nkey_prefix = "dbkeyspend"\n'
    assert '[sessions]\nbackend = "memory"\n' in text
    return App(parse_config(text.replace('[sessions]\nbackend = "memory"\n', sessions, 1)))


async def test_with_redis_a_database_keys_spend_is_in_redis_for_every_worker(
    tmp_path: Path, redis_up: RedisServer
) -> None:
    # The config has no budget of its own: the database keys' alone make the ledger shared.
    one, two = redis_app(tmp_path, redis_up.url), redis_app(tmp_path, redis_up.url)
    assert one.gate.ledger.shared
    async with running(one) as first, running(two) as second:
        made = (await create(first, budget=0.00001, budget_period="day")).json()
        assert (await chat(first, made["key"])).status == 200
        with trio.fail_after(5):  # the other worker's table has the key
            while made["id"] not in (two.gate.dbkeys or ()):  # noqa: ASYNC110 (its poll)
                await trio.sleep(0.05)
        # No wait for a read-back: the charge is in Redis, read at the check.
        assert (await chat(second, made["key"])).status == 429
