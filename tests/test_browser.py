"""A real browser follows a session with EventSource, across a reconnect.

Headless Chromium (Debian's ``chromium``, driven by Playwright with
``executable_path``; Playwright's own browser download is never used) opens
tests/browser/events.html. The page is served on the gateway's own origin by
Playwright's request routing, so ``EventSource`` on ``/v1/sessions/{id}/events``
is same-origin and needs no CORS. The gateway ends each event stream after
``events_max_s`` (1 s here); the browser reconnects by itself and sends
``Last-Event-ID``, and a turn written while it was away must arrive exactly
once. A missing browser is a failure, not a skip: scripts/test installs it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from playwright.sync_api import sync_playwright

from .conftest import config_text
from .servers import hypercorn_gateway

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
PAGE = (Path(__file__).parent / "browser" / "events.html").read_text()
SESSION = "session:20240521:browser1"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    text = config_text(ttft_ms="2", inter_token_ms="1")
    # End every event stream after 1 s (the browser then reconnects), ping often.
    text = re.sub(
        r'(?m)^(\[sessions\]\n(?:.*\n)*?backend = "memory"\n)',
        r"\1events_max_s = 1\nheartbeat_ms = 200\n",
        text,
        count=1,
    )
    assert "events_max_s = 1" in text
    path = tmp_path_factory.mktemp("browser") / "gateway.toml"
    path.write_text(text)
    with hypercorn_gateway(path) as (base, _):
        yield base


def chat(base: str, text: str) -> str:
    """One streamed turn in the session; the streamed reply's text."""
    body = {"model": "aiserve-mock", "stream": True, "messages": [{"role": "user", "content": text}]}
    pieces = []
    with httpx.stream(
        "POST", base + "/v1/chat/completions", json=body,
        headers={"X-Session-Id": SESSION, "X-Channel": "web"}, timeout=10,
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    pieces.append(ch["delta"].get("content") or "")
    return "".join(pieces)


def wait_turns(base: str, n: int) -> list[dict[str, str]]:
    """The session's turns once there are at least ``n`` (write-back follows the reply)."""
    end = time.monotonic() + 5
    while True:
        turns: list[dict[str, str]] = httpx.get(f"{base}/v1/sessions/{quote(SESSION)}").json()["turns"]
        if len(turns) >= n or time.monotonic() > end:
            return turns
        time.sleep(0.05)


def test_eventsource_renders_turns_and_resumes_with_last_event_id(gateway):
    assert chat(gateway, "echo: first turn here") == "first turn here"
    wait_turns(gateway, 2)
    page_url = gateway + "/__browser__/events.html"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.route(
                page_url + "*",
                lambda route: route.fulfill(status=200, content_type="text/html", body=PAGE),
            )
            page.goto(f"{page_url}?session={quote(SESSION)}")
            page.wait_for_function("document.querySelectorAll('#turns li').length >= 2", timeout=10_000)
            # The server ends the stream after 1 s; the browser waits `retry` (1 s) to come back.
            page.wait_for_function("Number(document.getElementById('errors').textContent) >= 1", timeout=10_000)
            reply = chat(gateway, "echo: second turn while away")
            wait_turns(gateway, 4)
            page.wait_for_function("Number(document.getElementById('opens').textContent) >= 2", timeout=10_000)
            page.wait_for_function("document.querySelectorAll('#turns li').length >= 4", timeout=10_000)
            # One more stream end and reconnect must not replay anything.
            page.wait_for_function("Number(document.getElementById('opens').textContent) >= 3", timeout=10_000)
            rendered = page.eval_on_selector_all(
                "#turns li", "els => els.map(e => [e.dataset.id, e.textContent])"
            )
        finally:
            browser.close()
    assert reply == "second turn while away"
    turns = wait_turns(gateway, 4)
    assert [text for _, text in rendered] == [f"{t['role']}: {t['content']}" for t in turns]
    assert [text for _, text in rendered][-1] == "assistant: second turn while away"
    ids = [i for i, _ in rendered]
    assert len(set(ids)) == len(ids) == 4
    assert all(ids)
