"""The README's "Providers" commands, run as written against real processes: aiserve-sim
speaking every provider's API, the gateway on ``configs/examples/providers.toml``, one
request per model through one path."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from .servers import ROOT, hypercorn_gateway
from .sim_process import run_sim
from .test_readme import GATEWAY, SIM, run, sh_block

pytestmark = pytest.mark.slow


def test_one_path_serves_every_provider_and_the_mock(tmp_path: Path) -> None:
    commands = sh_block("configs/examples/providers.toml", "/sim/requests")
    assert commands[0].startswith(".venv/bin/aiserve-sim")
    export = next(c for c in commands if c.startswith("export "))
    env = dict(part.split("=", 1) for part in shlex.split(export)[1:])
    assert {"ANTHROPIC_API_KEY", "AZURE_OPENAI_API_KEY", "GEMINI_API_KEY"} <= set(env)
    loop = "\n".join(
        commands[commands.index(next(c for c in commands if c.startswith("for m in"))) :][:3]
    )
    with run_sim() as sim:
        config = (
            (ROOT / "configs/examples/providers.toml").read_text().replace("127.0.0.1:8100", sim)
        )
        path = ROOT / "bench" / "work" / "readme-providers.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(config)
        try:
            with hypercorn_gateway(path, env=env) as (base, _):
                replies = [
                    json.loads(line) for line in run(loop, gateway=base).splitlines() if line
                ]
                upstream = json.loads(run(commands[-2].split("#")[0], sim=f"http://{sim}"))
                models = json.loads(run(commands[-1].split("#")[0], gateway=base))
        finally:
            path.unlink()
    assert [r["model"] for r in replies] == [
        "claude-sonnet-4-5",
        "gpt-4o",
        "gemini-2.5-flash",
        "nova-pro",
        "aiserve-mock",
    ]
    for r in replies:
        assert r["choices"][0]["message"]["content"], r
    paths = [u["path"] for u in upstream["requests"]][-4:]
    assert paths[0] == "/v1/messages"
    assert paths[1].startswith(
        "/openai/deployments/prod-gpt4o-deployment/chat/completions?api-version="
    )
    assert paths[2] == "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse"
    assert paths[3] == "/model/amazon.nova-pro-v1:0/converse-stream"
    owners = {m["id"]: m["owned_by"] for m in models["data"]}
    assert owners == {
        "aiserve-mock": "mock",
        "claude-sonnet-4-5": "claude",
        "gpt-4o": "azure",
        "gemini-2.5-flash": "gemini",
        "nova-pro": "bedrock",
    }


def test_the_addresses_are_the_defaults() -> None:
    text = "\n".join(sh_block("configs/examples/providers.toml", "/sim/requests"))
    assert GATEWAY in text
    assert SIM in text
