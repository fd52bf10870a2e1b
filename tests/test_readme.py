"""The documentation's shell instructions, run as written against real processes.

Each test finds a ``sh`` block of the site's pages (docs/; they were the README's
sections) by what it is about, starts the
servers the block starts (hypercorn, aiserve-sim) on free ports, and runs its
``curl`` commands through bash with only the addresses replaced.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .servers import BIN, ROOT, free_port, hypercorn_gateway
from .sim_process import FAST_ARGS, run_sim

pytestmark = pytest.mark.slow

#: The site's pages: the README's sections and their commands moved there (issue 53;
#: docs/readme-map.md says where each went). Each block is on one page only.
DOCS = "\n".join(p.read_text() for p in sorted((ROOT / "docs").rglob("*.md")))
GATEWAY = "http://127.0.0.1:8000"
SIM = "http://127.0.0.1:8100"


def sh_block(*needles: str) -> list[str]:
    """The commands of the docs' ``sh`` block that has every needle (continuations joined)."""
    blocks = [b for b in re.findall(r"```sh\n(.*?)```", DOCS, re.S) if all(n in b for n in needles)]
    assert len(blocks) == 1, f"one docs sh block should have {needles}, found {len(blocks)}"
    return [line.strip() for line in blocks[0].replace("\\\n", " ").splitlines() if line.strip()]


def run(command: str, **addresses: str) -> str:
    for old, new in addresses.items():
        command = command.replace({"gateway": GATEWAY, "sim": SIM}[old], new)
    out = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.returncode == 0, (command, out.stdout, out.stderr)
    return out.stdout


def test_bank_policy_actions_can_be_seen_with_the_readme_keys():
    commands = sh_block("configs/examples/bank.toml", "/metrics")
    assert "AISERVE_CONFIG=configs/examples/bank.toml" in commands[0]
    curls = [c for c in commands if c.startswith("curl")]
    with hypercorn_gateway(ROOT / "configs/examples/bank.toml") as (base, _):
        outputs = [run(c, gateway=base) for c in curls]
    assert "[CARD]" in outputs[0]
    assert "4111" not in outputs[0]
    assert '"type":"authentication_error"' not in "".join(outputs)
    assert 'policy_actions_total{action="redacted",policy="gdpr_redact"}' in outputs[-1]


def test_faults_reach_the_gateway_as_the_readme_says(tmp_path: Path):
    commands = sh_block("aiserve-sim --fault")
    (sim_command,) = [c for c in commands if "aiserve-sim" in c]
    sim_args = shlex.split(sim_command, comments=True)[1:]
    config = (ROOT / "configs/examples/sim-openai.toml").read_text()
    with run_sim([*sim_args, *FAST_ARGS]) as addr:
        cfg = tmp_path / "sim-openai.toml"
        cfg.write_text(config.replace("127.0.0.1:8100", addr))
        with hypercorn_gateway(cfg) as (base, _):
            outputs = [
                run(c, gateway=base, sim=f"http://{addr}")
                for c in commands
                if c.startswith("curl")
            ]
    assert outputs[0].startswith("HTTP/1.1 502")
    assert '"type":"upstream_error"' in outputs[0]
    assert '"faults":{"503":3}' in outputs[-1]


def test_x_sim_fault_sent_to_the_gateway_changes_nothing(tmp_path: Path):
    # What the README says: the header is the simulator's, the gateway does not pass it on.
    config = (ROOT / "configs/examples/sim-openai.toml").read_text()
    with run_sim() as addr:
        cfg = tmp_path / "sim-openai.toml"
        cfg.write_text(config.replace("127.0.0.1:8100", addr))
        with hypercorn_gateway(cfg) as (base, _):
            out = run(
                f"curl -sS -i {base}/v1/chat/completions -H 'content-type: application/json'"
                " -H 'X-Sim-Fault: 503' -d '{\"model\": \"sim-model\", \"messages\":"
                " [{\"role\": \"user\", \"content\": \"hi\"}]}'"
            )
            stats = run(f"curl -s http://{addr}/sim/stats")
    assert out.startswith("HTTP/1.1 200")
    assert '"faults":{}' in stats
    assert "The gateway does not pass a client's `X-Sim-Fault` on" in " ".join(DOCS.split())


