"""The console's cache view in a real browser (headless Chromium), against the gateway
under hypercorn with a semantic cache: an operator sees the hits by kind, and the last
semantic hit with the question asked beside the stored question it was answered as."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from playwright.sync_api import expect

from .authcfg import KEY_ADMIN, OFF, auth_toml
from .cachefakes import cache_config_text
from .servers import hypercorn_gateway
from .test_console_browser import Gateway, browser_page, log_in

pytestmark = pytest.mark.slow

SEMANTIC = '{ semantic = { embeddings = "vec", model = "aiserve-mock" } }'
VEC = '\n[adapters.vec]\nkind = "mock"\nmodels = ["aiserve-mock"]\nttft_ms = 0\n'
Q = "What is the annual fee of the platinum credit card?"


@pytest.fixture
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    text = cache_config_text(SEMANTIC, VEC, ttft_ms="5", inter_token_ms="2")
    path = tmp_path_factory.mktemp("console-cache") / "gateway.toml"
    path.write_text(text.replace(OFF, auth_toml()))
    with hypercorn_gateway(path) as (api, _):
        yield Gateway(api, path)


def ask(gw: Gateway, text: str) -> str:
    body = {
        "model": "aiserve-mock",
        "temperature": 0,
        "messages": [{"role": "user", "content": text}],
    }
    r = httpx.post(
        f"{gw.api}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {KEY_ADMIN}"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    return r.headers["x-aiserve-cache"]


def test_the_page_shows_semantic_hits_with_both_questions(gateway: Gateway) -> None:
    assert ask(gateway, Q) == "miss"
    assert ask(gateway, Q) == "hit"
    asked = "what is the ANNUAL FEE of the platinum credit card"
    assert ask(gateway, asked) == "semantic-hit"
    with browser_page() as page:
        page.goto(f"{gateway.api}/admin/")
        log_in(page, KEY_ADMIN)
        row = page.locator("#cache-table tbody tr", has_text="chat")
        expect(row).to_be_visible(timeout=10_000)
        assert row.locator("td").all_inner_texts() == ["chat", "1", "1", "1", "0", "0"]
        hit = page.locator("#semantic-hits tbody tr")
        expect(hit).to_have_count(1)
        cells = hit.locator("td").all_inner_texts()
        assert cells[1:] == ["chat", cells[2], asked, Q]
        assert float(cells[2]) >= 0.92
        served = page.locator("#similarity-table tbody tr")
        expect(served).to_have_count(1)
        assert served.locator("td").all_inner_texts()[1:3] == ["1", "0"]
        expect(page.locator("#cache-entries")).to_have_text("1")
