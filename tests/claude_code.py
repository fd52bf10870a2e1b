"""The real Claude Code CLI (``claude``, ``npm install -g @anthropic-ai/claude-code``) in
print mode, pointed at a base URL, with nothing of the machine's own ``~/.claude`` and no
traffic but the model's: for tests/test_claude_code.py, and to record what it sends.

``python -m tests.claude_code record`` runs it once against a fresh ``aiserve-sim`` and
writes its first turn (:data:`FIXTURE`): the path with its query string, the headers and
the body exactly as sent, scrubbed of what belongs to the machine or the run (the
device id, the session id, the date, the kernel's version; the key is the fixture's).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .sim_process import run_sim

FIXTURE = Path(__file__).parent / "data" / "claude_code_first_turn.json"
#: Model names Claude Code treats as Claude Sonnet 4.5 / Haiku 4.5: with them and
#: MAX_THINKING_TOKENS it sends ``thinking: {"type": "enabled", "budget_tokens": N}``
#: (an unknown name gets ``{"type": "adaptive"}``). The sim serves any name.
MODEL = "claude-sonnet-4-5"
SMALL_MODEL = "claude-haiku-4-5"
THINKING_TOKENS = 2048
#: What the Read task's note says; the answer must quote it.
SECRET = "The secret word is pelican-42."
#: The key Claude Code sends (the sim takes any key).
KEY = "sk-claude-code-test"


def claude_binary() -> str | None:
    return shutil.which("claude")


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


def claude_env(base_url: str, home: Path, key: str = KEY) -> dict[str, str]:
    """The environment Claude Code runs with (docs/coding-agents.md): only these, plus PATH."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),  # a fresh ~/.claude and ~/.claude.json
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": key,
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": SMALL_MODEL,
        "MAX_THINKING_TOKENS": str(THINKING_TOKENS),
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }


def read_task(work: Path) -> tuple[Path, str]:
    """A note in ``work`` and the prompt that makes the sim call ``Read`` on it."""
    work.mkdir(parents=True, exist_ok=True)
    note = work / "NOTE.txt"
    note.write_text(SECRET + "\n")
    prompt = (
        "Read NOTE.txt and tell me the secret word.\n"
        f"sim-call: Read {json.dumps({'file_path': str(note)})}"
    )
    return note, prompt


def run_claude(
    base_url: str, root: Path, prompt: str, *, key: str = KEY, timeout: float = 120
) -> Run:
    """``claude -p PROMPT`` in ``root/work`` with HOME ``root/home``."""
    binary = claude_binary()
    assert binary is not None, "claude is not installed"
    (root / "home").mkdir(parents=True, exist_ok=True)
    (root / "work").mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [binary, "-p", prompt],
        cwd=root / "work",
        env=claude_env(base_url, root / "home", key),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return Run(done.returncode, done.stdout, done.stderr)


def sim_requests(addr: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"http://{addr}/sim/requests", timeout=5) as r:
        return list(json.load(r)["requests"])


def message_requests(addr: str) -> list[dict[str, Any]]:
    """The ``/v1/messages`` requests the sim at ``addr`` received, oldest first."""
    return [r for r in sim_requests(addr) if r["path"].split("?")[0] == "/v1/messages"]


#: Headers not kept in the fixture: the transport's and the key.
_DROPPED = ("host", "content-length", "connection", "accept-encoding", "x-api-key")
_SESSION = "00000000-0000-4000-8000-000000000000"


def scrub(request: dict[str, Any], root: Path) -> dict[str, Any]:
    """A logged request as the fixture keeps it (see the module docstring)."""
    body: str = request["body"]
    # The session's id is in metadata.user_id (and a header, which a gateway may not pass).
    found = re.search(r'\\"session_id\\":\\"([0-9a-f-]{36})', body)
    session = found.group(1) if found else ""
    if session:
        body = body.replace(session, _SESSION)
    body = re.sub(r'(\\"device_id\\":\\")[0-9a-f]{64}', r"\g<1>" + "0" * 64, body)
    body = re.sub(r"Today's date is \d{4}-\d{2}-\d{2}", "Today's date is 2026-01-01", body)
    body = re.sub(r"OS Version: [^\\]*", "OS Version: Linux 6.0.0", body)
    body = body.replace(str(root), "/tmp/claude-code")
    # The project's directory under ~/.claude/projects is named after the working one.
    body = body.replace(re.sub(r"[^A-Za-z0-9]", "-", str(root)), "-tmp-claude-code")
    json.loads(body)  # still the JSON it was
    headers = {k: v for k, v in request["headers"].items() if k not in _DROPPED}
    if "x-claude-code-session-id" in headers:
        headers["x-claude-code-session-id"] = _SESSION
    return {"path": request["path"], "headers": headers, "body": body}


def record(root: Path) -> dict[str, Any]:
    """Run Claude Code's Read task against a fresh sim; its first turn, scrubbed."""
    with run_sim() as addr:
        _, prompt = read_task(root / "work")
        run = run_claude(f"http://{addr}", root, prompt)
        assert run.returncode == 0, run.stderr + run.stdout
        first = message_requests(addr)[0]
    version = subprocess.run(
        [claude_binary() or "claude", "--version"], capture_output=True, text=True, check=True
    ).stdout.split()[0]
    return {"claude_code": version, **scrub(first, root)}


if __name__ == "__main__":
    if sys.argv[1:] != ["record"]:
        sys.exit("usage: python -m tests.claude_code record")
    # A fixed root, so the paths in the prompt read the same in every recording.
    fixed = Path("/tmp/claude-code")
    shutil.rmtree(fixed, ignore_errors=True)
    turn = record(fixed)
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(turn, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {FIXTURE} (Claude Code {turn['claude_code']}, {len(turn['body'])} bytes)")
