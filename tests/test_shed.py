"""Shedding under overload, on the virtual clock: ``[deadline] queue_share`` (a request
that waited past that share of its deadline before its upstream call could start) and
``ttft_ms`` (a stream whose upstream has not started answering in time) answer 503 with
``Retry-After`` at once instead of late, counted in ``aiserve_shed``; both off by default."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest
import trio

from aiserve_trio.config import parse_config
from aiserve_trio.core.budgets import DeadlineConfig, plan
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client, Response, chat_body
from .conftest import config_text


def shed_app(deadline: str = "", **mock: str) -> App:
    """The default config with the mock paced by ``mock`` and ``deadline`` lines added to
    ``[deadline]``."""
    text = config_text(**mock)
    text = re.sub(r"(?m)^(min_inference_ms = .*)$", lambda m: m.group(1) + "\n" + deadline, text)
    return App(parse_config(text, source="<test>"))


def shed_count(app: App, reason: str) -> float:
    for line in app.metrics.render().decode().splitlines():
        if line.startswith(f'aiserve_shed_total{{reason="{reason}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def assert_shed(resp: Response, code: str = "shed") -> None:
    assert resp.status == 503
    assert resp.headers["retry-after"] == "1"
    assert json.loads(resp.body)["error"]["code"] == code


def test_budget_names_why_a_request_is_shed() -> None:
    b = plan(100.0, 10_100, reserve_ms=100, min_inference_ms=50, context=0.4, inference=0.35,
             queue_share=0.25, ttft_ms=1500)
    assert (b.queue_end, b.first_byte_end) == (102.5, 101.5)
    assert b.shed(101.0, stream=True) is None
    assert b.shed(101.5, stream=False) is None  # the TTFT budget is a stream's
    assert b.shed(101.5, stream=True) == "ttft"
    assert b.shed(102.5, stream=False) == "queue"
    off = plan(100.0, 10_100, reserve_ms=100, min_inference_ms=50, context=0.4, inference=0.35)
    assert (off.queue_end, off.first_byte_end) == (math.inf, math.inf)
    assert off.shed(1e9, stream=True) is None


def test_queue_share_must_be_a_share() -> None:
    with pytest.raises(ValueError, match="queue_share"):
        DeadlineConfig(queue_share=1.5)
    with pytest.raises(ValueError, match="ttft_ms"):
        DeadlineConfig(ttft_ms=-1)


async def test_stream_past_its_ttft_budget_is_shed_at_the_budget(autojump_clock: Any) -> None:
    """The backend takes 2 s to its first token; the TTFT budget is 0.5 s: the stream gets a
    503 at 0.5 s, not a late answer (and not a 504 at its deadline)."""
    app = shed_app("ttft_ms = 500", ttft_ms="2000")
    client = Client(app)
    start = trio.current_time()
    resp = await client.chat(chat_body(stream=True))
    assert trio.current_time() - start == pytest.approx(0.5, abs=0.01)
    assert_shed(resp)
    assert shed_count(app, "ttft") == 1
    # Not a stream: the TTFT budget does not apply, the answer comes.
    plain = await client.chat(chat_body())
    assert plain.status == 200
    assert shed_count(app, "ttft") == 1


async def test_stream_that_answers_in_time_is_not_cut_later(autojump_clock: Any) -> None:
    """The TTFT cut is lifted by the first delta: a stream whose tokens then take far
    longer than the TTFT budget runs to its end."""
    app = shed_app("ttft_ms = 500", ttft_ms="100", inter_token_ms="300")
    start = trio.current_time()
    resp = await Client(app).chat(chat_body(stream=True))
    assert resp.status == 200
    assert resp.events()[-1] == "[DONE]"
    assert trio.current_time() - start > 1.0
    assert shed_count(app, "ttft") == 0


async def test_shedding_is_off_by_default(autojump_clock: Any) -> None:
    app = shed_app("", ttft_ms="2000")
    resp = await Client(app).chat(chat_body(stream=True))
    assert resp.status == 200
    assert shed_count(app, "ttft") == shed_count(app, "queue") == 0


async def test_request_past_its_queue_budget_is_shed_before_the_upstream(
    autojump_clock: Any,
) -> None:
    """A 10 s deadline with queue_share 0.2: a request that reaches its upstream call
    after ~2 s (here its body took that long) is shed at once, one that reaches it
    after 1 s is served."""
    app = shed_app("queue_share = 0.2", ttft_ms="10")
    client = Client(app)
    body = json.dumps(chat_body()).encode()
    parts = [body[:-2], body[-2:-1], body[-1:]]
    hdrs = {"x-request-timeout-ms": "10000", "content-type": "application/json"}
    late_start = trio.current_time()
    async with client.open("POST", "/v1/chat/completions", body=parts, headers=hdrs,
                           body_delay=1.0) as ex:
        await ex.done.wait()
    late = ex.response
    # Shed at once when it reached the upstream call (2 s), not at its deadline (10 s).
    assert trio.current_time() - late_start == pytest.approx(2.0, abs=0.05)
    assert_shed(late)
    assert shed_count(app, "queue") == 1
    async with client.open("POST", "/v1/chat/completions", body=parts, headers=hdrs,
                           body_delay=0.5) as ex:
        await ex.done.wait()
    assert ex.response.status == 200
    assert shed_count(app, "queue") == 1
