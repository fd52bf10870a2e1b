"""A real browser, on another origin than the gateway: fetch streams a chat, EventSource
follows the session across a reconnect, and an origin not in ``[cors]`` is refused.

Headless Chromium (Debian's ``chromium``, driven by Playwright with
``executable_path``; Playwright's own browser download is never used) opens
tests/browser/events.html from a small static server on its own port: the page's
origin is not the gateway's, so every call it makes is cross-origin and needs
the gateway's CORS answers (preflights for the JSON chat, the Authorization
header and the reconnect's ``Last-Event-ID``). The gateway runs under hypercorn
twice, auth off and auth on; with auth on the page sends the key with fetch and,
since EventSource cannot send headers, asks for a stream token first. The gateway
ends each event stream after ``events_max_s`` (1 s here); the browser reconnects
by itself and sends ``Last-Event-ID``, and a turn written while it was away must
arrive exactly once. A second static server is an origin ``[cors]`` does not
list: its page's calls fail. A missing browser is a failure, not a skip:
scripts/test installs it.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import pytest
from playwright.sync_api import Page, sync_playwright

from .authcfg import KEY_A, OFF, auth_toml
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
PAGES = Path(__file__).parent / "browser"


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def static_server() -> Iterator[str]:
    """tests/browser/ served on a free loopback port; yields the origin."""
    handler = functools.partial(_Quiet, directory=str(PAGES))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class Setup:
    api: str
    page_origin: str
    other_origin: str
    key: str | None


@pytest.fixture(scope="module", params=["auth_off", "auth_on"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    auth_on = request.param == "auth_on"
    with static_server() as page_origin, static_server() as other_origin:
        text = config_text(ttft_ms="2", inter_token_ms="1")
        # End every event stream after 1 s (the browser then reconnects), ping often.
        text = re.sub(
            r'(?m)^(\[sessions\]\n(?:.*\n)*?backend = "memory"\n)',
            r"\1events_max_s = 1\nheartbeat_ms = 200\n",
            text,
            count=1,
        )
        assert "events_max_s = 1" in text
        if auth_on:
            text = text.replace(OFF, auth_toml())
        text += f'\n[cors]\nallow_origins = ["{page_origin}"]\n'
        path = tmp_path_factory.mktemp("browser") / "gateway.toml"
        path.write_text(text)
        with hypercorn_gateway(path) as (api, _):
            yield Setup(api, page_origin, other_origin, KEY_A if auth_on else None)


@contextlib.contextmanager
def browser_page() -> Iterator[Page]:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page()
        finally:
            browser.close()


def page_url(origin: str, s: Setup, session: str) -> str:
    params = {"api": s.api, "session": session, **({"key": s.key} if s.key else {})}
    return f"{origin}/events.html?{urlencode(params)}"


def turns(s: Setup, session: str, n: int, wait: float = 5.0) -> list[dict[str, str]]:
    """The session's turns once there are at least ``n`` (write-back follows the reply)."""
    headers = {"authorization": f"Bearer {s.key}"} if s.key else {}
    end = time.monotonic() + wait
    while True:
        r = httpx.get(f"{s.api}/v1/sessions/{quote(session)}", headers=headers)
        assert r.status_code == 200, r.text
        got: list[dict[str, str]] = r.json()["turns"]
        if len(got) >= n or time.monotonic() > end:
            return got
        time.sleep(0.05)


def count(page: Page, element: str) -> int:
    return int(page.inner_text(f"#{element}"))


def wait_count(page: Page, element: str, n: int) -> None:
    page.wait_for_function(
        f"Number(document.getElementById('{element}').textContent) >= {n}", timeout=10_000
    )


def test_a_page_on_another_origin_streams_a_chat_and_follows_the_session(setup: Setup):
    session = "session:20240521:browser1"
    with browser_page() as page:
        page.goto(page_url(setup.page_origin, setup, session))
        wait_count(page, "opens", 1)
        first = page.evaluate("chat('echo: first turn here')")
        page.wait_for_function("document.querySelectorAll('#turns li').length >= 2", timeout=10_000)
        # The server ends the stream after 1 s; the browser waits `retry` (1 s) to come back.
        wait_count(page, "errors", 1)
        second = page.evaluate("chat('echo: second turn while away')")
        turns(setup, session, 4)
        wait_count(page, "opens", 2)
        page.wait_for_function("document.querySelectorAll('#turns li').length >= 4", timeout=10_000)
        # One more stream end and reconnect must not replay anything.
        wait_count(page, "opens", 3)
        rendered = page.eval_on_selector_all(
            "#turns li", "els => els.map(e => [e.dataset.id, e.textContent])"
        )
        failure = page.inner_text("#failure")
    assert failure == ""
    for reply, text in ((first, "first turn here"), (second, "second turn while away")):
        assert reply["status"] == 200, reply
        assert reply["content"] == text
        assert reply["done"]
        assert reply["contentType"].startswith("text/event-stream")
        # an exposed header: the page may read it
        assert reply["requestId"].startswith("chatcmpl-")
    server_turns = turns(setup, session, 4)
    assert [text for _, text in rendered] == [f"{t['role']}: {t['content']}" for t in server_turns]
    assert [text for _, text in rendered][-1] == "assistant: second turn while away"
    ids = [i for i, _ in rendered]
    assert len(set(ids)) == len(ids) == 4
    assert all(ids)


def test_a_page_on_an_origin_not_allowed_is_refused(setup: Setup):
    session = "session:20240521:browser2"
    with browser_page() as page:
        page.goto(page_url(setup.other_origin, setup, session))
        refused = page.evaluate("chat('echo: from elsewhere')")
        page.wait_for_function(
            "Number(document.getElementById('errors').textContent) >= 1"
            " || document.getElementById('failure').textContent !== ''",
            timeout=10_000,
        )
        opens = count(page, "opens")
    # The preflight was refused, so the chat request itself was never sent.
    assert refused == {"error": "TypeError: Failed to fetch"}
    assert opens == 0
    assert turns(setup, session, 1, wait=0.5) == []
