"""The README's record -> replay -> compare commands, run as written against real processes.

Only the addresses, the recording directory and the mock's pacing are changed; the
console script is run as ``python -m aiserve_trio.replay`` (the same ``main``), so
the test does not depend on the package being installed with its scripts.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from .conftest import config_text
from .servers import ROOT, hypercorn_gateway
from .test_readme import DOCS
from .test_record_labels import TABLE

pytestmark = pytest.mark.slow



def record_block() -> list[str]:
    """The commands of the README's record/replay/compare block (comments dropped)."""
    (block,) = [b for b in re.findall(r"```sh\n(.*?)```", DOCS, re.S) if "aiserve-replay" in b]
    lines = block.replace("\\\n", " ").splitlines()
    return [" ".join(line.split()) for line in lines if line.strip() and not line.startswith("#")]


def post(base: str, body: dict[str, Any]) -> int:
    req = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "authorization": "Bearer not-recorded"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()
        return int(r.status)


def replay(command: str, cwd: Path, **targets: str) -> subprocess.CompletedProcess[str]:
    for old, new in targets.items():
        command = command.replace(old, new)
    args = shlex.split(command)
    assert args[0] == ".venv/bin/aiserve-replay"
    return subprocess.run(
        [sys.executable, "-m", "aiserve_trio.replay", *args[1:], "--quiet"],
        cwd=cwd,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def wait_for_lines(directory: Path, n: int) -> list[Path]:
    """The recording's files once they hold ``n`` lines (the writer batches; 10 s at most)."""
    deadline = time.monotonic() + 10
    while True:
        files = list(directory.glob("rec-*.jsonl"))
        if sum(len(f.read_text().splitlines()) for f in files) >= n or time.monotonic() > deadline:
            return files
        time.sleep(0.05)


def test_record_replay_compare_as_the_readme_says(tmp_path: Path) -> None:
    record_cmd, baseline_cmd, candidate_cmd = record_block()
    config_path = re.search(r"AISERVE_CONFIG=(\S+)", record_cmd)
    assert config_path is not None
    assert ".venv/bin/hypercorn --config configs/hypercorn.toml aiserve_trio:app" in record_cmd

    # 1. record, with the example config (the recording goes to this test's folder).
    example = (ROOT / config_path[1]).read_text()
    assert 'path = "../../recordings"' in example
    fast = example.replace("ttft_ms = 60", "ttft_ms = 5").replace("inter_token_ms = 20", "inter_token_ms = 2")
    recording_config = tmp_path / "record.toml"
    recording_config.write_text(fast.replace('path = "../../recordings"', 'path = "recordings"'))
    bodies = [{**b, "stream": True} for _, b, _ in TABLE if "messages" in b][:10]
    with hypercorn_gateway(recording_config) as (base, _), ThreadPoolExecutor(4) as pool:
        assert set(pool.map(lambda b: post(base, b), bodies)) == {200}
        # The replay against the recording gateway itself is not recorded.
        (written,) = wait_for_lines(tmp_path / "recordings", len(bodies))
        copy = tmp_path / "copy"
        copy.mkdir()
        copy.joinpath(written.name).write_text(written.read_text())
        out = replay(baseline_cmd.replace("recordings/", "copy/"), tmp_path, **{"http://127.0.0.1:8000": base})
        assert out.returncode == 0, out.stderr
    recorded = list((tmp_path / "recordings").glob("rec-*.jsonl"))
    assert len(recorded) == 1
    assert len(recorded[0].read_text().splitlines()) == len(bodies)
    assert "not-recorded" not in recorded[0].read_text()

    # 2. the baseline, 3. a slower candidate: the gate fails.
    production = tmp_path / "production.toml"
    production.write_text(config_text(ttft_ms="5", inter_token_ms="2"))
    slower = tmp_path / "candidate.toml"
    slower.write_text(config_text(ttft_ms="300", inter_token_ms="2"))
    with hypercorn_gateway(production) as (prod, _), hypercorn_gateway(slower) as (cand, _):
        urls = {"http://127.0.0.1:8000": prod, "http://127.0.0.1:8001": cand}
        out = replay(baseline_cmd, tmp_path, **urls)
        assert out.returncode == 0, out.stderr
        assert (tmp_path / "baseline.json").exists()
        assert "| intent=sql |" in (tmp_path / "baseline.md").read_text()
        out = replay(candidate_cmd, tmp_path, **urls)
        assert out.returncode == 1, out.stdout + out.stderr
        assert "FAIL: overall ttft_ms p99" in out.stdout
