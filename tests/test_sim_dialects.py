"""aiserve-sim's provider dialects in process, on the virtual clock: `--dialect` picks what
is served, every dialect's stream keeps the timing model's schedule, and faults reach each
in its provider's shape. (Each dialect's wire format is proven by its SDK in
tests/test_sim_*_sdk.py.)"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing

from aiserve_trio.sim.app import SimApp
from aiserve_trio.sim.cli import build_parser, settings_from_args
from aiserve_trio.sim.model import SimSettings, Timing

from .asgi_client import Client

HI: Any = [{"role": "user", "content": "hi"}]
#: Dialect -> (path, headers, body) of a streamed request for 4 tokens.
ASKS: dict[str, tuple[str, dict[str, str], dict[str, Any]]] = {
    "anthropic": (
        "/v1/messages",
        {"x-api-key": "k", "anthropic-version": "2023-06-01"},
        {"model": "m", "max_tokens": 4, "stream": True, "messages": HI},
    ),
    "azure": (
        "/openai/deployments/d/chat/completions?api-version=2024-10-21",
        {"api-key": "k"},
        {"max_tokens": 4, "stream": True, "messages": HI},
    ),
    "gemini": (
        "/v1beta/models/m:streamGenerateContent?alt=sse",
        {"x-goog-api-key": "k"},
        {
            "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
            "generationConfig": {"maxOutputTokens": 4},
        },
    ),
    "bedrock": (
        "/model/m/converse-stream",
        {"authorization": "Bearer k"},
        {
            "messages": [{"role": "user", "content": [{"text": "hi"}]}],
            "inferenceConfig": {"maxTokens": 4},
        },
    ),
    "responses": (
        "/v1/responses",
        {"authorization": "Bearer k"},
        {"model": "m", "input": "hi", "max_output_tokens": 4, "stream": True},
    ),
}


def sim(dialects: tuple[str, ...] | None = None) -> SimApp:
    t = Timing(
        prefill_overhead_ms=100, prefill_per_token_ms=0, itl_ms=10, ttft_std_ms=0, itl_std_ms=0
    )
    settings = SimSettings(timing=t, seed=1)
    if dialects is not None:
        settings = SimSettings(timing=t, seed=1, dialects=dialects)
    return SimApp(settings)


async def ask(app: SimApp, dialect: str, **headers: str) -> Any:
    path, auth, body = ASKS[dialect]
    return await Client(app).request("POST", path, json_body=body, headers={**auth, **headers})


def test_the_dialect_flag() -> None:
    assert settings_from_args(build_parser().parse_args([])).dialects == (
        "anthropic",
        "azure",
        "gemini",
        "bedrock",
        "responses",
    )
    ns = build_parser().parse_args(["--dialect", "gemini", "--dialect", "bedrock"])
    assert settings_from_args(ns).dialects == ("gemini", "bedrock")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--dialect", "cohere"])


async def test_only_the_named_dialects_are_served(autojump_clock: trio.testing.MockClock) -> None:
    app = sim(("anthropic",))
    assert (await ask(app, "anthropic")).status == 200
    for other in ("azure", "gemini", "bedrock"):
        assert (await ask(app, other)).status == 404
    assert (await Client(app).chat({"model": "sim-model", "messages": HI})).status == 200


@pytest.mark.parametrize("dialect", list(ASKS))
async def test_every_dialect_streams_on_schedule(
    dialect: str, autojump_clock: trio.testing.MockClock
) -> None:
    app = sim()
    t0 = trio.current_time()
    r = await ask(app, dialect)
    assert r.status == 200, r.body
    # The opening (if any) at once, then four tokens 100 ms in and 10 ms apart, the
    # closing with the last.
    times = sorted({round(t - t0, 6) for t, chunk in r.chunks if chunk})
    assert times[-4:] == pytest.approx([0.100, 0.110, 0.120, 0.130])
    assert app.stats.completed == 1


@pytest.mark.parametrize(
    ("dialect", "kind"),
    [
        ("anthropic", "overloaded_error"),
        ("azure", "529"),
        ("gemini", "UNKNOWN"),
        ("bedrock", "InternalServerException"),
        ("responses", "server_error"),
    ],
)
async def test_a_status_fault_in_each_providers_shape(
    dialect: str, kind: str, autojump_clock: trio.testing.MockClock
) -> None:
    r = await ask(sim(), dialect, **{"x-sim-fault": "529"})
    assert r.status == 529
    assert kind in json.dumps(r.json())


@pytest.mark.parametrize("dialect", list(ASKS))
async def test_a_request_without_the_providers_auth_is_refused(
    dialect: str, autojump_clock: trio.testing.MockClock
) -> None:
    path, _, body = ASKS[dialect]
    r = await Client(sim()).request("POST", path, json_body=body)
    assert r.status in (401, 403)
