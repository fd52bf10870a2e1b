"""Every shipped example config loads and validates as it is."""

from __future__ import annotations

from pathlib import Path

import pytest
import trustme

from aiserve_trio.config import Config, OpenAIAdapterConfig, VllmWsAdapterConfig, load_config

EXAMPLES = Path(__file__).resolve().parent.parent / "configs" / "examples"
GATEWAY_CONFIGS = sorted(p for p in EXAMPLES.glob("*.toml") if not p.name.startswith("hypercorn"))


def test_there_are_examples() -> None:
    assert {"sim-openai.toml", "sim-vllm-ws.toml"} <= {p.name for p in GATEWAY_CONFIGS}


@pytest.mark.parametrize("path", GATEWAY_CONFIGS, ids=lambda p: p.name)
def test_example_loads(path: Path, tmp_path: Path) -> None:
    if "\nca_file" in path.read_text():
        # Its CA comes from `python -m trustme -d certs` at the repository's root: made here,
        # in the same place relative to a copy of the example.
        copy = tmp_path / "configs" / "examples" / path.name
        copy.parent.mkdir(parents=True)
        copy.write_text(path.read_text())
        (tmp_path / "certs").mkdir()
        trustme.CA().cert_pem.write_to_path(str(tmp_path / "certs" / "client.pem"))
        path = copy
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert cfg.routes


def test_sim_examples_point_at_the_default_sim_address() -> None:
    http = load_config(EXAMPLES / "sim-openai.toml").adapters["sim"]
    ws = load_config(EXAMPLES / "sim-vllm-ws.toml").adapters["sim"]
    assert isinstance(http, OpenAIAdapterConfig)
    assert http.base_url == "http://127.0.0.1:8100/v1"
    assert isinstance(ws, VllmWsAdapterConfig)
    assert ws.url == "ws://127.0.0.1:8100/v1/ws"


def test_ha_example_is_a_group_of_two_sims_with_fallbacks() -> None:
    from aiserve_trio.adapters import build_adapters
    from aiserve_trio.adapters.group import GroupAdapter
    from aiserve_trio.config import GroupAdapterConfig

    cfg = load_config(EXAMPLES / "ha.toml")
    ha = cfg.adapters["ha"]
    assert isinstance(ha, GroupAdapterConfig)
    urls = [cfg.adapters[d.adapter] for d in ha.deployments]
    assert [u.base_url for u in urls if isinstance(u, OpenAIAdapterConfig)] == [
        "http://127.0.0.1:8101/v1",
        "http://127.0.0.1:8102/v1",
    ]
    assert ha.fallbacks == ["small", "sorry"]
    assert cfg.routes[0].adapter == "ha"
    group = build_adapters(cfg.adapters)["ha"]
    assert isinstance(group, GroupAdapter)
    assert [m.fallback for m in group.members] == [0, 0, 1, 2]
    assert group.health.expected_ttft("sorry") == 0.005


def test_the_cache_example_caches_the_chat_route_of_the_sim() -> None:
    cfg = load_config(EXAMPLES / "cache.toml")
    (route,) = cfg.routes
    assert route.path == "/v1/chat/completions"
    assert route.cache is not None
    assert route.cache.enabled
    adapter = cfg.adapters[route.adapter]
    assert isinstance(adapter, OpenAIAdapterConfig)
    assert adapter.base_url == "http://127.0.0.1:8100/v1"
    assert cfg.cache.backend == "memory"
