"""The gateway under the real hypercorn binary in front of a real aiserve-sim (module fixture)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import config_text
from .servers import hypercorn_gateway
from .sim_process import run_sim


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(gateway base URL, sim base URL): hypercorn + the gateway in front of aiserve-sim."""
    with run_sim() as sim:
        extra = f"""
[adapters.up]
kind = "openai"
base_url = "http://{sim}/v1"
models = ["sim-model"]

[adapters.ws]
kind = "vllm_ws"
url = "ws://{sim}/v1/ws"
models = ["sim-model"]

[[routes]]
path = "/v1/up"
name = "up"
adapter = "up"

[[routes]]
path = "/v1/ws"
name = "ws"
adapter = "ws"

# Where the openai SDK finds the sim through the gateway (base_url = GATEWAY/sdk/v1)
[[routes]]
path = "/sdk/v1/chat/completions"
name = "sdk"
adapter = "up"

[[routes]]
path = "/sdk/v1/embeddings"
name = "sdk_embeddings"
kind = "embeddings"
adapter = "up"
"""
        cfg: Path = tmp_path_factory.mktemp("conf") / "gateway.toml"
        cfg.write_text(config_text() + extra)
        with hypercorn_gateway(cfg) as (base, _):
            yield base, f"http://{sim}"
