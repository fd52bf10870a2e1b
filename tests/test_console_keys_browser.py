"""The console's API keys and audit trail pages in a real browser (issue 47, items 1 and 5).

Headless Chromium against the gateway under hypercorn, auth on and an audit database
(SQLite) keeping keys: the admin creates a key on the page, the key (shown once)
calls a model, is rotated and then revoked there, and each action is a row of the
audit trail the page shows and filters.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, expect

from .authcfg import OFF
from .conftest import config_text
from .keyscfg import KEY_ADMIN, keys_toml
from .servers import hypercorn_gateway
from .test_console_browser import browser_page, log_in

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("console-keys")
    path = tmp / "gateway.toml"
    path.write_text(config_text(ttft_ms="5", inter_token_ms="2").replace(OFF, keys_toml(tmp)))
    with hypercorn_gateway(path) as (url, _):
        yield url


def chat_status(api: str, key: str) -> int:
    body = {"model": "aiserve-mock", "messages": [{"role": "user", "content": "hi"}]}
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(
        f"{api}/v1/chat/completions", json=body, headers=headers, timeout=10
    ).status_code


def refused_soon(api: str, key: str) -> int:
    """The status of a call with ``key`` once the workers' tables have the change (1 s poll)."""
    deadline = time.monotonic() + 5
    while (status := chat_status(api, key)) == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    return status


def secret(page: Page) -> str:
    expect(page.locator("#key-secret")).to_be_visible()
    return page.locator("#key-secret-value").inner_text()


def test_a_key_made_rotated_and_revoked_in_the_console_works_then_is_refused(api: str) -> None:
    with browser_page() as page:
        page.goto(f"{api}/admin/")
        log_in(page, KEY_ADMIN)
        expect(page.locator("#keys")).to_be_visible()
        page.fill("#key-label", "ivr line 3")
        page.fill("#key-models", "aiserve-mock")
        page.fill("#key-days", "30")
        page.click("#key-form button[type=submit]")
        first = secret(page)
        assert first.startswith("aik_vk")
        row = page.locator("#keys-table tbody tr", has_text="ivr line 3")
        cells = row.locator("td").all_inner_texts()
        key_id = cells[0]
        assert first.startswith(f"aik_{key_id}_")
        assert cells[1:5] == ["ivr line 3", "bank-a", "", "aiserve-mock"]
        assert cells[8] == "active"
        assert chat_status(api, first) == 200

        row.locator("button.rotate").click()
        expect(page.locator("#key-secret-what")).to_have_text(f"New secret of {key_id}:")
        second = secret(page)
        assert second != first
        expect(row.locator("td.state")).to_contain_text("rotated; old secret until")
        assert chat_status(api, second) == 200
        assert chat_status(api, first) == 200  # the hour's grace

        revoke = row.locator("button.revoke")
        revoke.click()
        expect(revoke).to_have_text("Confirm revoke")
        assert chat_status(api, second) == 200  # one click does not revoke
        revoke.click()
        expect(row.locator("td.state")).to_contain_text("revoked")
        assert refused_soon(api, second) == 401
        assert chat_status(api, first) == 401

        # Each action is one row of the audit trail, newest first, by the admin.
        audit = page.locator("#audit-table tbody tr", has_text=key_id)
        expect(audit).to_have_count(3)
        actions = [audit.nth(i).locator("td").nth(4).inner_text() for i in range(3)]
        assert actions == ["key.revoked", "key.rotated", "key.created"]
        assert {audit.nth(i).locator("td").nth(1).inner_text() for i in range(3)} == {"ops"}
        assert second not in page.locator("#audit-table").inner_text()
        page.fill("#audit-action", "key.rotated")
        page.click("#audit-form button[type=submit]")
        expect(page.locator("#audit-table tbody tr")).to_have_count(1)
        expect(page.locator("#audit-table tbody tr td").nth(6)).to_contain_text('"grace_s":3600')


def test_a_bad_key_form_shows_the_gateways_reason(api: str) -> None:
    with browser_page() as page:
        page.goto(f"{api}/admin/")
        log_in(page, KEY_ADMIN)
        page.fill("#key-label", "other tenant's")
        page.fill("#key-tenant", "no such tenant!")
        page.click("#key-form button[type=submit]")
        expect(page.locator("#keys-error")).to_contain_text("tenant")
        expect(page.locator("#key-secret")).to_be_hidden()


def test_without_a_keys_database_the_sections_stay_hidden(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(config_text())
    with hypercorn_gateway(path) as (url, _), browser_page() as page:
        page.goto(f"{url}/admin/")  # auth off, loopback: no login
        expect(page.locator("#sla")).to_be_visible()
        expect(page.locator("#keys")).to_be_hidden()
        expect(page.locator("#audit")).to_be_hidden()
        expect(page.locator("#error")).to_be_empty()
