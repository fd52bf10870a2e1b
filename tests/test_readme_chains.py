"""The README's Chains commands, run as written against real processes.

The block starts the gateway on ``configs/examples/chains.toml`` and ``aiserve-sim``;
here both run on free ports (the config's sim address replaced), and every other
command runs through bash from the repository root with only the addresses and
``.venv/bin/python`` replaced.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .servers import ROOT, hypercorn_gateway
from .sim_process import run_sim
from .test_readme import sh_block

pytestmark = pytest.mark.slow


def test_the_chains_example_runs_as_the_readme_says(tmp_path: Path) -> None:
    commands = sh_block("configs/examples/chains.toml", "wavtool chat")
    assert commands[0].startswith("AISERVE_CONFIG=configs/examples/chains.toml ")
    assert any(c.startswith(".venv/bin/aiserve-sim") for c in commands)
    runnable = [c for c in commands if "hypercorn" not in c and "aiserve-sim &" not in c]
    config = (ROOT / "configs/examples/chains.toml").read_text()
    with run_sim() as sim:
        cfg = tmp_path / "chains.toml"
        cfg.write_text(config.replace("127.0.0.1:8100", sim))
        with hypercorn_gateway(cfg) as (base, _):
            outputs = []
            for command in runnable:
                line = (
                    command.replace("http://127.0.0.1:8000", base)
                    .replace("http://127.0.0.1:8100", f"http://{sim}")
                    .replace(".venv/bin/python", sys.executable)
                )
                out = subprocess.run(
                    ["bash", "-o", "pipefail", "-c", line],
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                    timeout=30,
                    check=False,
                )
                assert out.returncode == 0, (line, out.stdout, out.stderr)
                outputs.append(out.stdout)
    typed, spoken, on_sim, paths = outputs
    assert "x-aiserve-steps: intent,pick,generate,comply\n" in typed  # no audio: no asr
    assert "The fee is [rate available from your adviser] a month" in typed
    assert "x-aiserve-steps: asr,intent,pick,generate,comply\n" in spoken
    assert "x-aiserve-deployment: mock_large\n" in spoken
    assert '"content":"This "' in spoken  # the larger model's answer
    assert "3.85" not in spoken
    assert spoken.rstrip().endswith("data: [DONE]")
    assert "x-aiserve-deployment: sim_large\n" in on_sim
    assert paths.split() == [
        '"path":"/v1/audio/transcriptions"',
        '"path":"/v1/chat/completions"',
        '"path":"/v1/chat/completions"',
    ]
