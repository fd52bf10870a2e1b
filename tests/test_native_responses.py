"""Native pass-through of the Responses API (issue 44): a ``responses`` route whose backend
speaks Responses (``wire = "responses"``) sends the client's body as sent and returns the
provider's events as sent -- proven by the openai SDK and by the real Codex CLI (real
processes: the hypercorn binary and aiserve-sim's Responses dialect)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest

from aiserve_trio.config import parse_config
from aiserve_trio.core.errors import ConfigError

from .conftest import config_text
from .servers import hypercorn_gateway
from .sim_process import run_sim
from .test_codex_cli import note_task, run_codex

pytestmark = pytest.mark.slow

CARD = "4111 1111 1111 1111"
TOOLS: Any = [
    {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with run_sim() as addr:
        yield addr


@pytest.fixture(scope="module")
def gateway(sim: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    extra = f"""
[adapters.resp]
kind = "openai"
wire = "responses"
base_url = "http://{sim}/v1"
models = ["sim-model"]
api_key_env = "NATIVE_TEST_OPENAI_KEY"

[[routes]]
path = "/native/v1/responses"
name = "native"
kind = "responses"
adapter = "resp"
default_model = "sim-model"

[[routes]]
path = "/redacting/v1/responses"
name = "redacting"
kind = "responses"
adapter = "resp"
policies = ["gdpr-redact"]
"""
    cfg: Path = tmp_path_factory.mktemp("conf") / "gateway.toml"
    cfg.write_text(config_text() + extra)
    with hypercorn_gateway(cfg, env={"NATIVE_TEST_OPENAI_KEY": "sim-openai-key"}) as (base, _):
        yield base


def upstream(sim: str) -> dict[str, Any]:
    requests = httpx2.get(f"http://{sim}/sim/requests").json()["requests"]
    return dict(requests[-1])


def test_the_provider_gets_the_clients_body_to_the_byte(gateway: str, sim: str) -> None:
    body = {
        "model": "sim-model",
        "instructions": "Be brief.",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}],
        "tools": TOOLS,
        "tool_choice": "auto",
        "reasoning": {"effort": "low", "summary": "auto"},
        "include": ["reasoning.encrypted_content"],
        "store": False,
        "prompt_cache_key": "k-1",
        "stream": True,
        # Unknown to the gateway's codec (a translated route refuses them): they travel.
        "safety_settings_v9": {"level": "strict"},
    }
    body["input"].append({"type": "item_reference", "id": "msg_earlier"})
    raw = json.dumps(body, separators=(",", ":")).encode()
    r = httpx2.post(
        f"{gateway}/native/v1/responses",
        content=raw,
        headers={"content-type": "application/json", "openai-beta": "responses=v1"},
    )
    assert r.status_code == 200, r.text
    up = upstream(sim)
    assert up["path"] == "/v1/responses"
    assert up["body"].encode() == raw
    assert up["headers"]["openai-beta"] == "responses=v1"
    assert "x-aiserve-dropped" not in r.headers  # nothing dropped: it all went
    kinds = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert kinds[0] == "response.created"
    assert kinds[-1] == "response.completed"
    # The provider's own events: its reasoning item with the encrypted content it wrote.
    completed = json.loads(r.text.rsplit("data: ", 1)[1])
    reasoning = [i for i in completed["response"]["output"] if i["type"] == "reasoning"]
    assert reasoning
    assert reasoning[0]["encrypted_content"]


def test_the_sdk_streams_and_gets_a_whole_native_response(gateway: str) -> None:
    with openai.OpenAI(api_key="k", base_url=f"{gateway}/native/v1", max_retries=0) as sdk:
        with sdk.responses.stream(
            model="sim-model", input="What is the weather in Oslo?", tools=TOOLS
        ) as stream:
            streamed = stream.get_final_response()
        whole = sdk.responses.create(
            model="sim-model", input="What is the weather in Oslo?", tools=TOOLS
        )
    for response in (streamed, whole):
        calls = [item for item in response.output if item.type == "function_call"]
        assert calls, response.output
        assert calls[0].name == "get_weather"
        assert json.loads(calls[0].arguments) is not None
        assert response.status == "completed"
        assert response.usage is not None
        assert response.usage.output_tokens > 0


def test_a_redacting_route_redacts_the_native_body(gateway: str, sim: str) -> None:
    body = {
        "model": "sim-model",
        "user": f"card {CARD}",
        "metadata": {"note": f"card {CARD}"},
        "input": [
            {"role": "user", "content": f"my card is {CARD}"},
            {"type": "function_call", "call_id": "c1", "name": "pay", "arguments": json.dumps({"card": CARD})},
            {"type": "function_call_output", "call_id": "c1", "output": f"charged {CARD}"},
        ],
    }  # fmt: skip
    r = httpx2.post(f"{gateway}/redacting/v1/responses", json=body)
    assert r.status_code == 200, r.text
    sent = upstream(sim)["body"]
    assert "4111" not in sent
    items = json.loads(sent)["input"]
    assert items[0]["content"].startswith("my card is ")
    assert json.loads(items[1]["arguments"]) == {"card": "[CARD]"}
    assert r.json()["object"] == "response"


@pytest.mark.skipif(shutil.which("codex") is None, reason="the Codex CLI is not installed")
def test_codex_runs_a_command_natively_through_the_gateway(
    gateway: str, sim: str, tmp_path: Path
) -> None:
    word, prompt = note_task(tmp_path)
    run, answer = run_codex(tmp_path, f"{gateway}/native/v1", prompt)
    assert run.returncode == 0, run.stderr[-4000:]
    assert word in answer, (answer, run.stderr[-4000:])
    asked = [json.loads(r["body"]) for r in httpx2.get(f"http://{sim}/sim/requests").json()["requests"] if r["path"] == "/v1/responses"][-2:]  # fmt: skip
    first, second = asked
    # Natively: what Codex sends reaches the provider, include and all.
    assert first["include"] == ["reasoning.encrypted_content"]
    assert second["input"][-1]["type"] == "function_call_output"
    assert word in second["input"][-1]["output"]


def test_an_adapter_that_speaks_only_responses_serves_only_native_responses_routes() -> None:
    adapter = '[adapters.r]\nkind = "openai"\nwire = "responses"\nbase_url = "http://x/v1"\nmodels = ["q"]\n'
    for route in (
        'path = "/r/v1/chat/completions"\nadapter = "r"',
        'path = "/r/v1/responses"\nkind = "responses"\nadapter = "r"\nnative = false',
    ):
        with pytest.raises(ConfigError, match='wire = "responses"'):
            parse_config(f"{config_text()}\n{adapter}\n[[routes]]\n{route}\n", source="t")
