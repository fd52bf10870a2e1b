"""The example configs, as shipped, put the real gateway (hypercorn) in front of aiserve-sim.

Only the sim's address differs from the files (a free port instead of 8100).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx2
import pytest

from .servers import ROOT, hypercorn_gateway
from .sim_process import run_sim

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", ["sim-openai.toml", "sim-vllm-ws.toml"])
async def test_gateway_under_hypercorn_streams_from_the_sim(name: str, tmp_path: Path) -> None:
    text = (ROOT / "configs" / "examples" / name).read_text()
    with run_sim() as addr:
        cfg = tmp_path / name
        cfg.write_text(re.sub(r"127\.0\.0\.1:8100", addr, text))
        with hypercorn_gateway(cfg) as (base, _proc):
            body = {
                "model": "sim-model",
                "stream": True,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
            }
            async with httpx2.AsyncClient(timeout=10) as client:
                r = await client.post(f"{base}/v1/chat/completions", json=body)
                stats = (await client.get(f"http://{addr}/sim/stats")).json()
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text_out = "".join(
        (c["choices"][0]["delta"].get("content") or "")
        for c in map(json.loads, events[:-1])
        if c.get("choices")
    )
    assert text_out == "the quick brown fox"
    assert stats["completed"] == 1
