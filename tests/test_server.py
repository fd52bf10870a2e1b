"""The gateway under the real hypercorn binary: HTTP/1.1, h2c, h2 over TLS, real clients."""

from __future__ import annotations

import json
import os
import re
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import httpx
import openai
import pytest
import trustme
from openai.types.chat import ChatCompletionMessageParam

from .servers import hypercorn_gateway

pytestmark = pytest.mark.slow

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "echo: hello big world"}]
CHAT: dict[str, object] = {"model": "aiserve-mock", "messages": MESSAGES}


@pytest.fixture(scope="module")
def tls_gateway(
    config_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, trustme.CA]]:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    d = tmp_path_factory.mktemp("tls")
    certfile, keyfile = d / "cert.pem", d / "key.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(certfile))
    cert.private_key_pem.write_to_path(str(keyfile))
    args = ["--certfile", str(certfile), "--keyfile", str(keyfile)]
    with hypercorn_gateway(config_file, extra_args=args, scheme="https") as (base, _):
        yield base, ca


def sse_payloads(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def streamed_text(payloads: list[str]) -> str:
    out = []
    for p in payloads:
        if p != "[DONE]":
            for ch in json.loads(p)["choices"]:
                out.append(ch["delta"].get("content") or "")
    return "".join(out)


def metric(base: str, name: str, **labels: str) -> float:
    text = httpx.get(base + "/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            got = line[len(name) :].split(" ")[0].strip("{}")
            if all(part in got.split(",") for part in want.split(",") if part):
                total += float(line.rsplit(" ", 1)[1])
    return total


def wait_until(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")


def curl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["curl", "-sS", "-N", *args], capture_output=True, text=True, timeout=30, check=True
    )


# --- HTTP versions -----------------------------------------------------------


def test_curl_http11_stream_ends_in_done(gateway):
    body = json.dumps({**CHAT, "stream": True})
    r = curl(
        gateway + "/v1/chat/completions",
        "-H",
        "content-type: application/json",
        "-d",
        body,
        "-w",
        "\n%{http_version}",
    )
    payloads = sse_payloads(r.stdout)
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[0])["object"] == "chat.completion.chunk"
    assert streamed_text(payloads) == "hello big world"
    assert r.stdout.rstrip().endswith("1.1")


def test_curl_h2c_prior_knowledge_stream_ends_in_done(gateway):
    body = json.dumps({**CHAT, "stream": True})
    r = curl(
        "--http2-prior-knowledge",
        gateway + "/v1/chat/completions",
        "-H",
        "content-type: application/json",
        "-d",
        body,
        "-w",
        "\n%{http_version}",
    )
    payloads = sse_payloads(r.stdout)
    assert payloads[-1] == "[DONE]"
    assert streamed_text(payloads) == "hello big world"
    assert r.stdout.rstrip().endswith("\n2")


def test_httpx_h2c_negotiates_http2(gateway):
    with httpx.Client(http1=False, http2=True) as c:
        r = c.post(gateway + "/v1/chat/completions", json=CHAT)
    assert r.http_version == "HTTP/2"
    assert r.json()["choices"][0]["message"]["content"] == "hello big world"


def test_tls_alpn_negotiates_h2_and_http11(tls_gateway):
    base, ca = tls_gateway
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    with (
        httpx.Client(http2=True, verify=ctx) as c,
        c.stream("POST", base + "/v1/chat/completions", json={**CHAT, "stream": True}) as r,
    ):
        assert r.http_version == "HTTP/2"
        text = r.read().decode()
    assert sse_payloads(text)[-1] == "[DONE]"
    with httpx.Client(http2=False, verify=ctx) as c:
        r = c.post(base + "/v1/chat/completions", json=CHAT)
    assert r.http_version == "HTTP/1.1"
    assert r.status_code == 200


def test_tls_example_config_is_hypercorn_toml():
    from hypercorn.config import Config

    cfg = Config.from_toml(
        str(Path(__file__).parent.parent / "configs/examples/hypercorn-tls.toml")
    )
    assert cfg.worker_class == "trio"
    assert cfg.certfile
    assert cfg.keyfile
    assert cfg.alpn_protocols == ["h2", "http/1.1"]


# --- the official OpenAI client ------------------------------------------------


def test_openai_sync_client_streaming_and_not(gateway):
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="not-needed-locally", max_retries=0)
    done = client.chat.completions.create(model="aiserve-mock", messages=MESSAGES)
    assert done.choices[0].message.content == "hello big world"
    assert done.usage is not None
    assert done.usage.completion_tokens == 3
    stream = client.chat.completions.create(
        model="aiserve-mock",
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == "hello big world"
    assert usage is not None
    assert usage.total_tokens > 3
    models = client.models.list()
    assert [m.id for m in models.data] == ["aiserve-mock"]


def test_openai_client_sees_errors_as_api_errors(gateway):
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-nope", messages=MESSAGES)
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]


