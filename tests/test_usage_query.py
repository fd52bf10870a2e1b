"""Reading usage back (issue 50, item 6): a bad or out-of-range ``from``/``to`` is a 400 in
the OpenAI error envelope on ``/v1/usage`` and ``/admin/usage`` (it was a 500), and a key
id given again in another tenant never reads the rows of the key that had it before."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from aiserve_trio.audit.usage import MAX_TS, parse_query
from aiserve_trio.core.errors import BadRequest
from aiserve_trio.runtime.asgi import App

from .asgi_client import chat_body
from .spendcfg import KEY_DAN, KEY_OPS, auth, running, spend_config

OUT_OF_RANGE = [
    "99999999999999999999",  # year 3e12
    "9" * 400,  # a float's inf
    "253402300800",  # 10000-01-01
    "0001-01-01",  # before 1970
    "1969-12-31",
]
MALFORMED = ["2026-13-01", "yesterday", "1.2.3", "", "-5", "1e9", "nan", "inf"]


@pytest.mark.parametrize("value", OUT_OF_RANGE + MALFORMED)
@pytest.mark.parametrize("name", ["from", "to"])
def test_a_time_out_of_range_or_malformed_is_refused(name: str, value: str) -> None:
    with pytest.raises(BadRequest) as got:
        parse_query({name: value}, now=1.8e9)
    assert (got.value.param, got.value.code) == (name, "invalid_time")
    assert "between 1970-01-01 and 9999-12-30" in got.value.message


def test_the_widest_range_is_answered() -> None:
    q = parse_query({"from": "1970-01-01", "to": "9999-12-30"}, now=1.8e9)
    assert (q.start, q.end) == (0.0, MAX_TS)
    with pytest.raises(BadRequest):
        parse_query({"to": "9999-12-31"}, now=1.8e9)


@pytest.mark.parametrize("path", ["/v1/usage", "/admin/usage"])
@pytest.mark.parametrize("value", ["99999999999999999999", "9999-12-31", "0001-01-01", "x"])
async def test_the_endpoints_answer_400_in_the_error_envelope(
    tmp_path: Path, path: str, value: str
) -> None:
    app = App(spend_config(tmp_path))
    async with running(app) as client:
        for name in ("from", "to"):
            r = await client.request("GET", f"{path}?{name}={value}", headers=auth(KEY_OPS))
            assert r.status == 400, r.body
            error = r.json()["error"]
            assert (error["type"], error["param"], error["code"]) == (
                "invalid_request_error",
                name,
                "invalid_time",
            )


async def test_a_key_id_given_again_in_another_tenant_reads_only_its_own_rows(
    tmp_path: Path,
) -> None:
    # "dan" was a key of tenant "old" (its rows are still in the audit log); the id is
    # now a key of tenant "shop", which must not see the old key's spend.
    app = App(spend_config(tmp_path))
    async with running(app) as client:
        r = await client.chat(chat_body("echo: mine"), headers=auth(KEY_DAN))
        assert r.status == 200
        with sqlite3.connect(tmp_path / "audit.db") as conn:
            conn.execute(
                "INSERT INTO audit_requests (request_id, ts, tenant, key_id, route, api, "
                "channel, model, served_model, status, prompt_tokens, completion_tokens, "
                "cost, total_ms) VALUES ('old-1', ?, 'old', 'dan', 'chat', 'chat', 'web', "
                "'aiserve-mock', 'aiserve-mock', 'ok', 5000, 5000, 9.5, 1.0)",
                (time.time() - 60,),
            )
        mine = await client.request("GET", "/v1/usage?group_by=tenant", headers=auth(KEY_DAN))
        admin = await client.request("GET", "/admin/usage?group_by=tenant", headers=auth(KEY_OPS))
    assert mine.status == 200
    body = mine.json()
    assert [g["group"] for g in body["groups"]] == ["shop"]
    assert body["total"]["requests"] == 1
    assert body["total"]["cost"] == pytest.approx(float(r.headers["x-aiserve-cost"]))
    # The admin still sees both tenants' rows.
    assert sorted(g["group"] for g in admin.json()["groups"]) == ["old", "shop"]
