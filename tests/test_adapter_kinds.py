"""The table of adapter kinds: every ``kind`` a config may write builds its own adapter."""

from __future__ import annotations

import typing

import pytest

from aiserve_trio.adapters import build_adapter
from aiserve_trio.adapters.settings import (
    KINDS,
    AdapterConfig,
    AnthropicAdapterConfig,
    AzureOpenAIAdapterConfig,
    BedrockAdapterConfig,
    GeminiAdapterConfig,
    GroupAdapterConfig,
    GroupDeployment,
    MockAdapterConfig,
    OpenAIAdapterConfig,
    VllmWsAdapterConfig,
)
from aiserve_trio.config import parse_config

#: One valid table of each kind, and the adapter class it must build.
EXAMPLES: dict[str, tuple[AdapterConfig, str]] = {
    "mock": (MockAdapterConfig(), "MockAdapter"),
    "openai": (OpenAIAdapterConfig(base_url="http://x.test/v1", models=["m"]), "OpenAIAdapter"),
    "vllm_ws": (VllmWsAdapterConfig(url="ws://x.test/ws", models=["m"]), "VllmWsAdapter"),
    "anthropic": (AnthropicAdapterConfig(models=["m"]), "AnthropicAdapter"),
    "azure_openai": (
        AzureOpenAIAdapterConfig(base_url="https://n.openai.azure.com", models=["m"]),
        "AzureOpenAIAdapter",
    ),
    "gemini": (GeminiAdapterConfig(models=["m"]), "GeminiAdapter"),
    "bedrock": (BedrockAdapterConfig(region="us-east-1", models=["m"]), "BedrockAdapter"),
}


def test_every_kind_the_config_decodes_is_in_the_table() -> None:
    decoded = {cls.__struct_config__.tag: cls for cls in typing.get_args(AdapterConfig)}
    assert {kind: k.settings for kind, k in KINDS.items()} == decoded


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_each_kind_builds_its_own_adapter(kind: str) -> None:
    settings, adapter = EXAMPLES[kind]
    built = build_adapter("a", settings)
    assert type(built).__name__ == adapter
    assert built.name == "a"


def test_every_kind_but_a_group_has_an_example() -> None:
    assert sorted(EXAMPLES) == sorted(k for k in KINDS if k != "group")


def test_a_group_is_not_built_alone() -> None:
    group = GroupAdapterConfig(models=["m"], deployments=[GroupDeployment(adapter="x")])
    with pytest.raises(ValueError, match="adapter kind GroupAdapterConfig is not available"):
        build_adapter("g", group)


def test_a_kind_written_in_the_config_is_decoded_into_its_settings() -> None:
    cfg = parse_config(
        "[auth]\nenabled = false\n"
        '[adapters.a]\nkind = "gemini"\nmodels = ["m"]\n'
        '[adapters.b]\nkind = "vllm_ws"\nurl = "ws://x.test/ws"\nmodels = ["n"]\n'
        '[[routes]]\npath = "/v1/chat/completions"\nadapter = "a"\n'
    )
    assert type(cfg.adapters["a"]) is KINDS["gemini"].settings
    assert type(cfg.adapters["b"]) is KINDS["vllm_ws"].settings