# --- disconnects reach the pipeline ----------------------------------------------


SLOW = {
    "model": "aiserve-mock",
    "stream": True,
    "messages": [{"role": "user", "content": "echo: " + " ".join(["word"] * 2000)}],
}


def test_http11_status_lines_name_the_status(gateway):
    """The seam names the status (``200 OK``): ``h2load --h1`` reads the status from the
    reason phrase and counts an answer without one as failed. hypercorn as shipped writes
    the empty phrase h11 is given (valid HTTP/1.1)."""
    host, port = gateway.removeprefix("http://").split(":")
    shipped = os.environ.get("AISERVE_HYPERCORN_PATCHES", "").strip().lower() == "off"
    for target, line in ((b"/healthz", b"200 OK"), (b"/nowhere", b"404 Not Found")):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"GET %s HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n" % target)
            got = b""
            while b"\r\n" not in got:
                more = s.recv(65536)
                assert more, got
                got += more
        status = line.split(b" ")[0]
        expected = b"HTTP/1.1 %s \r\n" % status if shipped else b"HTTP/1.1 %s\r\n" % line
        assert got.startswith(expected), got[:40]


def test_http11_close_mid_stream_cancels_the_request(gateway):
    before = metric(gateway, "aiserve_client_disconnects_total")
    body = json.dumps(SLOW).encode()
    host, port = gateway.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        got = b""
        while got.count(b"data: ") < 3:
            got += s.recv(65536)
    wait_until(lambda: metric(gateway, "aiserve_client_disconnects_total") == before + 1)
    wait_until(lambda: metric(gateway, "task_count_by_stage") == 0)


def test_h2_rst_stream_cancels_the_request_and_the_connection_goes_on(gateway):
    before = metric(gateway, "aiserve_client_disconnects_total")
    host, port = gateway.removeprefix("http://").split(":")
    body = json.dumps(SLOW).encode()
    with socket.create_connection((host, int(port))) as s:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        s.sendall(conn.data_to_send())

        def request(payload: bytes) -> int:
            sid = conn.get_next_available_stream_id()
            conn.send_headers(
                sid,
                [
                    (":method", "POST"),
                    (":path", "/v1/chat/completions"),
                    (":scheme", "http"),
                    (":authority", "x"),
                    ("content-type", "application/json"),
                ],
            )
            conn.send_data(sid, payload, end_stream=True)
            s.sendall(conn.data_to_send())
            return sid

        def pump(until) -> bytes:
            data = b""
            while not until(data):
                for ev in conn.receive_data(s.recv(65536)):
                    if isinstance(ev, h2.events.DataReceived):
                        conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                        data += ev.data
                    if isinstance(ev, h2.events.StreamEnded):
                        data += b"<END>"
                s.sendall(conn.data_to_send())
            return data

        sid = request(body)
        pump(lambda d: d.count(b"data: ") >= 3)
        conn.reset_stream(sid)
        s.sendall(conn.data_to_send())
        wait_until(lambda: metric(gateway, "aiserve_client_disconnects_total") == before + 1)
        wait_until(lambda: metric(gateway, "task_count_by_stage") == 0)
        # the same connection still serves a new stream
        request(json.dumps({**CHAT, "stream": True}).encode())
        tail = pump(lambda d: b"<END>" in d)
        assert b"data: [DONE]" in tail
        assert re.search(rb'"content":"hello"', tail)
