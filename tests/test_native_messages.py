"""Native pass-through (issue 44): a Messages client on a ``messages`` route whose backend
is ``anthropic`` -- the body reaches the provider as the client sent it and the
provider's events come back as it sent them, while the pipeline's stages still run
(real processes: the hypercorn binary and aiserve-sim's Anthropic dialect)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import pytest

from .conftest import config_text
from .servers import hypercorn_gateway
from .sim_process import run_sim

pytestmark = pytest.mark.slow

CARD = "4111 1111 1111 1111"


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with run_sim() as addr:
        yield addr


@pytest.fixture(scope="module")
def gateway(sim: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    extra = f"""
[adapters.claude]
kind = "anthropic"
base_url = "http://{sim}"
api_key_env = "NATIVE_TEST_ANTHROPIC_KEY"
models = ["claude-sonnet-4-5", "claude-haiku-4-5"]

[[routes]]
path = "/claude/v1/messages"
name = "claude"
kind = "messages"
adapter = "claude"

[[routes]]
path = "/translated/v1/messages"
name = "translated"
kind = "messages"
adapter = "claude"
native = false

[[routes]]
path = "/redacting/v1/messages"
name = "redacting"
kind = "messages"
adapter = "claude"
policies = ["gdpr-redact"]
"""
    cfg: Path = tmp_path_factory.mktemp("conf") / "gateway.toml"
    cfg.write_text(config_text() + extra)
    env = {"NATIVE_TEST_ANTHROPIC_KEY": "sim-anthropic-key"}
    with hypercorn_gateway(cfg, env=env) as (base, _):
        yield base


def upstream(sim: str) -> dict[str, Any]:
    """The last request the sim received (path, headers, body as sent)."""
    requests = httpx2.get(f"http://{sim}/sim/requests").json()["requests"]
    return dict(requests[-1])


BODY: dict[str, Any] = {
    "model": "claude-sonnet-4-5",
    "max_tokens": 4096,
    "system": [
        {"type": "text", "text": "You are a coding agent."},
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
    ],
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "hello", "cache_control": {"type": "ephemeral"}},
            ],
        }
    ],
    "thinking": {"type": "enabled", "budget_tokens": 2048},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "metadata": {"user_id": "user_abc_account_def_session_ghi"},
    "stream": True,
}


def test_the_provider_gets_the_clients_body_to_the_byte(gateway: str, sim: str) -> None:
    raw = json.dumps(BODY, separators=(",", ":")).encode()
    headers = {
        "content-type": "application/json",
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "interleaved-thinking-2025-05-14,context-management-2025-06-27",
        "x-api-key": "client-key",
    }
    r = httpx2.post(f"{gateway}/claude/v1/messages?beta=true", content=raw, headers=headers)
    assert r.status_code == 200, r.text
    up = upstream(sim)
    assert up["path"] == "/v1/messages"
    assert up["body"].encode() == raw
    assert up["headers"]["anthropic-beta"] == headers["anthropic-beta"]
    assert up["headers"]["x-api-key"] == "sim-anthropic-key"  # the gateway's, not the client's
    events = [e for e in r.text.split("\n\n") if e]
    assert events[0].startswith("event: message_start")
    assert events[-1].startswith("event: message_stop")
    kinds = [json.loads(e.split("data: ", 1)[1])["type"] for e in events]
    assert "content_block_delta" in kinds
    assert "x-aiserve-dropped" not in r.headers


def test_the_sdk_streams_and_adds_up_a_native_reply(gateway: str) -> None:
    with anthropic.Anthropic(api_key="k", base_url=f"{gateway}/claude", max_retries=0) as client:
        kwargs: Any = {k: v for k, v in BODY.items() if k not in ("stream", "context_management")}
        kwargs["extra_body"] = {"context_management": BODY["context_management"]}
        with client.messages.stream(**kwargs) as stream:
            streamed = stream.get_final_message()
        whole = client.messages.create(**kwargs)
    for message in (streamed, whole):
        kinds = [b.type for b in message.content]
        assert kinds[0] == "thinking", kinds
        assert "text" in kinds
        assert message.stop_reason == "end_turn"
        assert message.usage.output_tokens > 0


def test_a_redacting_route_redacts_the_native_body_and_nothing_else(gateway: str, sim: str) -> None:
    body = {
        **BODY,
        "stream": False,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": f"my card is {CARD}"},
                    {"type": "text", "text": "ok", "cache_control": {"type": "ephemeral"}},
                ],
            }
        ],
    }
    r = httpx2.post(f"{gateway}/redacting/v1/messages", json=body)
    assert r.status_code == 200, r.text
    sent = json.loads(upstream(sim)["body"])
    assert CARD not in json.dumps(sent)
    text = sent["messages"][0]["content"][0]["text"]
    assert text.startswith("my card is ")
    assert "4111" not in text
    # Everything else as the client sent it.
    assert sent["messages"][0]["content"][1] == body["messages"][0]["content"][1]
    assert sent["system"] == body["system"]
    assert sent["context_management"] == body["context_management"]
    reply = r.json()
    assert reply["type"] == "message"
    assert reply["content"][0]["type"] == "thinking"


def test_a_translated_route_drops_and_names_hints(gateway: str) -> None:
    # The embedded default's /v1/messages route answers with the mock: another API.
    r = httpx2.post(f"{gateway}/v1/messages", json={**BODY, "model": "aiserve-mock"})
    assert r.status_code == 200, r.text
    dropped = {d.strip() for d in r.headers["x-aiserve-dropped"].split(",")}
    assert dropped == {"cache_control", "context_management"}


def test_native_false_translates_even_to_a_backend_that_speaks_messages(
    gateway: str, sim: str
) -> None:
    r = httpx2.post(f"{gateway}/translated/v1/messages", json=BODY)
    assert r.status_code == 200, r.text
    sent = json.loads(upstream(sim)["body"])
    assert sent["system"] == "You are a coding agent.Be brief."  # the translation's
    assert "context_management" not in sent
    dropped = {d.strip() for d in r.headers["x-aiserve-dropped"].split(",")}
    assert dropped == {"cache_control", "context_management"}