def test_the_ha_example_runs_as_the_readme_says(tmp_path: Path):
    commands = sh_block("configs/examples/ha.toml", "--bind 127.0.0.1:8101")
    sims = [shlex.split(c, comments=True) for c in commands if "aiserve-sim" in c]
    assert [s[1:3] for s in sims] == [["--bind", "127.0.0.1:8101"], ["--bind", "127.0.0.1:8102"]]
    (curl,) = [c for c in commands if c.startswith("curl")]
    config = (ROOT / "configs/examples/ha.toml").read_text()
    with run_sim() as a, run_sim() as b:
        cfg = tmp_path / "ha.toml"
        cfg.write_text(config.replace("127.0.0.1:8101", a).replace("127.0.0.1:8102", b))
        with hypercorn_gateway(cfg) as (base, _):
            out = run(curl, gateway=base)
    headers = dict(line.split(": ", 1) for line in out.strip().splitlines())
    assert headers["x-aiserve-deployment"] in ("sim_a", "sim_b")
    assert headers["x-aiserve-fallback"] == "0"


def test_reload_runs_as_the_readme_says(tmp_path: Path):
    commands = sh_block("/admin/config/reload")
    cfg = tmp_path / "gateway.toml"

    def here(command: str) -> str:
        return command.replace("configs/aiserve.toml", str(ROOT / "configs/aiserve.toml")).replace(
            "gateway.toml", str(cfg)
        )

    assert commands[0] == "cp configs/aiserve.toml gateway.toml"
    assert commands[1].startswith("AISERVE_CONFIG=gateway.toml ./scripts/serve")
    run(here(commands[0]))
    with hypercorn_gateway(cfg) as (base, _):
        outputs = [run(here(c), gateway=base) for c in commands[2:]]
    applied, status, refused, saved = (json.loads(o) for o in outputs if o)
    # The watcher (every 5 s) may have loaded the edit a moment before the POST did.
    assert applied["applied"] or applied["unchanged"]
    assert status["version"] == applied["version"]
    assert status["loaded_by"] in ("api:loopback", "watch")
    assert status["source"] == str(cfg)
    assert refused["error"]["code"] == "config_refused"
    assert refused["error"]["param"] == "limits.max_inflight"
    assert refused["error"]["message"] == f"{cfg}: key `limits.max_inflight`: must be positive"
    assert saved["applied"] is True
    assert saved["version"] != applied["version"]
    assert cfg.read_text() == (ROOT / "configs/aiserve.toml").read_text()
    shown = " ".join(DOCS.split())
    assert "key `limits.max_inflight`: must be positive" in shown


def test_responses_and_messages_run_as_the_readme_says(tmp_path: Path, config_file: Path):
    curls = [c for c in sh_block("/v1/responses", "/v1/messages", "x-api-key") if c.startswith("curl")]
    (python,) = [
        b for b in re.findall(r"```python\n(.*?)```", DOCS, re.S) if "previous_response_id=r.id" in b
    ]
    with hypercorn_gateway(config_file) as (base, _):
        host = base.removeprefix("http://")
        outputs = [run(c.replace("localhost:8000", host)) for c in curls]
        script = tmp_path / "sdks.py"
        script.write_text(python.replace("http://localhost:8000", base))
        sdk = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False
        )
    tool, events, claude, refused = outputs
    reply = json.loads(tool)
    assert [i["type"] for i in reply["output"]] == ["reasoning", "function_call"]
    assert json.loads(reply["output"][1]["arguments"]) == {"city": "Paris"}
    assert events.split() == [
        "event:",
        "response.created",
        "event:",
        "response.in_progress",
        "event:",
        "response.output_item.added",
        "event:",
        "response.content_part.added",
        *["event:", "response.output_text.delta"] * 2,
        "event:",
        "response.output_text.done",
        "event:",
        "response.content_part.done",
        "event:",
        "response.output_item.done",
        "event:",
        "response.completed",
    ]
    assert claude.startswith("event: message_start")
    assert '"text":"Hello!"' in claude
    assert '"stop_reason":"end_turn"' in claude
    assert claude.rstrip().endswith('event: message_stop\ndata: {"type":"message_stop"}')
    assert json.loads(refused) == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "`max_tokens`: field required [missing_required_parameter]",
        },
    }
    assert sdk.returncode == 0, sdk.stderr
    printed = sdk.stdout.splitlines()
    assert printed[0].startswith("Hello! I am the aiserve-trio mock model")
    assert printed[1].startswith("and what did I say first? ")
    assert int(printed[1].rsplit(" ", 1)[1]) > 30  # the first turn went to the model too
    assert printed[2] == "tool_use ['thinking', 'tool_use'] {'city': 'Oslo'}"


