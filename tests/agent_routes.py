"""The gateway the agent-SDK tests talk to (tests/test_agent_sdks.py, tests/test_ai_sdk_node.py):
aiserve-sim behind an ``openai`` adapter (Chat Completions and Responses routes, Responses
translated to Chat), an ``openai`` adapter with ``wire = "responses"`` (a Responses route:
the native pass-through) and an ``anthropic`` adapter (a Messages route: native too), as docs/coding-agents.md's
"Agent SDKs" section sets them up; the embedded default's routes stay (the mock)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from .conftest import config_text
from .servers import hypercorn_gateway

ROUTES = """
[adapters.up]
kind = "openai"
base_url = "http://{sim}/v1"
models = ["sim-model"]

[adapters.claude]
kind = "anthropic"
base_url = "http://{sim}"
api_key_env = "AGENT_SDK_ANTHROPIC_KEY"
models = ["claude-sonnet-4-5"]

# OpenAI clients: base_url = GATEWAY/oai/v1
[[routes]]
path = "/oai/v1/chat/completions"
name = "oai_chat"
kind = "chat"
adapter = "up"

[[routes]]
path = "/oai/v1/responses"
name = "oai_responses"
kind = "responses"
adapter = "up"

# Anthropic clients, translated to Chat Completions: base_url = GATEWAY/oai
[[routes]]
path = "/oai/v1/messages"
name = "oai_messages"
kind = "messages"
adapter = "up"

# OpenAI clients, Responses passed through natively: base_url = GATEWAY/native/v1
[adapters.resp]
kind = "openai"
wire = "responses"
base_url = "http://{sim}/v1"
models = ["sim-model"]
api_key_env = "AGENT_SDK_OPENAI_KEY"

[[routes]]
path = "/native/v1/responses"
name = "native_responses"
kind = "responses"
adapter = "resp"

# Anthropic clients: base_url = GATEWAY/claude (GATEWAY/claude/v1 for the AI SDK)
[[routes]]
path = "/claude/v1/messages"
name = "claude"
kind = "messages"
adapter = "claude"
"""

#: The key the gateway sends to the Anthropic dialect (not the client's).
PROVIDER_KEY = "sim-anthropic-key"


@contextlib.contextmanager
def agent_gateway(sim: str, conf_dir: Path) -> Iterator[str]:
    """Run the gateway for ``sim`` (``host:port``); yield its base URL."""
    # ChatAnthropic asks for the model's most output tokens (64,000 for claude-sonnet-4-5),
    # above the default [limits] max_tokens (32,768): docs/coding-agents.md says so.
    text = config_text(max_tokens="65536")
    assert "\nmax_tokens = 65536" in text
    cfg = conf_dir / "gateway.toml"
    cfg.write_text(text + ROUTES.replace("{sim}", sim))
    env = {"AGENT_SDK_ANTHROPIC_KEY": PROVIDER_KEY, "AGENT_SDK_OPENAI_KEY": "sim-openai-key"}
    with hypercorn_gateway(cfg, env=env) as (base, _):
        yield base
