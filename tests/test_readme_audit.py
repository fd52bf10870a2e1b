"""The README's spend, budget and audit log commands, run as written against a real gateway
(configs/examples/audit.toml under hypercorn), then the audit file they filled."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
from collections.abc import Iterator

import pytest

from .servers import ROOT, hypercorn_gateway
from .test_readme import DOCS

pytestmark = pytest.mark.slow

CONFIG = ROOT / "configs" / "examples" / "audit.toml"
DB = CONFIG.parent / "audit.db"
GATEWAY = "http://127.0.0.1:8000"


def audit_block() -> list[str]:
    (block,) = [b for b in re.findall(r"```sh\n(.*?)```", DOCS, re.S) if "audit.toml" in b]
    lines = block.replace("\\\n", " ").splitlines()
    return [" ".join(line.split()) for line in lines if line.strip() and not line.startswith("#")]


def run(command: str, base: str) -> str:
    out = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command.replace(GATEWAY, base)],
        capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
    )
    assert out.returncode == 0, (command, out.stdout, out.stderr)
    return out.stdout


@pytest.fixture
def fresh_db() -> Iterator[None]:
    def clear() -> None:
        for suffix in ("", "-wal", "-shm"):
            DB.with_name(DB.name + suffix).unlink(missing_ok=True)

    clear()
    yield
    clear()


def test_the_readme_prices_refuses_and_reads_back_spend(fresh_db: None) -> None:
    commands = audit_block()
    assert commands[0].startswith("AISERVE_CONFIG=configs/examples/audit.toml hypercorn")
    first, loop, refused, usage = commands[1:]
    with hypercorn_gateway(CONFIG) as (base, _):
        answer = run(first, base)
        statuses = run(loop, base).split()
        error = json.loads(run(refused, base))
        # Read at once, as the README does: the read sees every request made before it.
        totals = json.loads(run(usage, base))
    header = re.search(r"(?m)^x-aiserve-cost: (\S+)", answer)
    assert header is not None
    assert float(header[1]) > 0
    assert f'"cost":{header[1]}' in answer
    assert "200" in statuses
    assert statuses[-1] == "429"
    assert error["error"]["code"] == "budget_exceeded"
    assert error["error"]["param"] == "key:teller"
    (teller,) = totals["groups"]
    assert teller["group"] == "teller"
    assert teller["requests"] == 10  # the 429s included
    assert teller["cost"] >= 0.0002  # the budget, passed by at most what was in flight
    conn = sqlite3.connect(DB)
    try:
        refusals = conn.execute(
            "SELECT count(*) FROM audit_requests WHERE error_code = 'budget_exceeded'"
        ).fetchone()[0]
    finally:
        conn.close()
    assert refusals == statuses.count("429") + 1
