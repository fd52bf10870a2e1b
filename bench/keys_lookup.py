"""What a database key costs the request path, with 10,000 of them (issue 47, item 7).

A gateway with the test configs' three config keys and an audit database holding
``--keys`` (10,000) database keys: the key service loads them (off the event loop) into
the worker's table, then ``Gate.check_key`` -- what every request's authentication runs
-- is timed for a config key (today's path), a database key, an unknown database id and
a database key with a wrong secret, in interleaved rounds of ``--calls`` checks each.
Also: how long the first load of the table takes (in the thread) and how long applying
it holds the event loop, and the same for one change seen by a poll.

    .venv/bin/python -m bench.keys_lookup
    .venv/bin/python -m bench.keys_lookup --keys 10000 --rounds 15 --calls 20000
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import trio

from aiserve_trio.config import parse_config
from aiserve_trio.core.errors import Unauthorized
from aiserve_trio.security.auth import hash_key, new_key
from aiserve_trio.security.gate import Gate
from aiserve_trio.security.keystore import db
from aiserve_trio.security.keystore.records import KeySpec, new_key_id
from aiserve_trio.security.keystore.service import KeyService, audit_row
from aiserve_trio.security.keystore.table import KeyTable


def _config_text(path: Path) -> str:
    from tests.authcfg import auth_toml
    from tests.conftest import config_text

    text = config_text().replace("[auth]\nenabled = false\n", auth_toml())
    return text + f'\n[audit]\npath = "{path}"\n'


def _fill(connector: db.SQLiteConnector, n: int) -> str:
    """``n`` database keys in one transaction; returns the plain key of the last."""
    spec = msgspec.json.encode(KeySpec(routes=["/v1/chat/completions"])).decode()
    now = time.time()
    plain = ""

    def write(ex: db.Exec) -> None:
        nonlocal plain
        for i in range(n):
            key_id = new_key_id()
            plain = new_key(key_id)
            row = {
                "id": key_id, "hash": hash_key(plain), "old_hash": None, "old_until": None,
                "tenant": "bank-a", "team": f"team{i % 50}", "label": f"key {i}", "spec": spec,
                "expires_at": None, "created_by": "bench", "created_at": now,
                "updated_at": now, "revoked_at": None, "last_used": None,
            }  # fmt: skip
            db.insert_key(ex, row, audit_row("bench", "bank-a", None, "key.created", key_id, {}))

    connector.run(db.migrate, write=True, create=True)
    connector.run(write, write=True)
    return plain


def _time(check: object, plain: str, calls: int) -> float:
    """Microseconds per check."""
    fn = check  # a bound method; the loop's own cost is in every variant alike
    start = time.perf_counter_ns()
    for _ in range(calls):
        with contextlib.suppress(Unauthorized):
            fn(plain)  # type: ignore[operator]
    return (time.perf_counter_ns() - start) / calls / 1000.0


async def _load(service: KeyService) -> tuple[float, float]:
    """The first load: seconds in all, and the longest the loop was held applying it."""
    table = service.table
    held = 0.0
    apply = table.apply

    def timed(changed: dict[str, object]) -> None:
        nonlocal held
        t = time.perf_counter()
        apply(changed)  # type: ignore[arg-type]
        held = max(held, time.perf_counter() - t)

    table.apply = timed  # type: ignore[method-assign,assignment]
    start = time.perf_counter()
    assert await service.refresh()
    return time.perf_counter() - start, held


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=20_000)
    args = ap.parse_args(argv)
    from tests.authcfg import KEY_A

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "audit.db"
        connector = db.SQLiteConnector(path)
        t = time.perf_counter()
        db_plain = _fill(connector, args.keys)
        print(f"{args.keys:,} database keys written in {time.perf_counter() - t:.1f} s")
        service = KeyService(connector)
        total, held = trio.run(_load, service)
        print(
            f"first load: {total * 1000:.0f} ms (rows read and principals built in the "
            f"thread); applying them held the loop {held * 1000:.1f} ms"
        )
        gate = Gate(parse_config(_config_text(path), source="<bench>"), dbkeys=service.table)
        assert len(service.table) == args.keys
        assert gate.check_key(db_plain) is not None
        assert gate.check_key(KEY_A) is not None
        key_id = db_plain.split("_")[1]
        variants = {
            "config key (today)": KEY_A,
            "config key, wrong secret": KEY_A[:-4] + "zzzz",
            "database key": db_plain,
            "database key, wrong secret": db_plain[:-4] + "zzzz",
            "unknown database id": f"aik_vk{'0' * 14}_{'x' * 32}",
        }
        samples: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for name, plain in variants.items():
                samples[name].append(_time(gate.check_key, plain, args.calls))
        print(f"\nGate.check_key, us per check (median of {args.rounds} rounds x {args.calls:,}):")
        base = statistics.median(samples["config key (today)"])
        for name, values in samples.items():
            med = statistics.median(values)
            spread = f"{min(values):.2f}-{max(values):.2f}"
            print(f"  {name:28s} {med:6.2f}  (range {spread}; {med - base:+.2f} vs config key)")
        # One change, as a poll sees it: the rows past the worker's rev.
        now = time.time()

        def revoke(ex: db.Exec) -> int:
            arow = audit_row("bench", "bank-a", None, "key.revoked", key_id, {})
            return db.update_key(ex, key_id, {"revoked_at": now, "updated_at": now}, arow)

        connector.run(revoke, write=True)
        poll, held = trio.run(_load, service)
        print(
            f"\na poll that finds one change: {poll * 1000:.1f} ms; loop held {held * 1e6:.0f} us"
        )
        try:
            gate.check_key(db_plain)
            print("the revoked key still checks: BUG")
            return 1
        except Unauthorized:
            pass
        table: KeyTable = service.table
        print(f"table: {len(table):,} keys")
    return 0


if __name__ == "__main__":
    sys.exit(main())
