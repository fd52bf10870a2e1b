"""The audit log's PostgreSQL driver, chosen by measurement: psycopg's blocking API in a
worker thread (what ``audit/postgres.py`` does) against libpq's non-blocking protocol driven
on Trio's own waits (``psycopg.pq`` with ``trio.lowlevel.wait_readable/writable``).

Both insert the same batches of audit rows. What counts for the gateway is what the
event loop pays: its thread's CPU time per batch, and the longest the loop was kept from a
ticker task (the worst stall a request could see). Rows per second is reported too.

    .venv/bin/python -m bench.audit_pg [--batches 200] [--batch 256] [--dsn DSN]

Without ``--dsn`` a throwaway PostgreSQL is started (tests/pg_server.py: initdb, pg_ctl).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import psycopg
import trio

from aiserve_trio.audit.postgres import PostgresDatabase
from aiserve_trio.audit.row import Row
from aiserve_trio.audit.schema import COLUMNS


def rows(n: int, start: int) -> list[Row]:
    now = time.time()
    base: dict[str, Any] = dict.fromkeys(COLUMNS)
    base.update(ts=now, tenant="bank", key_id="teller", route="chat", api="chat",
                channel="app", model="gpt-4o", served_model="gpt-4o", status="ok",
                prompt_tokens=812, completion_tokens=164, cost=0.004896, saved=0.0,
                ttft_ms=182.5, total_ms=1404.25, policy_actions="gdpr-redact:redacted")
    out = []
    for i in range(start, start + n):
        base["request_id"] = f"chatcmpl-{i:024x}"
        base["trace_id"] = f"{i:032x}"
        out.append(tuple(base[c] for c in COLUMNS))
    return out


class TrioNative:
    """One multi-row INSERT per batch through libpq's non-blocking calls, waiting on Trio."""

    def __init__(self, dsn: str, batch: int) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.pg = self.conn.pgconn
        self.pg.nonblocking = 1
        width = len(COLUMNS)
        values = ", ".join(
            "(" + ", ".join(f"${r * width + c + 1}" for c in range(width)) + ")"
            for r in range(batch)
        )
        self.sql = f"INSERT INTO audit_requests ({', '.join(COLUMNS)}) VALUES {values}".encode()

    async def insert(self, batch: Sequence[Row]) -> None:
        params = [None if v is None else str(v).encode() for row in batch for v in row]
        pg = self.pg
        fd = pg.socket
        pg.send_query_params(self.sql, params)
        while pg.flush():
            await trio.lowlevel.wait_writable(fd)
        while True:
            pg.consume_input()
            if not pg.is_busy():
                break
            await trio.lowlevel.wait_readable(fd)
        while (res := pg.get_result()) is not None:
            if res.status != psycopg.pq.ExecStatus.COMMAND_OK:
                raise RuntimeError(res.error_message.decode())

    def close(self) -> None:
        self.conn.close()


async def measure(
    name: str, insert: Callable[[Sequence[Row]], Awaitable[None]], batches: int, batch: int
) -> dict[str, float]:
    worst = 0.0
    done = False

    async def ticker() -> None:
        nonlocal worst
        while not done:
            t0 = time.perf_counter()
            await trio.sleep(0.001)
            worst = max(worst, time.perf_counter() - t0 - 0.001)

    data = [rows(batch, i * batch) for i in range(batches)]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        cpu0, t0 = time.thread_time(), time.perf_counter()
        for chunk in data:
            await insert(chunk)
        cpu, wall = time.thread_time() - cpu0, time.perf_counter() - t0
        done = True
    return {
        "rows_per_s": batches * batch / wall,
        "loop_cpu_ms_per_batch": cpu / batches * 1000,
        "worst_stall_ms": worst * 1000,
    }


async def run(dsn: str, batches: int, batch: int, rounds: int) -> dict[str, list[dict[str, float]]]:
    db = PostgresDatabase(dsn)
    db.open()
    native = TrioNative(dsn, batch)

    async def threaded(chunk: Sequence[Row]) -> None:
        await trio.to_thread.run_sync(db.insert, chunk)

    results: dict[str, list[dict[str, float]]] = {"thread": [], "trio-native": []}
    for _ in range(rounds):  # interleaved: drift hits both alike
        results["thread"].append(await measure("thread", threaded, batches, batch))
        results["trio-native"].append(await measure("trio-native", native.insert, batches, batch))
    db.close()
    native.close()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.audit_pg", description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dsn", default=None)
    ns = ap.parse_args(argv)
    server = None
    dsn = ns.dsn
    if dsn is None:
        from tests.pg_server import PostgresServer

        server = PostgresServer()
        server.init()
        server.start()
        dsn = server.dsn
    try:
        results = trio.run(run, dsn, ns.batches, ns.batch, ns.rounds)
    finally:
        if server is not None:
            server.stop()
    print(f"{ns.batches} batches of {ns.batch} rows, {ns.rounds} interleaved rounds (median)")
    print("| driver | rows/s | event-loop CPU per batch | worst loop stall |")
    print("|---|---|---|---|")
    for name, points in results.items():
        med = {k: statistics.median(p[k] for p in points) for k in points[0]}
        print(f"| {name} | {med['rows_per_s']:.0f} | {med['loop_cpu_ms_per_batch']:.2f} ms | "
              f"{med['worst_stall_ms']:.2f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
