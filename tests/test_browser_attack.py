"""A web page in headless Chromium attacks a gateway that runs with auth off (the embedded
default), as issue 33 did: it posts a new config to ``/admin/config/reload`` -- adding
``[cors] allow_origins = ["*"]`` -- then reads a session and ``/admin/config``.

- From another origin the page uses ``text/plain``, which a browser sends without a
  preflight (``no-cors``): the gateway refuses the type and the ``Origin``.
- Through DNS rebinding (Chromium's resolver maps the page's name to 127.0.0.1, so the
  page and the gateway share an origin and ``application/toml`` needs no preflight):
  the gateway refuses the ``Host``.

Either way the config file, its version and the CORS table stay as they were. The page
is served by Playwright's router (its own origin, no server), the gateway by hypercorn.
Chromium's private-network checks are switched off so that it is the gateway's defence
that is tested, not the browser's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode, urlparse

import httpx
import pytest
from playwright.sync_api import Route, sync_playwright

from .conftest import config_text
from .servers import free_port, hypercorn_gateway
from .test_browser import CHROMIUM, CHROMIUM_ARGS, PAGES

pytestmark = pytest.mark.slow

ATTACK = (PAGES / "attack.html").read_text()
NEW_CONFIG = config_text() + '\n[cors]\nallow_origins = ["*"]\n'
REBOUND = "rebound.example"
#: Chromium's own guards for pages calling local addresses (Private, then Local Network
#: Access): off, so that what is tested is the gateway's defence.
LOCAL_NETWORK_CHECKS = (
    "LocalNetworkAccessChecks",
    "BlockInsecurePrivateNetworkRequests",
    "PrivateNetworkAccessSendPreflights",
)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    path = tmp_path_factory.mktemp("attack") / "gateway.toml"
    path.write_text(config_text())
    with hypercorn_gateway(path) as (api, _):
        yield api, path


def state(api: str, path: Path) -> tuple[str, str, str | None]:
    """The config file, the active version, and the CORS answer to a foreign page."""
    with httpx.Client(base_url=api, timeout=5.0) as client:
        version = client.get("/admin/config").json()["version"]
        probe = client.get("/v1/models", headers={"origin": "http://elsewhere.example"})
    return path.read_text(), version, probe.headers.get("access-control-allow-origin")


def attack(url: str) -> str:
    """Open the attack page at ``url`` (served by the router); what its calls got."""
    page_origin = "{0.scheme}://{0.netloc}".format(urlparse(url))
    args = [
        *CHROMIUM_ARGS,
        f"--host-resolver-rules=MAP {REBOUND} 127.0.0.1",
        "--disable-features=" + ",".join(LOCAL_NETWORK_CHECKS),
    ]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        try:
            page = browser.new_page()

            def serve(route: Route) -> None:
                name = urlparse(route.request.url).path
                body, ctype = (ATTACK, "text/html") if name == "/attack.html" else (
                    NEW_CONFIG, "text/plain"
                )
                route.fulfill(status=200, body=body, content_type=ctype)

            for name in ("/attack.html", "/config.txt"):
                page.route(f"{page_origin}{name}*", serve)
            page.goto(url)
            page.wait_for_function("document.title === 'done'", timeout=15_000)
            return str(page.text_content("#out"))
        finally:
            with contextlib.suppress(Exception):
                browser.close()


def test_a_page_on_another_origin_changes_nothing(gateway: tuple[str, Path]) -> None:
    api, path = gateway
    before = state(api, path)
    evil = f"http://127.0.0.1:{free_port()}"
    out = attack(f"{evil}/attack.html?{urlencode({'api': api, 'type': 'text/plain'})}")
    assert "reload: opaque 0" in out  # the browser sent it; the page cannot read the answer
    assert state(api, path) == before
    assert before[2] is None  # no page on another origin may read the gateway


def test_a_rebound_name_changes_nothing(gateway: tuple[str, Path]) -> None:
    api, path = gateway
    before = state(api, path)
    port = urlparse(api).port
    out = attack(f"http://{REBOUND}:{port}/attack.html?{urlencode({'type': 'application/toml'})}")
    assert "reload: basic 403" in out
    assert "host_not_allowed" in out
    assert "session: basic 403" in out
    assert "admin: basic 403" in out
    assert state(api, path) == before
