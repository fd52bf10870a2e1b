"""The console's Spend page in a real browser (headless Chromium, as tests/test_console_browser.py):
spend per day as an inline SVG bar chart, the tables by tenant, key and model from the audit
log, and each budget with its use -- after real requests to the gateway under hypercorn."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import expect

from aiserve_trio.console.spend import spend_view
from aiserve_trio.runtime.asgi import App

from .authcfg import OFF
from .conftest import config_text
from .servers import hypercorn_gateway
from .spendcfg import KEY_CAROL, KEY_DAN, KEY_OPS, auth, running, spend_config, spend_toml
from .test_console_browser import browser_page, log_in


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[str]:
    audit = f'[audit]\npath = "{tmp_path / "audit.db"}"\n'
    path = tmp_path / "gateway.toml"
    path.write_text(config_text().replace(OFF, spend_toml(audit=audit)))
    with hypercorn_gateway(path) as (api, _):
        yield api


def chat(api: str, key: str, text: str) -> int:
    body = {"model": "aiserve-mock", "messages": [{"role": "user", "content": f"echo: {text}"}]}
    r = httpx.post(f"{api}/v1/chat/completions", json=body, headers=auth(key), timeout=10)
    return r.status_code


@pytest.mark.slow
def test_the_spend_page_shows_todays_bar_the_tables_and_the_budgets(gateway: str) -> None:
    assert chat(gateway, KEY_CAROL, "spend carol's budget") == 200
    assert chat(gateway, KEY_CAROL, "refused") == 429
    for i in range(3):
        assert chat(gateway, KEY_DAN, f"dan {i}") == 200
    with browser_page() as page:
        page.goto(f"{gateway}/admin/")
        log_in(page, KEY_OPS)
        keys = page.locator("#spend-keys tbody tr")
        expect(keys).to_have_count(2)
        expect(keys.filter(has_text="carol")).to_contain_text("2")  # the 429 is a request too
        expect(keys.filter(has_text="dan")).to_contain_text("3")
        expect(page.locator("#spend-tenants tbody tr")).to_contain_text("shop")  # one tenant
        models = page.locator("#spend-models tbody tr")
        expect(models.filter(has_text="aiserve-mock")).to_contain_text("4")
        expect(models.filter(has_text="(none)")).to_contain_text("1")  # refused: no model
        bars = page.locator("#spend-chart rect.bar")
        expect(bars).to_have_count(30)
        today = bars.last
        assert float(today.get_attribute("height") or 0) == pytest.approx(140.0)
        assert float(bars.first.get_attribute("height") or 0) == 0.0
        budget = page.locator("#budgets tbody tr")
        expect(budget).to_contain_text("key carol")
        expect(budget).to_contain_text(re.compile(r"\b\d{3,}\.\d\d %"))  # spent: >= 100 %
        expect(budget).to_have_class("bad")
        expect(page.locator("#spend-off")).to_be_hidden()


async def test_without_the_audit_log_the_page_still_shows_the_budgets(autojump_clock) -> None:
    app = App(spend_config())
    async with running(app) as client:
        assert (await client.chat({"model": "aiserve-mock", "messages": [
            {"role": "user", "content": "echo: hi"}]}, headers=auth(KEY_CAROL))).status == 200
        view = await spend_view(app.console.usage, app.gate)
    assert view.audit is False
    assert view.days == []
    (carol,) = view.budgets
    assert (carol.scope, carol.name, carol.period) == ("key", "carol", "day")
    assert carol.ratio >= 1.0
    assert carol.resets_at is not None
