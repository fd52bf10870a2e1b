"""No request holds the event loop (issue 33, item 3): CPU work of unbounded size --
redaction, fraud scoring, tokenizing, building a recording line -- runs in slices.

The driver's contract is tested on plain steps; then a real hypercorn worker in front
of a real aiserve-sim is given the largest bodies its limits allow while a probe on
another connection times ``/healthz``."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
import trio
import trio.lowlevel

from aiserve_trio.adapters.base import Message
from aiserve_trio.config import build_policies
from aiserve_trio.core.slices import Steps, finish, run_sliced
from aiserve_trio.policies.base import PolicyContext
from aiserve_trio.policies.redact import build_rules
from aiserve_trio.policies.stream import Rewriter

from .conftest import config_text, make_config
from .servers import hypercorn_gateway
from .sim_process import run_sim

#: IBAN-shaped groups that fail the checksum: every candidate is matched and checked,
#: the costliest text for gdpr-redact (~2-5 us a character).
IBANISH = "DE89 3704 0044 0532 0130 01 "
CTX = PolicyContext(route="r", channel="app", tenant="t", request_id="x")


def counted(n: int, log: list[str]) -> Steps[int]:
    try:
        for i in range(n):
            log.append(f"step {i}")
            yield
    finally:
        log.append("closed")
    return n


async def test_the_driver_lets_other_tasks_run_between_steps() -> None:
    log: list[str] = []

    async def other() -> None:
        while True:
            log.append("other")
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other)
        await trio.lowlevel.checkpoint()  # the other task is running (it never blocks)
        log.clear()
        assert await run_sliced(counted(20, log), slice_s=0) == 20
        nursery.cancel_scope.cancel()
    steps = [x for x in log if x != "other"]
    assert steps == [f"step {i}" for i in range(20)] + ["closed"]
    # The other task ran while the work was being done (Trio orders each batch at
    # random, so not necessarily between every two steps).
    during = log[log.index("step 0") : log.index("closed")]
    assert during.count("other") >= 10


async def test_a_cancelled_scope_stops_the_work_at_a_checkpoint() -> None:
    log: list[str] = []
    with trio.CancelScope() as scope:
        scope.cancel()
        await run_sliced(counted(1_000, log), slice_s=0)
    assert log == ["step 0", "closed"]


@pytest.mark.parametrize("policy", ["gdpr-redact", "anti-fraud-v2"])
async def test_a_policy_on_a_long_text_reaches_checkpoints(policy: str) -> None:
    """Under the old code the whole text was one call: the other task never ran."""
    (p,) = build_policies([policy], make_config())
    text = (IBANISH * 4_000)[:100_000]
    ran = 0

    async def other() -> None:
        nonlocal ran
        while True:
            ran += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other)
        await trio.lowlevel.checkpoint()
        ran = 0
        await run_sliced(p.input_steps([Message(role="user", content=text)], CTX), slice_s=0)
        nursery.cancel_scope.cancel()
    assert ran >= 10


def test_redaction_in_steps_equals_redaction_at_once() -> None:
    rw = Rewriter(build_rules())
    text = ("call +86 138 0013 8000 or mail a.b@example.org; " + IBANISH) * 300
    n = 0

    def counting(steps: Steps[str]) -> Steps[str]:
        nonlocal n
        out = yield from steps
        return out

    wrapped = counting(rw.rewrite_steps(text))
    for _ in iter(lambda: next(wrapped, "end"), "end"):
        n += 1
    assert n > 5
    assert finish(rw.rewrite_steps(text)) == rw.rewrite(text)


# --- a real worker under the largest bodies ----------------------------------------

BODY_LIMIT = 1_048_576
MESSAGE_CHARS = 262_144  # the default limits.max_content_chars


@pytest.fixture(scope="module")
def sim_addr() -> Iterator[str]:
    with run_sim() as addr:
        yield addr


def gateway_text(sim: str, rec: Path, body_bytes: int = BODY_LIMIT) -> str:
    """Two routes to aiserve-sim: ``/v1/guarded`` (fraud scoring, redaction) and
    ``/v1/plain`` (its adapter counts tokens: the window is below the body's bytes;
    recorded, so the recorder redacts it)."""
    text = config_text(ttft_ms="0", inter_token_ms="0")
    text = text.replace("max_body_bytes = 8388608", f"max_body_bytes = {body_bytes}", 1)
    assert f"max_body_bytes = {body_bytes}" in text
    return (
        text
        + f"""
