"""Two hypercorn worker processes on one audit database file (issue 47, item 2): a key
created through one is served by both within the stated bound, and once revoked through
one is refused by both within it -- no Redis, the database poll only."""

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


def _served(conn: http.client.HTTPConnection) -> float:
    """The chat requests the worker on ``conn`` has answered (its own counter)."""
    status, body = _call(conn, "GET", "/metrics", KEY_ADMIN)
    assert status == 200
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in body.decode().splitlines()
        if line.startswith("aiserve_requests_total{")
    )


def test_two_worker_processes_share_the_keys_within_the_bound(tmp_path: Path) -> None:
    cfg = tmp_path / "aiserve.toml"
    cfg.write_text(config_text().replace(OFF, keys_toml(tmp_path)))
    with hypercorn_gateway(cfg, extra_args=["--workers", "2"]) as (base, _):
        port = int(base.rsplit(":", 1)[1])
        conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=10) for _ in range(12)]
        try:
            chat = chat_body("echo: hi")
            for _ in range(3):  # requests on conns[0]'s worker only
                assert _call(conns[0], "POST", "/v1/chat/completions", KEY_ADMIN, chat)[0] == 200
            # The connections of the other worker: its request counter has none of those.
            others = [c for c in conns if _served(c) == 0]
            assert others, "every connection went to one worker"
            status, body = _call(conns[0], "POST", "/admin/keys", KEY_ADMIN, {"label": "w"})
            assert status == 201, body
            made = json.loads(body)
            time.sleep(BOUND_S)
            statuses = [_call(c, "POST", "/v1/chat/completions", made["key"], chat)[0]
                        for c in conns]  # fmt: skip
            assert statuses == [200] * len(conns)  # the other worker's included
            status, _ = _call(conns[0], "POST", f"/admin/keys/{made['id']}/revoke", KEY_ADMIN)
            assert status == 200
            time.sleep(BOUND_S)
            statuses = [_call(c, "POST", "/v1/chat/completions", made["key"], chat)[0]
                        for c in conns]  # fmt: skip
            assert statuses == [401] * len(conns)
        finally:
            for c in conns:
                c.close()
