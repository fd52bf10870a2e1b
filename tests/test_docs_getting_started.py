"""Every example of docs/getting-started.md, run as written against a gateway on the embedded default.

The gateway is started the way the page says, ``./scripts/serve`` (with ``--bind`` to a
free port, the one change made to any example: ``127.0.0.1:8000`` becomes that
address). Each ``sh`` block (curl) runs in bash, each ``python`` block in the test
venv's Python, and the ``js`` block in headless Chromium on the gateway's origin, as a
reader pastes it into the console. What an example prints must match the ``text`` block
that follows it on the page, ``…`` standing for what differs per run (ids, times).
No block of the page goes unrun: the test that parses the page fails on a block of a
language it does not run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from .servers import ROOT, free_port, wait_http

pytestmark = pytest.mark.slow

PAGE = ROOT / "docs" / "getting-started.md"
ADDRESS = "127.0.0.1:8000"
RUNNABLE = {"sh", "python", "js"}


@dataclass(frozen=True)
class Example:
    lang: str
    code: str
    output: str | None  # the ``text`` block right after it, if any


def examples(text: str) -> list[Example]:
    """The page's fenced blocks, each runnable one with the output shown after it."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M)
    out: list[Example] = []
    for lang, code in blocks:
        if lang == "text":
            # The output of the example before it; the browser's console output comes
            # after the curl call that makes it, so a second text block is the js one's.
            waiting = [
                i
                for i, e in enumerate(out)
                if e.output is None and (e.lang == "js" or i == len(out) - 1)
            ]
            assert waiting, f"a text block follows no example: {code!r}"
            i = waiting[-1]
            out[i] = Example(out[i].lang, out[i].code, code)
        else:
            assert lang in RUNNABLE, f"a {lang or 'plain'} block the test does not run: {code!r}"
            out.append(Example(lang, code, None))
    return out


EXAMPLES = examples(PAGE.read_text())


def by_lang(lang: str) -> list[Example]:
    return [e for e in EXAMPLES if e.lang == lang]


def matches(expected: str, got: str) -> bool:
    """``got`` is ``expected`` with each ``…`` standing for any text on its line."""
    pattern = ".*?".join(re.escape(part) for part in expected.strip().split("…"))
    return re.fullmatch(pattern, got.strip(), re.S) is not None


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    """``./scripts/serve`` as the page has it, on a free port; yields ``host:port``."""
    (install,) = [e for e in by_lang("sh") if "scripts/serve" in e.code]
    assert install.code.strip() == "./scripts/serve"
    address = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "AISERVE_CONFIG"}
    proc = subprocess.Popen(
        ["./scripts/serve", "--bind", address],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        # scripts/serve installs into .venv first (pip), then serves.
        wait_http(f"http://{address}/healthz", proc=proc, timeout=120)
        yield address
    finally:
        # its own process group: pip, if it is still installing, goes too
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run(example: Example, address: str) -> str:
    code = example.code.replace(ADDRESS, address)
    argv = (
        ["bash", "-o", "pipefail", "-c", code]
        if example.lang == "sh"
        else [sys.executable, "-c", code]
    )
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, (example.code, done.stdout, done.stderr)
    return done.stdout


def test_the_page_has_the_examples_it_promises():
    langs = [e.lang for e in EXAMPLES]
    assert langs.count("python") >= 3
    assert langs.count("js") == 1
    # every example but the install command shows its output
    assert [e.code for e in EXAMPLES if e.output is None] == ["./scripts/serve\n"]
    assert matches("id: 1\ndata: {…}", 'id: 1\ndata: {"x": 1}')
    assert not matches("id: 1\ndata: {…}", 'id: 2\ndata: {"x": 1}')


@pytest.mark.parametrize(
    "example",
    [e for e in by_lang("sh") if e.code.startswith("curl") and "X-Session-Id" not in e.code],
    ids=lambda e: e.code.split("-d ")[-1][:40],
)
def test_curl_examples_print_what_the_page_shows(gateway: str, example: Example):
    got = run(example, gateway)
    assert example.output is not None
    assert matches(example.output, got), got


@pytest.mark.parametrize(
    "example", by_lang("python"), ids=lambda e: e.code.split("content")[-1][:40]
)
def test_sdk_examples_print_what_the_page_shows(gateway: str, example: Example):
    got = run(example, gateway)
    assert example.output is not None
    assert matches(example.output, got), got


def test_a_browser_follows_a_session_with_the_pages_eventsource(gateway: str):
    from playwright.sync_api import ConsoleMessage

    from .test_browser import browser_page

    (script,) = by_lang("js")
    (curl,) = [e for e in by_lang("sh") if "X-Session-Id" in e.code]
    console = script.output
    assert curl.output is not None
    assert console is not None
    logged: list[str] = []

    def on_console(message: ConsoleMessage) -> None:
        if message.type == "log":  # not the browser's own (a missing favicon.ico)
            logged.append(message.text)

    with browser_page() as page:
        page.on("console", on_console)
        page.goto(f"http://{gateway}/healthz")
        page.evaluate(f"() => {{ {script.code} window.__events = events; }}")
        page.wait_for_function("window.__events.readyState === EventSource.OPEN", timeout=10_000)
        reply = run(curl, gateway)
        end = time.monotonic() + 10
        while len(logged) < 2 and time.monotonic() < end:
            page.wait_for_timeout(50)
    assert matches(curl.output, reply), reply
    assert logged == console.strip().splitlines()
