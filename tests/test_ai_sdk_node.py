"""The Vercel AI SDK (``ai`` 6 with ``@ai-sdk/openai`` and ``@ai-sdk/anthropic``) through the
gateway (issue 44): ``streamText`` with a tool and ``stopWhen``, run by ``node`` from
tests/node/ (``npm ci --prefix tests/node``, as .ci/run does), finishes a tool-using turn on
the Responses route (what ``openai(model)`` speaks), the Chat Completions route
(``openai.chat(model)``) and the Messages route on an ``anthropic`` adapter (the native
pass-through). Real processes: node, the hypercorn binary and aiserve-sim."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .agent_routes import PROVIDER_KEY, agent_gateway
from .sim_process import run_sim

NODE_DIR = Path(__file__).resolve().parent / "node"
SCRIPT = NODE_DIR / "ai_sdk_tool.mjs"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("node") is None, reason="node is not installed (.ci/run installs it)"
    ),
    pytest.mark.skipif(
        not (NODE_DIR / "node_modules" / "ai").is_dir(),
        reason="the AI SDK is not installed: npm ci --prefix tests/node (.ci/run does)",
    ),
]

PROMPT = 'What is the weather in Oslo?\nsim-call: get_weather {"city": "Oslo"}'


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with run_sim() as addr:
        yield addr


@pytest.fixture(scope="module")
def gateway(sim: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with agent_gateway(sim, tmp_path_factory.mktemp("conf")) as base:
        yield base


def run_node(provider: str, base_url: str, model: str, prompt: str = PROMPT) -> dict[str, Any]:
    proc = subprocess.run(
        ["node", str(SCRIPT), provider, base_url, model, prompt],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def sim_requests(sim: str) -> list[dict[str, Any]]:
    return list(httpx.get(f"http://{sim}/sim/requests").json()["requests"])


#: (the script's provider, the base URL's path, the model, what the sim then receives)
CASES = [
    # openai(model), the provider's default, speaks Responses; the openai adapter sends Chat
    ("openai", "/oai/v1", "sim-model", "/v1/chat/completions"),
    ("openai", "/native/v1", "sim-model", "/v1/responses"),  # ... or passes it through
    ("openai-chat", "/oai/v1", "sim-model", "/v1/chat/completions"),
    ("anthropic", "/claude/v1", "claude-sonnet-4-5", "/v1/messages"),  # native
]


@pytest.mark.parametrize(
    ("provider", "prefix", "model", "path"),
    CASES,
    ids=["openai", "openai-native", "openai-chat", "anthropic"],
)
def test_stream_text_runs_the_tool_and_answers(
    gateway: str, sim: str, provider: str, prefix: str, model: str, path: str
) -> None:
    out = run_node(provider, gateway + prefix, model)
    assert out["ran"] == ["Oslo"]  # the tool ran, once, with the model's input
    first, second = out["steps"]
    assert first["finishReason"] == "tool-calls"
    assert first["toolCalls"] == [{"name": "get_weather", "input": {"city": "Oslo"}}]
    assert first["toolResults"] == ["sunny in Oslo"]
    # the tool's result went back in the second request, and the model quoted it
    assert second["toolCalls"] == []
    assert second["finishReason"] == "stop"
    assert out["finishReason"] == "stop"
    assert out["text"].startswith("The tool returned: ")
    assert "sunny in Oslo" in out["text"]
    assert out["parts"].count("text-delta") > 1  # streamed, not one piece
    assert second["dropped"] is None  # nothing left out
    up = sim_requests(sim)[-1]
    assert up["path"] == path
    assert "sunny in Oslo" in up["body"]  # the second request carried the tool's result
    if provider == "anthropic":
        assert up["headers"]["x-api-key"] == PROVIDER_KEY  # the gateway's, not the client's
        body = json.loads(up["body"])
        assert [b["type"] for b in body["messages"][-1]["content"]] == ["tool_result"]
        # natively, the tool as the AI SDK wrote it (a translated route drops this hint)
        assert body["tools"][0]["eager_input_streaming"] is True


def test_anthropic_provider_on_the_translated_default_route(gateway: str) -> None:
    """The embedded default's /v1/messages, translated to the built-in mock: the AI SDK's
    Anthropic provider sets ``eager_input_streaming`` on every tool, a hint the translation
    drops (it was a 400 before). The mock calls get_weather when asked about the weather in
    a city, and answers the tool's result with its default reply."""
    out = run_node("anthropic", gateway + "/v1", "aiserve-mock", "What is the weather in Oslo?")
    assert out["ran"] == ["Oslo"]
    first, second = out["steps"]
    assert first["toolCalls"] == [{"name": "get_weather", "input": {"city": "Oslo"}}]
    assert second["toolCalls"] == []
    assert second["text"].startswith("I am the aiserve-trio mock model")
    assert first["dropped"] == second["dropped"] == "eager_input_streaming"