[adapters.sim]
kind = "openai"
base_url = "http://{sim}/v1"
models = ["sim-model"]
context_window = {body_bytes * 2 // 3}

[[routes]]
path = "/v1/guarded"
name = "guarded"
adapter = "sim"
default_model = "sim-model"
policies = ["anti-fraud-v2", "gdpr-redact"]

[[routes]]
path = "/v1/plain"
name = "plain"
adapter = "sim"
default_model = "sim-model"

[record]
enabled = true
path = "{rec}"
routes = ["/v1/plain"]
"""
    )


def _config(tmp_path: Path, sim: str) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(gateway_text(sim, tmp_path / "rec"))
    return path


def _has_lines(rec: Path) -> bool:
    return any(f.stat().st_size for f in rec.glob("rec-*.jsonl"))


async def written(rec: Path) -> None:
    """Until the recorder has put a line on disk (its thread writes it: nothing to await)."""
    while not await trio.to_thread.run_sync(_has_lines, rec):  # noqa: ASYNC110 - polled
        await trio.sleep(0.02)


def largest_body(body_bytes: int = BODY_LIMIT) -> bytes:
    """As many full-size messages of IBAN-shaped text as the body limit allows."""
    message = {"role": "user", "content": (IBANISH * 10_000)[:MESSAGE_CHARS]}
    n = max(body_bytes // len(json.dumps(message)), 1)
    return json.dumps({"model": "sim-model", "messages": [message] * n}).encode()


async def _probe(base: str, done: trio.Event, latencies: list[float]) -> None:
    """``GET /healthz`` every 10 ms on one keep-alive connection, until ``done``."""
    host, port = base.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        while not done.is_set():
            t0 = time.perf_counter()
            await stream.send_all(b"GET /healthz HTTP/1.1\r\nhost: probe\r\n\r\n")
            buf = b""
            while b"\r\n\r\n" not in buf:
                buf += await stream.receive_some(65536)
            head, _, rest = buf.partition(b"\r\n\r\n")
            length = int(
                next(
                    line.split(b":", 1)[1]
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
            )
            while len(rest) < length:
                rest += await stream.receive_some(65536)
            assert head.startswith(b"HTTP/1.1 200")
            latencies.append(time.perf_counter() - t0)
            await trio.sleep(0.01)


@pytest.mark.slow
async def test_healthz_stays_fast_while_the_largest_bodies_are_processed(
    tmp_path: Path, sim_addr: str
) -> None:
    body = largest_body()
    assert BODY_LIMIT - len(body) < len(body) // 3  # as many messages as fit
    headers = {"content-type": "application/json", "x-request-timeout-ms": "120000"}
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    with hypercorn_gateway(_config(tmp_path, sim_addr)) as (base, _):
        done = trio.Event()

        async def heavy(path: str) -> None:
            async with httpx2.AsyncClient(timeout=120) as c:
                r = await c.post(base + path, content=body, headers=headers)
                statuses[path] = r.status_code

        async def recorded() -> None:
            # The recorder works after the reply: wait until its line is on disk.
            await written(tmp_path / "rec")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(_probe, base, done, latencies)
            with trio.fail_after(90):
                async with trio.open_nursery() as work:
                    work.start_soon(heavy, "/v1/guarded")  # fraud scoring + redaction
                    work.start_soon(heavy, "/v1/plain")  # tokenizer, then the recorder
                await recorded()
            done.set()
    assert statuses == {"/v1/guarded": 200, "/v1/plain": 200}
    assert len(latencies) >= 20
    p99 = statistics.quantiles(latencies, n=100)[98]
    assert p99 < 0.100, f"/healthz p99 {p99 * 1000:.0f} ms over {len(latencies)} probes"
