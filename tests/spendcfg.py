"""Configs for the spend, budget and audit tests: prices, keys with budgets, an audit file."""

from __future__ import annotations

from pathlib import Path

from aiserve_trio.config import Config, parse_config
from aiserve_trio.security.auth import hash_key

from .authcfg import OFF
from .conftest import config_text
from .sim_gateway import running as running  # the app started, its writers flushed at the end

KEY_CAROL = "aik_carol_" + "d" * 32  # tenant shop, a tiny daily budget
KEY_DAN = "aik_dan_" + "e" * 32  # tenant shop, no budget of its own
KEY_OPS = "aik_ops_" + "f" * 32  # admin
_H = {k: hash_key(k) for k in (KEY_CAROL, KEY_DAN, KEY_OPS)}

PRICES = """
[pricing]
currency = "USD"
[pricing.models."aiserve-mock"]
input_per_mtok = 3.0
output_per_mtok = 15.0
"""


def spend_toml(*, carol_budget: str = "0.00001", tenant: str = "", audit: str = "") -> str:
    return f"""[auth]
enabled = true
token_secret_env = "AISERVE_TEST_TOKEN_SECRET_UNSET"

[[auth.keys]]
id = "carol"
hash = "{_H[KEY_CAROL]}"
tenant = "shop"
budget = {carol_budget}
budget_period = "day"

[[auth.keys]]
id = "dan"
hash = "{_H[KEY_DAN]}"
tenant = "shop"

[[auth.keys]]
id = "ops"
hash = "{_H[KEY_OPS]}"
tenant = "shop"
admin = true
global_admin = true
{PRICES}
{tenant}
{audit}
"""


def spend_config(
    tmp: Path | None = None, *, audit_extra: str = "", redis: str | None = None, **kw: str
) -> Config:
    audit = ""
    if tmp is not None:
        audit = f'[audit]\npath = "{tmp / "audit.db"}"\nretention_days = 30\n{audit_extra}'
    text = config_text().replace(OFF, spend_toml(audit=audit, **kw))
    if redis is not None:  # the session bus (and so the spend) in this Redis
        sessions = f'[sessions]\nbackend = "redis"\nurl = "{redis}"\nkey_prefix = "spendtest"\n'
        text = text.replace('[sessions]\nbackend = "memory"\n', sessions, 1)
    return parse_config(text, source="<test>")


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}
