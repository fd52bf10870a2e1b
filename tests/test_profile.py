"""/debug/profile on a real hypercorn worker under load: the gateway's own frames, marked by
stage; the HTML page loads nothing from the network (checked in headless Chromium).

A sampling profiler needs real time, so these are slow tests.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from playwright.sync_api import Request as PageRequest
from playwright.sync_api import sync_playwright
from pyinstrument.session import Session

from aiserve_trio.observability.annotate import TASK_LABEL, TaskLabel
from aiserve_trio.observability.profile import (
    HTML_CSP,
    ProfilerBusy,
    ProfilerUnavailable,
    SignalSampler,
    offline_html,
)

from .conftest import config_text
from .servers import hypercorn_gateway
from .test_browser import CHROMIUM, CHROMIUM_ARGS

pytestmark = pytest.mark.slow
BODY = {
    "model": "aiserve-mock",
    "stream": True,
    "messages": [{"role": "user", "content": "echo: " + " ".join(f"w{i}" for i in range(30))}],
}


@pytest.fixture(scope="module")
def busy_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A gateway whose mock answers at once, so the worker's time goes to the gateway's code."""
    path = tmp_path_factory.mktemp("profile") / "gateway.toml"
    path.write_text(config_text(ttft_ms="0", inter_token_ms="0"))
    # No access log: nobody reads the server's output pipe during the test, and
    # thousands of log lines would fill it and block the worker.
    with hypercorn_gateway(path, extra_args=["--access-logfile", "/dev/null"]) as (base, _):
        yield base


def under_load(base: str, path: str, concurrency: int = 8) -> httpx.Response:
    """GET ``path`` while ``concurrency`` clients stream chat replies, until it answers."""
    stop = threading.Event()
    done = [0]

    def client() -> None:
        with httpx.Client(base_url=base, timeout=30) as http:
            while not stop.is_set():
                r = http.post("/v1/chat/completions", json=BODY)
                assert r.status_code == 200
                done[0] += 1

    with ThreadPoolExecutor(concurrency) as pool:
        loads = [pool.submit(client) for _ in range(concurrency)]
        try:
            r = httpx.get(base + path, timeout=60)
        finally:
            stop.set()
        for f in loads:
            f.result()
    assert done[0] > 10, "no load ran during the profile"
    return r


