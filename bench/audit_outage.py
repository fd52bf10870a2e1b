"""A PostgreSQL outage under load, from outside (issue 55, "threads and the audit database").

3,000 chats at 50 a second through a real hypercorn worker whose audit log writes to a
real PostgreSQL, stopped for 21 s from t = 20 s and started again; then the rows in the
database, ``/v1/usage``'s total and the audit metrics. While the database is stopped,
``/v1/usage`` is asked every 500 chats.

    .venv/bin/python -m bench.audit_outage

Run it on a checkout of an older commit (its ``src`` first on ``PYTHONPATH``) for the
figures before a change. Before failed batches were kept: 1,916 of 3,000 rows, and
``/v1/usage`` said 1,916 with no sign of the gap (and 500 with an empty body while the
database was away); now 3,000 of 3,000, and 503 ``audit_unavailable`` with
``Retry-After`` meanwhile.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from pathlib import Path

import httpx
import psycopg
from tests.conftest import config_text
from tests.pg_server import PostgresServer
from tests.servers import hypercorn_gateway
from tests.spendcfg import PRICES

CHATS = 3000
RATE = 50  # chats a second
STOP_AT_S, START_AT_S = 20.0, 41.0


def drive(base: str, pg: PostgresServer, client: httpx.Client) -> int:
    """The chats, paced, with the database stopped and started on the way; 200s served."""
    body = {"model": "aiserve-mock", "messages": [{"role": "user", "content": "echo: hi"}]}
    served = 0
    t0 = time.monotonic()
    stopped = started = False
    for i in range(CHATS):
        wait = t0 + i / RATE - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        elapsed = time.monotonic() - t0
        if elapsed >= STOP_AT_S and not stopped:
            pg.kill()
            stopped = True
            print(f"PostgreSQL stopped at {elapsed:.1f} s", flush=True)
        if elapsed >= START_AT_S and not started:
            pg.start()
            started = True
            print(f"PostgreSQL started at {elapsed:.1f} s", flush=True)
        if stopped and not started and i % 500 == 0:
            u = client.get(base + "/v1/usage")
            print("usage while stopped:", u.status_code, u.headers.get("retry-after"), u.text[:160])
        r = client.post(base + "/v1/chat/completions", json=body)
        served += r.status_code == 200
    print(f"served 200: {served} of {CHATS} in {time.monotonic() - t0:.1f} s", flush=True)
    return served


def main() -> None:
    pg = PostgresServer()
    pg.init()
    pg.start()
    try:
        name = f"audit_{secrets.token_hex(4)}"
        with psycopg.connect(pg.dsn, autocommit=True) as c:
            c.execute(f"CREATE DATABASE {name}")
        dsn = pg.dsn.rsplit("/", 1)[0] + "/" + name
        cfg = Path(tempfile.mkdtemp()) / "outage.toml"
        audit = '[audit]\nbackend = "postgres"\ndsn_env = "OUTAGE_DSN"\n'
        cfg.write_text(config_text() + PRICES + audit)
        env = {"OUTAGE_DSN": dsn, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        with hypercorn_gateway(cfg, env=env) as (base, _), httpx.Client(timeout=10) as client:
            drive(base, pg, client)
            time.sleep(12)  # the writer's backoff is at most 5 s
            with psycopg.connect(dsn) as c:
                row = c.execute("SELECT count(*) FROM audit_requests").fetchone()
            u = client.get(base + "/v1/usage")
            print("rows in the database:", row[0] if row else None)
            total = u.json().get("total", {}).get("requests")
            partial = u.json().get("partial"), u.headers.get("x-aiserve-usage-partial")
            print("/v1/usage:", u.status_code, total, "partial:", *partial)
            metrics = client.get(base + "/metrics").text.splitlines()
            for line in metrics:
                if line.startswith("aiserve_audit") and "_created" not in line:
                    print(line)
    finally:
        pg.stop()


if __name__ == "__main__":
    main()
