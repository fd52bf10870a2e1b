"""Two gateway processes on one audit database file -- two hosts, simulated (issue 47,
item 2): a key created through one is served by the other within the stated bound, and
once revoked through the other is refused by the first within it -- no Redis, the
database poll only."""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path

import pytest

from aiserve_trio.security.keystore.service import POLL_S

from .asgi_client import chat_body
from .authcfg import OFF
from .conftest import config_text
from .keyscfg import KEY_ADMIN, h, keys_toml
from .servers import hypercorn_gateway

pytestmark = pytest.mark.slow

#: The stated bound (a poll) and a query's margin on a loaded machine.
BOUND_S = POLL_S + 1.0


def _call(conn: http.client.HTTPConnection, method: str, path: str, key: str,
          body: object = None) -> tuple[int, bytes]:  # fmt: skip
    payload = json.dumps(body) if body is not None else None
    conn.request(method, path, payload, {**h(key), "content-type": "application/json"})
    r = conn.getresponse()
    return int(r.status), r.read()


def _chat(base: str, key: str) -> int:
    """One chat on a fresh connection (a refused key may close its connection)."""
    conn = http.client.HTTPConnection("127.0.0.1", int(base.rsplit(":", 1)[1]), timeout=10)
    try:
        return _call(conn, "POST", "/v1/chat/completions", key, chat_body("echo: hi"))[0]
    finally:
        conn.close()


def test_two_gateway_processes_share_the_keys_within_the_bound(tmp_path: Path) -> None:
    cfg = tmp_path / "aiserve.toml"
    cfg.write_text(config_text().replace(OFF, keys_toml(tmp_path)))
    with hypercorn_gateway(cfg) as (one, _), hypercorn_gateway(cfg) as (two, _):
        conn = http.client.HTTPConnection("127.0.0.1", int(one.rsplit(":", 1)[1]), timeout=10)
        try:
            status, body = _call(conn, "POST", "/admin/keys", KEY_ADMIN, {"label": "hosts"})
        finally:
            conn.close()
        assert status == 201, body
        made = json.loads(body)
        assert _chat(one, made["key"]) == 200  # the process that made it: at once
        time.sleep(BOUND_S)
        assert _chat(two, made["key"]) == 200  # the other: after its poll
        conn = http.client.HTTPConnection("127.0.0.1", int(two.rsplit(":", 1)[1]), timeout=10)
        try:
            path = f"/admin/keys/{made['id']}/revoke"
            assert _call(conn, "POST", path, KEY_ADMIN)[0] == 200
        finally:
            conn.close()
        assert _chat(two, made["key"]) == 401
        time.sleep(BOUND_S)
        assert _chat(one, made["key"]) == 401