def test_a_backend_over_tls_runs_as_the_readme_says(tmp_path: Path):
    commands = sh_block("sim-openai-tls.toml", "trustme")
    trustme_cmd, sim_cmd, gateway_cmd, *curls = commands
    assert trustme_cmd.startswith("mkdir -p certs && .venv/bin/python -m trustme -q -d certs")
    assert "AISERVE_CONFIG=configs/examples/sim-openai-tls.toml" in gateway_cmd
    # The example's ca_file is relative to its folder: certs/ two levels up, as in the repo.
    examples = tmp_path / "configs" / "examples"
    examples.mkdir(parents=True)
    subprocess.run(
        ["bash", "-c", trustme_cmd.replace(".venv/", f"{ROOT}/.venv/")],
        cwd=tmp_path,
        check=True,
        capture_output=True,
    )
    sim_args = [a.replace("certs/", f"{tmp_path}/certs/") for a in shlex.split(sim_cmd)[1:]]
    config = (ROOT / "configs/examples/sim-openai-tls.toml").read_text()
    with run_sim([*sim_args, *FAST_ARGS]) as addr:
        cfg = examples / "sim-openai-tls.toml"
        cfg.write_text(config.replace("127.0.0.1:8100", addr))
        with hypercorn_gateway(cfg) as (base, _):
            outputs = [run(c, gateway=base) for c in curls]
    assert json.loads(outputs[0])["choices"][0]["message"]["content"]
    assert 'aiserve_upstream_tls_handshakes_total{adapter="sim",kind="full"} 1.0' in outputs[1]


def sample_after(*needles: str) -> list[str]:
    """The lines of the plain sample-output block right after the README's ``sh`` block with
    every needle: what the README says the commands print."""
    for m in re.finditer(r"```sh\n(.*?)```\s*\n```\n(.*?)```", DOCS, re.S):
        if all(n in m[1] for n in needles):
            return [line for line in m[2].splitlines() if line.strip()]
    raise AssertionError(f"no sample output after a docs sh block with {needles}")


def test_the_cors_preflight_prints_what_the_readme_shows(tmp_path: Path):
    (curl,) = sh_block("Access-Control-Request-Method")
    (cors,) = [b for b in re.findall(r"```toml\n(.*?)```", DOCS, re.S) if b.startswith("[cors]")]
    cfg = tmp_path / "cors.toml"
    cfg.write_text((ROOT / "configs/aiserve.toml").read_text() + "\n" + cors)
    with hypercorn_gateway(cfg) as (base, _):
        out = run(curl, gateway=base)
    printed = [line.rstrip() for line in out.replace("\r", "").splitlines() if line.strip()]
    printed = [line for line in printed if not line.lower().startswith(("date:", "server:"))]
    assert printed == sample_after("Access-Control-Request-Method")


def test_tls_with_a_throwaway_certificate_runs_as_the_readme_says(tmp_path: Path):
    openssl, server, curl = sh_block("openssl req -x509", "hypercorn-tls.toml")
    subprocess.run(["bash", "-c", openssl], cwd=tmp_path, check=True, capture_output=True, timeout=60)
    assert (tmp_path / "certs/server.pem").exists()
    assert server.startswith(".venv/bin/hypercorn --config configs/examples/hypercorn-tls.toml")
    port = free_port()
    proc = subprocess.Popen(
        [str(BIN / "hypercorn"), "--config", str(ROOT / "configs/examples/hypercorn-tls.toml"),
         "--bind", f"127.0.0.1:{port}", "aiserve_trio:app"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 20
        out = ""
        while time.monotonic() < deadline:
            done = subprocess.run(
                ["bash", "-c", curl.replace("localhost:8443", f"localhost:{port}")],
                cwd=tmp_path, capture_output=True, text=True, timeout=30, check=False,
            )
            if done.returncode == 0:
                out = done.stdout
                break
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stdout:
            proc.stdout.close()
    body, version = out.rsplit(" ", 1)
    assert version.strip() == "2"
    assert json.loads(body)["choices"][0]["message"]["content"] == "over TLS"
