"""What the audit log stores on disk (issue 55, "disk bounded"), in-process on SQLite.

Two figures. ``--prompts`` chat requests of a 100 KB prompt with ``[audit] content =
"redacted"``: the bytes of the database's pages in use per row, and the characters of
content a row holds. ``--wrong-keys`` chat requests with a wrong key, each from its own
address (``X-Forwarded-For``, trusted as ``limits.client_address_header``): how many
rows they became, and how many requests those rows count.

    .venv/bin/python -m bench.audit_disk [--prompts 50] [--wrong-keys 2000]

Run it on a checkout of an older commit (its ``src`` and ``tests`` first on the path)
for the figures before a change.
"""

from __future__ import annotations

import argparse
import sqlite3
import tempfile
from pathlib import Path

import trio
from tests.asgi_client import chat_body
from tests.authcfg import OFF
from tests.conftest import config_text
from tests.spendcfg import KEY_DAN, auth, running, spend_toml

from aiserve_trio.config import parse_config
from aiserve_trio.runtime.asgi import App

PROMPT = "lorem ipsum " * 8_500  # 102,000 characters


def _config(path: Path) -> App:
    audit = f'[audit]\npath = "{path}"\ncontent = "redacted"\n'
    text = config_text().replace(OFF, spend_toml(audit=audit))
    text = text.replace('client_address_header = ""', 'client_address_header = "x-forwarded-for"')
    return App(parse_config(text, source="<bench>"))


async def _drive(path: Path, prompts: int, wrong: int) -> None:
    async with running(_config(path)) as client:
        for _ in range(prompts):
            r = await client.chat(chat_body(PROMPT), headers=auth(KEY_DAN))
            assert r.status == 200, r.body
        for i in range(wrong):
            headers = {**auth("aik_x_" + "z" * 32), "x-forwarded-for": f"10.{i >> 16}.{i >> 8 & 255}.{i & 255}"}
            r = await client.chat(chat_body("echo: hi"), headers=headers)
            assert r.status == 401


def _measure(path: Path) -> tuple[int, int, dict[str, tuple[float, ...]]]:
    """Bytes of the pages in use, rows, and per status: rows, requests, prompt and reply chars."""
    conn = sqlite3.connect(path)
    try:
        pages, free, size = (
            conn.execute(f"PRAGMA {p}").fetchone()[0]
            for p in ("page_count", "freelist_count", "page_size")
        )
        cols = {r[1] for r in conn.execute("PRAGMA table_info(audit_requests)")}
        counted = "sum(requests)" if "requests" in cols else "count(*)"
        by = {
            r[0]: tuple(r[1:])
            for r in conn.execute(
                f"SELECT status, count(*), {counted}, avg(length(prompt)), avg(length(reply)) "
                "FROM audit_requests GROUP BY status"
            )
        }
        (rows,) = conn.execute("SELECT count(*) FROM audit_requests").fetchone()
    finally:
        conn.close()
    return (pages - free) * size, rows, by


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--wrong-keys", type=int, default=2000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        one, two = Path(tmp) / "prompts.db", Path(tmp) / "keys.db"
        trio.run(_drive, one, args.prompts, 0)
        trio.run(_drive, two, 0, args.wrong_keys)
        used, rows, by = _measure(one)
        _, n, prompt, reply = by["ok"]
        print(f"{n:.0f} requests of a {len(PROMPT):,}-character prompt: {used / rows / 1024:.1f} KB "
              f"of database pages a row ({used / 1024:.0f} KB in all); a row holds "
              f"{prompt:,.0f} characters of prompt, {reply:,.0f} of reply")
        _, rows, by = _measure(two)
        _, counted, _, _ = by["unauthorized"]
        print(f"{args.wrong_keys} wrong-key requests from as many addresses: {rows} rows, "
              f"counting {counted:.0f} requests")


if __name__ == "__main__":
    main()
