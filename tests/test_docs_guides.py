"""The guides' calls on the embedded default, run as written against a real gateway.

The guides' examples that need a config of their own, a simulator or a second process
are run by tests/test_readme*.py (they find their blocks on the site's pages); these
are the ones a reader runs against ``./scripts/serve`` as it comes: what passes through
(a tool call with reasoning, embeddings, a field the mock cannot carry) and a session
carried from the app to WeChat. The gateway is hypercorn on the embedded default
(no ``AISERVE_CONFIG``); only the address in each command is changed.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator

import pytest

from .servers import ROOT, hypercorn_gateway

pytestmark = pytest.mark.slow

GUIDES = ROOT / "docs" / "guides"


def commands(page: str, *needles: str) -> list[str]:
    """The commands (continuations joined, comments dropped) of the page's one sh block with every needle."""
    text = (GUIDES / page).read_text()
    found = [b for b in re.findall(r"```sh\n(.*?)```", text, re.S) if all(n in b for n in needles)]
    assert len(found) == 1, (page, needles, len(found))
    joined = re.sub(r"\\\n\s*", " ", found[0])
    # a multi-line JSON body: join the lines inside its quotes
    joined = re.sub(r"'\{[^']*'", lambda m: " ".join(m.group(0).split()), joined)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.append(line.split("   # ")[0])
    return out


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    with hypercorn_gateway() as (base, _):
        yield base.removeprefix("http://")


def run(command: str, address: str) -> str:
    command = command.replace("localhost:8000", address).replace("127.0.0.1:8000", address)
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, (command, done.stderr)
    return done.stdout


def test_what_passes_through_answers_as_the_guide_says(gateway: str):
    tools, embeddings, logprobs = [
        run(c, gateway) for c in commands("apis.md", "get_weather", "/v1/embeddings")
    ]
    choice = json.loads(tools)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert choice["message"]["reasoning_content"]
    vectors = [d["embedding"] for d in json.loads(embeddings)["data"]]
    assert [len(v) for v in vectors] == [4, 4]
    error = json.loads(logprobs)["error"]
    assert error["param"] == "logprobs"
    # the page's comment: -> 400 "<the message>", "param": "logprobs"
    text = (GUIDES / "apis.md").read_text()
    (said,) = re.findall(r'# -> 400 "(`logprobs`[^"]+)"', text)
    assert error["message"].startswith(said)


def test_a_session_goes_from_the_app_to_wechat_as_the_guide_says(gateway: str):
    first, second = [run(c, gateway) for c in commands("sessions.md", "X-Session-Id: s-42")]
    assert json.loads(first)["choices"][0]["message"]["content"]
    # "uses the income and term": the second channel's answer knows them
    reply = json.loads(second)["choices"][0]["message"]["content"]
    assert "12000 CNY" in reply
    assert "20 years" in reply


def test_the_http2_cleartext_call_is_answered_over_http2(gateway: str):
    (call,) = commands("tls-http2.md", "--http2-prior-knowledge")
    # -w: curl says which protocol it spoke, after the body
    reply = run(call + " -w '\\n%{http_version}'", gateway)
    body, version = reply.rsplit("\n", 1)
    assert version == "2"
    assert (
        "aiserve-trio is a streaming AI gateway"
        in json.loads(body)["choices"][0]["message"]["content"]
    )