def frames(doc: dict[str, Any]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = doc["shared"]["frames"]
    return found


def test_a_profile_under_load_has_the_gateways_frames_by_stage(busy_gateway: str) -> None:
    r = under_load(busy_gateway, "/debug/profile?seconds=2")
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    assert r.headers["content-disposition"].endswith('.speedscope.json"')
    assert r.headers["x-worker-pid"].isdigit()
    doc = r.json()
    assert doc["$schema"] == "https://www.speedscope.app/file-format-schema.json"
    seen = frames(doc)
    where = {(f["name"], Path(f.get("file") or "").as_posix()) for f in seen}
    def has(name: str, path: str) -> bool:
        return any(n == name and p.endswith(path) for n, p in where)
    assert has("_stage", "aiserve_trio/stages/pipeline.py")
    assert any("aiserve_trio/stages/" in p for _, p in where)
    assert any("aiserve_trio/adapters/" in p for _, p in where)
    # the Trio-aware marker: the run loop's time split by the stage of the task it stepped
    markers = {n for n, _ in where if n.startswith("[stage ")}
    assert {"[stage parse]", "[stage inference]", "[stage sse]"} <= markers
    # the samples add up to the worker's CPU time over the 2 s (a busy test machine
    # may give it well under 2 s of CPU)
    (profile,) = doc["profiles"]
    assert 0.2 < profile["endValue"] - profile["startValue"] <= 2.5


def test_the_html_flame_graph_loads_nothing_from_the_network(busy_gateway: str) -> None:
    r = under_load(busy_gateway, "/debug/profile?seconds=1&format=html", concurrency=2)
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    assert r.headers["content-security-policy"] == HTML_CSP
    page = r.text
    assert "fonts.googleapis" not in page
    assert "https://" not in page
    # The only http:// left is SVG's namespace name, which is never fetched.
    assert {page[i : i + 26] for i in _all(page, "http://")} == {"http://www.w3.org/2000/svg"}

    requests: list[str] = []
    problems: list[str] = []
    url = "http://profile.test/profile.html"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            ctx = browser.new_context()
            pg = ctx.new_page()

            def route(route: Any) -> None:
                if route.request.url == url:
                    route.fulfill(status=200, content_type="text/html", body=page,
                                  headers={"content-security-policy": HTML_CSP})
                else:
                    route.abort()

            def seen(req: PageRequest) -> None:
                if req.url != url and not req.url.startswith("data:"):
                    requests.append(req.url)

            ctx.route("**/*", route)
            pg.on("request", seen)
            pg.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            pg.on("pageerror", lambda e: problems.append(str(e)))
            pg.goto(url)
            # pyinstrument's app draws the call tree into #app.
            pg.wait_for_function("document.querySelector('#app').innerText.length > 100", timeout=15_000)
            text = pg.inner_text("#app")
        finally:
            browser.close()
    assert requests == []
    assert problems == []
    assert "aiserve-trio" in text or "worker" in text


def test_the_sampler_restores_the_signal_and_marks_stages() -> None:
    def spin_in_a_stage(seconds: float) -> None:
        end = time.process_time() + seconds
        while time.process_time() < end:
            sum(i * i for i in range(500))

    async def main() -> Session:
        async def stage() -> None:
            TASK_LABEL.set(TaskLabel("chatcmpl-1", "chat", "sse"))
            for _ in range(40):
                spin_in_a_stage(0.01)
                await trio.lowlevel.checkpoint()

        sampler = SignalSampler(0.001)
        sampler.start()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stage)
        finally:
            session = sampler.stop()
        return session

    before = signal.getsignal(signal.SIGPROF)
    session = trio.run(main)
    assert signal.getsignal(signal.SIGPROF) == before
    assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)
    assert session.sample_count > 10
    # every sample taken in the stage's steps has the marker right above the run loop
    marked = [stack for stack, _ in session.frame_records if "[stage sse]\x00<trio task>\x000" in stack]
    assert marked
    spinning = 0
    for stack in marked:
        i = stack.index("[stage sse]\x00<trio task>\x000")
        assert stack[i - 1].startswith("unrolled_run\x00")
        # A sample can also land between two spins (the loop, the checkpoint, Trio's
        # own step machinery): most, not all, are in the spinning function.
        spinning += any(f.startswith("spin_in_a_stage\x00") for f in stack[i:])
    assert spinning >= 0.8 * len(marked)
    # the weights add up to the CPU time measured
    assert sum(w for _, w in session.frame_records) == pytest.approx(session.cpu_time)


def test_a_taken_sigprof_is_not_overridden() -> None:
    def other(signum: int, frame: object) -> None:
        pass

    previous = signal.signal(signal.SIGPROF, other)
    try:
        with pytest.raises(ProfilerBusy):
            SignalSampler().start()
        assert signal.getsignal(signal.SIGPROF) is other
    finally:
        signal.signal(signal.SIGPROF, previous)


def test_the_sampler_needs_the_main_thread() -> None:
    caught: list[BaseException] = []

    def off_main() -> None:
        try:
            SignalSampler().start()
        except ProfilerUnavailable as exc:
            caught.append(exc)

    t = threading.Thread(target=off_main)
    t.start()
    t.join()
    assert len(caught) == 1


def test_offline_html_strips_the_font_and_adds_the_policy() -> None:
    page = '<html><head></head><body><script>x.href="https://fonts.googleapis.com/css?family=A|B&display=swap"</script></body></html>'
    out = offline_html(page)
    assert "googleapis" not in out
    assert 'href="data:text/css,"' in out
    assert out.index("Content-Security-Policy") < out.index("<body>")


def _all(text: str, needle: str) -> Iterator[int]:
    i = text.find(needle)
    while i >= 0:
        yield i
        i = text.find(needle, i + 1)
