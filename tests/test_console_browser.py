"""The operator console in a real browser, against the gateway under hypercorn.

Headless Chromium (Debian's ``chromium``, driven by Playwright with
``executable_path``; Playwright's own browser download is never used) opens
``/admin/`` of a gateway with auth on. A key that is not an admin key is refused
at login with the gateway's message; the admin key gets in, and the page shows
the live numbers of requests the test makes. A missing browser is a failure, not
a skip: scripts/test installs it.

``AISERVE_CONSOLE_SCREENSHOT=docs/console.png`` saves the README's screenshot of
the page (taken after the steps change, with traffic in the tables).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, expect, sync_playwright

from .authcfg import KEY_A, KEY_ADMIN, OFF, auth_toml
from .conftest import config_text
from .servers import hypercorn_gateway
from .test_browser import CHROMIUM, CHROMIUM_ARGS

pytestmark = pytest.mark.slow


@dataclass
class Gateway:
    api: str
    config: Path


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    text = config_text(ttft_ms="5", inter_token_ms="2").replace(OFF, auth_toml())
    path = tmp_path_factory.mktemp("console") / "gateway.toml"
    path.write_text(text)
    with hypercorn_gateway(path) as (api, _):
        yield Gateway(api, path)


@contextlib.contextmanager
def browser_page() -> Iterator[Page]:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            yield page
        finally:
            browser.close()


def chat(gw: Gateway, text: str, key: str = KEY_ADMIN) -> httpx.Response:
    body = {"model": "aiserve-mock", "messages": [{"role": "user", "content": text}]}
    r = httpx.post(
        f"{gw.api}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    return r


def log_in(page: Page, key: str) -> None:
    page.fill("#key", key)
    page.click("#login-form button[type=submit]")


def test_a_key_that_is_not_an_admin_key_is_refused_at_login(gateway: Gateway) -> None:
    with browser_page() as page:
        page.goto(f"{gateway.api}/admin/")
        expect(page.locator("#login")).to_be_visible()
        log_in(page, KEY_A)
        expect(page.locator("#login-error")).to_have_text("/admin/api/login needs an admin API key")
        expect(page.locator("#app")).to_be_hidden()
        assert page.evaluate("sessionStorage.length") == 0
        log_in(page, KEY_ADMIN[:-4] + "zzzz")
        expect(page.locator("#login-error")).to_have_text("the API key is not valid")


def test_the_admin_key_logs_in_and_the_page_shows_the_live_numbers(gateway: Gateway) -> None:
    with browser_page() as page:
        page.goto(f"{gateway.api}/admin/")
        log_in(page, KEY_ADMIN)
        expect(page.locator("#who")).to_have_text("Signed in as ops")
        expect(page.locator("#app")).to_be_visible()
        # The key is not kept; the console token is, in this tab only.
        stored = page.evaluate("Object.entries(sessionStorage)")
        assert KEY_ADMIN not in str(stored)
        assert page.evaluate("sessionStorage.getItem('aiserve-console-token')")
        for i in range(4):
            chat(gateway, f"echo: request {i} of the console test")
        # The next poll shows them (the window: the worker's last minute).
        row = page.locator("#sla-table tbody tr", has_text="aiserve-mock")
        expect(row).to_be_visible(timeout=10_000)
        cells = row.locator("td").all_inner_texts()
        assert cells[:3] == ["chat", "aiserve-mock", "4"]
        assert cells[4].endswith(" ms")  # P95 latency
        assert cells[6] == "0.00 %"  # error rate
        assert float(cells[7]) > 0  # tokens per request
        expect(page.locator("#stage-table tbody tr")).to_have_count(4)
        expect(page.locator("#slow-table tbody tr", has_text="chatcmpl-")).to_have_count(4)
        # A reload of the tab keeps the session; logging out ends it.
        page.reload()
        expect(page.locator("#who")).to_have_text("Signed in as ops")
        token = page.evaluate("sessionStorage.getItem('aiserve-console-token')")
        page.click("#logout")
        expect(page.locator("#login")).to_be_visible()
        assert page.evaluate("sessionStorage.length") == 0
        # Log out reached the gateway: the token is refused, not only forgotten by the tab.
        r = httpx.get(
            f"{gateway.api}/admin/api/overview",
            headers={"authorization": f"Bearer {token}"},
            timeout=10,
        )
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "revoked_console_token"


def test_an_expired_session_asks_to_log_in_again(gateway: Gateway) -> None:
    with browser_page() as page:
        page.goto(f"{gateway.api}/admin/")
        log_in(page, KEY_ADMIN)
        expect(page.locator("#app")).to_be_visible()
        token = page.evaluate("sessionStorage.getItem('aiserve-console-token')")
        expiry, rest = token.split(".", 1)
        # A token whose signature does not match what it says: the next poll is refused.
        page.evaluate(f"sessionStorage.setItem('aiserve-console-token', '{int(expiry) - 1}.{rest}')")
        expect(page.locator("#login-error")).to_have_text(
            "Your console session ended: log in again.", timeout=10_000
        )
        expect(page.locator("#app")).to_be_hidden()


# --- the steps editor --------------------------------------------------------------

CHAIN = """
# The bank's chain. The operator console reorders these steps; keep the comments.
[[routes]]
path = "/v1/bank"
name = "bank"
adapter = "mock"
default_model = "aiserve-mock"

