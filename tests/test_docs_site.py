"""The documentation site, built as CI builds it and opened in a real browser.

``mkdocs build --strict`` (mkdocs.yml) must pass: a broken link or anchor, or a page
left out of the navigation, fails it. The built site is then served over HTTP on a
free loopback port (the search index is fetched, so not from ``file://``) and opened
in headless Chromium (Debian's, as tests/test_browser.py drives it): the navigation
leads to the guides and the reference pages, and the search box finds a page by a
word that is only on that page.
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page

from .servers import BIN, ROOT
from .test_browser import browser_page

pytestmark = pytest.mark.slow


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def serve(directory: Path) -> Iterator[str]:
    handler = functools.partial(_Quiet, directory=str(directory))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def build(site: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "mkdocs"), "build", "--strict", "--site-dir", str(site), *extra],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = build(out)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def test_the_build_is_strict(tmp_path: Path):
    # A page that is not in the navigation, and a link to one that does not exist,
    # fail the build: the check CI relies on is really on.
    config = (ROOT / "mkdocs.yml").read_text()
    docs = tmp_path / "docs"
    subprocess.run(["cp", "-r", str(ROOT / "docs"), str(docs)], check=True)
    (docs / "stray.md").write_text("# A page no one links\n\n[gone](no-such-page.md)\n")
    (tmp_path / "mkdocs.yml").write_text(
        config.replace("docs_dir: docs", f"docs_dir: {docs}").replace(
            "tools/docs_hooks.py", str(ROOT / "tools" / "docs_hooks.py")
        )
    )
    done = build(tmp_path / "site", "--config-file", str(tmp_path / "mkdocs.yml"))
    assert done.returncode != 0
    assert "stray.md" in done.stderr
    assert "no-such-page.md" in done.stderr


def test_the_generated_reference_pages_are_built(site: Path):
    config = (site / "reference" / "config" / "index.html").read_text()
    assert "reload_watch_s" in config
    assert "[[routes]]" in config
    assert "aiserve_requests_total" in (site / "reference" / "metrics" / "index.html").read_text()
    errors = (site / "reference" / "errors" / "index.html").read_text()
    assert "stage_deadline_exceeded" in errors


def heading(page: Page) -> str:
    return page.locator("h1").first.inner_text().removesuffix("¶")


def test_navigation_and_search_work_in_a_browser(site: Path):
    with serve(site) as origin, browser_page() as page:
        page.goto(f"{origin}/")
        assert "aiserve-trio" in page.title()
        nav = page.locator("nav.md-nav--primary")
        for section in ("Getting started", "Guides", "Reference", "Architecture", "Benchmarks"):
            assert nav.get_by_text(section, exact=True).count() >= 1, section
        # The navigation leads to a guide and to the reference
        nav.get_by_role("link", name="Deadlines and stage budgets").first.click()
        page.wait_for_url("**/guides/deadlines/")
        assert heading(page) == "Deadlines and stage budgets"
        page.locator("nav.md-nav--primary").get_by_role("link", name="Configuration").first.click()
        page.wait_for_url("**/reference/config/")
        assert heading(page) == "Configuration reference"

        # Search: a word from one page's body finds that page
        page.keyboard.press("/")
        box = page.locator("input.md-search__input")
        box.wait_for(state="visible", timeout=10_000)
        box.fill("min_inference_ms")
        results = page.locator(".md-search-result__item a")
        results.first.wait_for(timeout=15_000)
        hrefs = [results.nth(i).get_attribute("href") or "" for i in range(results.count())]
        assert any("reference/config/" in h for h in hrefs), hrefs
        results.first.click()
        page.wait_for_load_state()
        assert "min_inference_ms" in page.content()
