"""A key's budget is its tenant's key's (issue 50, item 6, left over): the ledger's period
and its re-seed from the audit log are keyed by tenant and key, so a key id given again
in another tenant neither reads nor inherits the old key's spend -- in one worker, and
after a restart that seeds the ledger from the audit log."""

from __future__ import annotations

import time
from pathlib import Path

import trio

from aiserve_trio.config import parse_config
from aiserve_trio.runtime.asgi import App
from aiserve_trio.spend.budget import Limit
from aiserve_trio.spend.ledger import Ledger

from .asgi_client import chat_body
from .authcfg import OFF
from .conftest import config_text
from .spendcfg import KEY_CAROL, auth, running, spend_toml


async def test_one_key_id_in_two_tenants_is_two_ledger_periods() -> None:
    ledger = Ledger()
    shop = Limit("key", "carol", 1.0, "day", 0.8, "shop")
    bank = Limit("key", "carol", 1.0, "day", 0.8, "bank")
    now = time.time()
    await ledger.charge([shop], 0.7, now)
    assert await ledger.spent([shop, bank], now) == [0.7, 0.0]


def carol_in(tmp: Path, tenant: str) -> App:
    """The spend config (carol: a tiny daily budget) with carol in ``tenant``."""
    audit = f'[audit]\npath = "{tmp / "audit.db"}"\nretention_days = 30\n'
    toml = spend_toml(audit=audit).replace('tenant = "shop"', f'tenant = "{tenant}"', 1)
    return App(parse_config(config_text().replace(OFF, toml), source="<test>"))


async def test_a_key_id_given_again_in_another_tenant_starts_with_nothing(tmp_path: Path) -> None:
    first = carol_in(tmp_path, "shop")
    async with running(first) as client:
        with trio.fail_after(5):
            await first.gate.ledger.seeded.wait()
        assert (await client.chat(chat_body("echo: spend"), headers=auth(KEY_CAROL))).status == 200
        spent = await client.chat(chat_body("echo: more"), headers=auth(KEY_CAROL))
        assert spent.status == 429
    # Restarted: the same tenant's carol is still spent (seeded from the audit log) ...
    again = carol_in(tmp_path, "shop")
    async with running(again) as client:
        with trio.fail_after(5):
            await again.gate.ledger.seeded.wait()
        assert (await client.chat(chat_body("echo: hi"), headers=auth(KEY_CAROL))).status == 429
    # ... and a carol of another tenant is another key: nothing spent.
    other = carol_in(tmp_path, "bank")
    async with running(other) as client:
        with trio.fail_after(5):
            await other.gate.ledger.seeded.wait()
        r = await client.chat(chat_body("echo: mine"), headers=auth(KEY_CAROL))
        assert r.status == 200, r.body
