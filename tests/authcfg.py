"""Configs with auth on, for the security tests: three keys, two tenants."""

from __future__ import annotations

from aiserve_trio.config import Config, parse_config
from aiserve_trio.runtime.asgi import App
from aiserve_trio.security.auth import hash_key

from .conftest import config_text

KEY_A = "aik_alice_" + "a" * 32  # tenant bank-a, app and web only, chat route
KEY_B = "aik_bob_" + "b" * 32  # tenant bank-b
KEY_ADMIN = "aik_ops_" + "c" * 32  # tenant bank-a, admin
_H = {k: hash_key(k) for k in (KEY_A, KEY_B, KEY_ADMIN)}
OFF = "[auth]\nenabled = false\n"


def auth_toml(*, rpm: int = 0, tpm: int = 0, metrics: str = "open", extra: str = "") -> str:
    return f"""[auth]
enabled = true
metrics = "{metrics}"
token_secret_env = "AISERVE_TEST_TOKEN_SECRET_UNSET"
{extra}
[[auth.keys]]
id = "alice"
hash = "{_H[KEY_A]}"
tenant = "bank-a"
routes = ["/v1/chat/completions"]
channels = ["app", "web"]
rpm = {rpm}
tpm = {tpm}

[[auth.keys]]
id = "bob"
hash = "{_H[KEY_B]}"
tenant = "bank-b"

[[auth.keys]]
id = "ops"
hash = "{_H[KEY_ADMIN]}"
tenant = "bank-a"
admin = true
global_admin = true
"""


def auth_config(auth: str | None = None, **values: str) -> Config:
    """The default config (fast mock) with ``[auth]`` replaced and ``values`` set
    (each replaces the first ``key = ...`` line, e.g. ``max_inflight="2"``)."""
    text = config_text(**values)
    assert OFF in text
    text = text.replace(OFF, auth if auth is not None else auth_toml())
    return parse_config(text, source="<test>")


def auth_app(auth: str | None = None, **values: str) -> App:
    return App(auth_config(auth, **values))


def bearer(key: str, **extra: str) -> dict[str, str]:
    """The headers of a request with ``key``; alice's say which of her two channels
    (``app`` unless ``extra`` says otherwise), as a key limited to several must."""
    if key == KEY_A:
        extra.setdefault("x-channel", "app")
    return {"authorization": f"Bearer {key}", **extra}
