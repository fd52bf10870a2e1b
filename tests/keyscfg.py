"""Configs for the database keys tests (issue 47): auth on, an audit database (SQLite in
a temporary directory), and keys of every role."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aiserve_trio.runtime.asgi import App
from aiserve_trio.security.auth import hash_key

from .asgi_client import Client, Response, chat_body
from .authcfg import KEY_A, KEY_ADMIN, KEY_B, auth_config, auth_toml

KEY_VIEW = "aik_vera_" + "v" * 32  # viewer, tenant bank-a
KEY_KM = "aik_kim_" + "k" * 32  # key-manager of team payments, tenant bank-a
KEY_USER = "aik_ulla_" + "u" * 32  # roles = ["user"], tenant bank-a
KEY_TADMIN = "aik_tara_" + "t" * 32  # admin of tenant bank-a only
#: The role keys of the walk: the global admin ``ops`` (authcfg), and these.
ROLE_KEYS = f"""
[[auth.keys]]
id = "vera"
hash = "{hash_key(KEY_VIEW)}"
tenant = "bank-a"
roles = ["viewer"]

[[auth.keys]]
id = "kim"
hash = "{hash_key(KEY_KM)}"
tenant = "bank-a"
team = "payments"
roles = ["key-manager"]

[[auth.keys]]
id = "ulla"
hash = "{hash_key(KEY_USER)}"
tenant = "bank-a"
roles = ["user"]

[[auth.keys]]
id = "tara"
hash = "{hash_key(KEY_TADMIN)}"
tenant = "bank-a"
admin = true
"""
__all__ = ["KEY_A", "KEY_ADMIN", "KEY_B"]


def keys_toml(tmp: Path, extra: str = "") -> str:
    audit = f'\n[audit]\npath = "{tmp / "audit.db"}"\nflush_ms = 50\n'
    return auth_toml(metrics="admin") + ROLE_KEYS + extra + audit


def keys_app(tmp: Path, extra: str = "") -> App:
    return App(auth_config(keys_toml(tmp, extra)))


def h(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def create(client: Client, by: str = KEY_ADMIN, **body: Any) -> Response:
    return await client.request("POST", "/admin/keys", json_body=body, headers=h(by))


async def chat(client: Client, key: str) -> Response:
    return await client.chat(chat_body(), h(key))
