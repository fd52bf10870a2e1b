"""``aiserve-replay`` replays a recording holding a chat line and an MCP tool-call line
against a live gateway (hypercorn, the faulty SDK server over stdio): both are sent,
measured and counted in the report, by their labels too; a JSON-RPC error is an error."""

from __future__ import annotations

import io
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from aiserve_trio.replay.cli import main
from aiserve_trio.replay.stats import report_decoder

from .servers import hypercorn_gateway
from .test_mcp_record import KEY, gateway_toml, tools_call

pytestmark = pytest.mark.slow


def post(url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "content-type": "application/json", "authorization": f"Bearer {KEY}", **headers})  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
        out: dict[str, Any] = json.loads(r.read())
        return out


def lines_in(directory: Path, n: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 15
    while True:
        text = "".join(f.read_text() for f in sorted(directory.glob("rec-*.jsonl")))
        lines = [json.loads(x) for x in text.splitlines()]
        if len(lines) >= n or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def wait_ready(base: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with urllib.request.urlopen(base + "/healthz", timeout=5) as r:
            if json.loads(r.read())["mcp"]["faulty"]["state"] == "ready":
                return
        time.sleep(0.1)
    raise AssertionError("the faulty MCP server did not start")


def test_a_recording_of_a_chat_and_a_tool_call_replays_against_a_live_gateway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recordings = tmp_path / "rec"
    config = tmp_path / "gw.toml"
    config.write_text(gateway_toml(recordings))
    mcp_headers = {"accept": "application/json, text/event-stream"}
    with hypercorn_gateway(config) as (base, _):
        wait_ready(base)
        chat = {"model": "aiserve-mock", "messages": [{"role": "user", "content": "hello"}]}
        post(base + "/v1/chat/completions", chat, {})
        answer = post(base + "/mcp", tools_call("faulty__echo", {"text": "hi"}), mcp_headers)
        assert "result" in answer
        lines = lines_in(recordings, 2)
        assert sorted(x["route"] for x in lines) == ["/mcp", "/v1/chat/completions"]
        recorded = sorted(recordings.glob("rec-*.jsonl"))

        def replay(report: Path, *extra: str) -> Any:
            out = io.StringIO()
            code = main([*map(str, recorded), "--target", base, "--api-key-env", "REPLAY_KEY",
                         "--report", str(report), "--quiet", *extra], stdout=out)  # fmt: skip
            assert code == 0, out.getvalue()
            return report_decoder.decode(report.with_suffix(".json").read_bytes())

        monkeypatch.setenv("REPLAY_KEY", KEY)
        # Weighted by the tool-call labels: (all but surely) only tool calls are drawn.
        only_tools = replay(tmp_path / "tools", "--weights", "server=faulty:1e9", "--seed", "3",
                            "--concurrency", "1", "--max-requests", "8")  # fmt: skip
        # Every record once, in order (no weights): the chat and the tool call.
        both = replay(tmp_path / "both", "--rate", "50")
        # The replay's own calls are not recorded again.
        time.sleep(0.5)
        assert len(lines_in(recordings, 2)) == 2
    assert both.overall.requests == 2
    assert both.overall.errors == 0, both.overall.error_kinds
    assert both.labels["server=faulty"].requests == 1
    assert both.labels["tool=echo"].requests == 1
    assert both.overall.total_ms.p99 is not None
    assert both.labels["server=faulty"].total_ms.p50 is not None
    assert only_tools.overall.requests == 8
    assert only_tools.overall.errors == 0, only_tools.overall.error_kinds
    assert only_tools.labels["server=faulty"].requests == 8
    assert only_tools.labels["unlabelled"].requests == 0  # the chat line, not drawn


def test_a_replayed_tool_call_the_key_may_not_make_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recording = tmp_path / "r.jsonl"
    line = {"v": 2, "started": 1000.0, "offset": 0.0, "route": "/mcp",
            "body": tools_call("faulty__pid", {}), "headers": {"x-channel": "mcp"},
            "labels": {"server": "faulty", "tool": "pid"},
            "outcome": {"status": "ok", "total_ms": 3.0, "result_bytes": 40}}  # fmt: skip
    recording.write_text(json.dumps(line) + "\n")
    config = tmp_path / "gw.toml"
    config.write_text(gateway_toml(tmp_path / "rec"))
    monkeypatch.setenv("REPLAY_KEY", KEY)
    with hypercorn_gateway(config) as (base, _):
        wait_ready(base)
        out = io.StringIO()
        code = main([str(recording), "--target", base, "--concurrency", "1", "--max-requests", "2",
                     "--api-key-env", "REPLAY_KEY", "--report", str(tmp_path / "rep"), "--quiet"],
                    stdout=out)  # fmt: skip
    assert code == 0
    report = report_decoder.decode((tmp_path / "rep.json").read_bytes())
    assert report.overall.requests == 2
    assert report.overall.errors == 2
    assert set(report.overall.error_kinds) == {"rpc_-32003"}