# What the customer talks about.
[[routes.steps]]
name = "topic"
kind = "classify"
key = "topic"           # a session variable of its own
[[routes.steps.rules]]
label = "card"
pattern = 'card'

# What the customer wants.
[[routes.steps]]
name = "intent"
kind = "classify"
[[routes.steps.rules]]
label = "greeting"
pattern = 'hello'

[[routes.steps]]
name = "answer"
kind = "generate"

# No rate figures in what the customer reads.
[[routes.steps]]
name = "comply"
kind = "rewrite"
policy = "no-rate-figures"
"""


@pytest.fixture
def chain_gateway(tmp_path: Path) -> Iterator[Gateway]:
    text = config_text(ttft_ms="5", inter_token_ms="2").replace(OFF, auth_toml()) + CHAIN
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    with hypercorn_gateway(path) as (api, _):
        yield Gateway(api, path)


def steps_header(gw: Gateway) -> str:
    body = {"messages": [{"role": "user", "content": "hello, about my card"}]}
    r = httpx.post(
        f"{gw.api}/v1/bank",
        json=body,
        headers={"authorization": f"Bearer {KEY_ADMIN}"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    return r.headers["x-aiserve-steps"]


def comment_lines(text: str) -> list[str]:
    return sorted(line for line in text.splitlines() if "#" in line)


def order(page: Page) -> list[str]:
    items = page.locator('article.route[data-path="/v1/bank"] li.step')
    return [items.nth(i).get_attribute("data-name") or "" for i in range(items.count())]


def test_a_step_dragged_and_saved_changes_the_next_requests_steps(chain_gateway: Gateway) -> None:
    gw = chain_gateway
    before = gw.config.read_text()
    assert steps_header(gw) == "topic,intent,answer,comply"
    with browser_page() as page:
        page.goto(f"{gw.api}/admin/")
        log_in(page, KEY_ADMIN)
        route = page.locator('article.route[data-path="/v1/bank"]')
        expect(route.locator("li.step")).to_have_count(4)
        save = route.locator("button.save")
        expect(save).to_be_disabled()
        # Drag "intent" onto the top half of "topic": it goes first.
        intent = route.locator('li.step[data-name="intent"]')
        intent.drag_to(route.locator('li.step[data-name="topic"]'), target_position={"x": 40, "y": 3})
        assert order(page) == ["intent", "topic", "answer", "comply"]
        expect(save).to_be_enabled()
        save.click()
        expect(route.locator(".msg")).to_contain_text("Saved and applied", timeout=10_000)
        assert steps_header(gw) == "intent,topic,answer,comply"
        after = gw.config.read_text()
        assert comment_lines(after) == comment_lines(before)
        assert "# What the customer wants.\n[[routes.steps]]\nname = \"intent\"" in after
        assert after.index('name = "intent"') < after.index('name = "topic"')

        # Switch a step off: it no longer runs.
        route = page.locator('article.route[data-path="/v1/bank"]')
        route.locator('li.step[data-name="comply"] input[type=checkbox]').uncheck()
        route.locator("button.save").click()
        expect(route.locator(".msg")).to_contain_text("Saved and applied", timeout=10_000)
        assert steps_header(gw) == "intent,topic,answer"
        assert 'policy = "no-rate-figures"\nenabled = false\n' in gw.config.read_text()
        chat(gw, "echo: traffic for the picture")
        screenshot(page)

        # A change the gateway refuses: the answer before the classifiers (keyboard buttons).
        saved = gw.config.read_text()
        route = page.locator('article.route[data-path="/v1/bank"]')
        route.get_by_role("button", name="Move answer up").click()
        route.get_by_role("button", name="Move answer up").click()
        assert order(page) == ["answer", "intent", "topic", "comply"]
        route.locator("button.save").click()
        expect(route.locator(".msg")).to_contain_text("Refused:", timeout=10_000)
        expect(route.locator(".msg")).to_contain_text("only policy rewrites may follow 'answer'")
        assert gw.config.read_text() == saved  # nothing written
        assert steps_header(gw) == "intent,topic,answer"
        expect(page.locator("#config-refused")).to_contain_text(
            "only policy rewrites may follow", timeout=10_000
        )
        route.locator("button.revert").click()
        assert order(page) == ["intent", "topic", "answer", "comply"]


def screenshot(page: Page) -> None:
    """The README's picture, when asked for (``AISERVE_CONSOLE_SCREENSHOT``)."""
    target = os.environ.get("AISERVE_CONSOLE_SCREENSHOT")
    if target:
        rows = page.locator("#sla-table tbody tr td.n")
        expect(rows.first).to_be_visible(timeout=10_000)  # a poll with the traffic in it
        page.screenshot(path=target, full_page=True)
