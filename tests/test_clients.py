"""Real clients against the gateway under the hypercorn binary.

What tests/test_server.py does not already cover: the official OpenAI client's
*async* flavour (AsyncOpenAI under asyncio: the client side may be asyncio, the
gateway is Trio), and curl over TLS negotiating HTTP/2 by ALPN (``--http2``) or
falling back to HTTP/1.1, with the negotiated protocol asserted.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import trustme

from .servers import hypercorn_gateway

pytestmark = pytest.mark.slow

MESSAGES: list[Any] = [{"role": "user", "content": "echo: alpha beta gamma"}]
BODY = json.dumps({"model": "aiserve-mock", "stream": True, "messages": MESSAGES})


@pytest.fixture(scope="module")
def tls_gateway(
    config_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    """The gateway over TLS with a trustme certificate; yields its URL and the CA file."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    d = tmp_path_factory.mktemp("clients-tls")
    certfile, keyfile, cafile = d / "cert.pem", d / "key.pem", d / "ca.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(certfile))
    cert.private_key_pem.write_to_path(str(keyfile))
    ca.cert_pem.write_to_path(str(cafile))
    args = ["--certfile", str(certfile), "--keyfile", str(keyfile)]
    with hypercorn_gateway(config_file, extra_args=args, scheme="https") as (base, _):
        yield base, cafile


def streamed_text(body: str) -> str:
    out = []
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                out.append(choice["delta"].get("content") or "")
    return "".join(out)


# --- the official OpenAI client, async ------------------------------------------


async def _async_openai_calls(base: str) -> tuple[str, str, int, list[str]]:
    async with openai.AsyncOpenAI(
        base_url=base + "/v1", api_key="not-needed-locally", max_retries=0
    ) as client:
        done = await client.chat.completions.create(model="aiserve-mock", messages=MESSAGES)
        stream = await client.chat.completions.create(
            model="aiserve-mock",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, total = [], 0
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            if chunk.usage:
                total = chunk.usage.total_tokens
        models = await client.models.list()
        return done.choices[0].message.content or "", "".join(pieces), total, [m.id for m in models.data]


def test_openai_async_client_streaming_and_not(gateway):
    # A sync test: asyncio.run owns its loop here, apart from any Trio run.
    whole, streamed, total, models = asyncio.run(_async_openai_calls(gateway))
    assert whole == "alpha beta gamma"
    assert streamed == "alpha beta gamma"
    assert total > 3
    assert models == ["aiserve-mock"]


async def _async_openai_error(base: str) -> openai.APIStatusError:
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as client:
        try:
            await client.chat.completions.create(model="no-such-model", messages=MESSAGES)
        except openai.APIStatusError as exc:
            return exc
    raise AssertionError("an unknown model was accepted")


def test_openai_async_client_sees_the_error_envelope(gateway):
    exc = asyncio.run(_async_openai_error(gateway))
    assert exc.status_code in (400, 404)
    assert isinstance(exc.body, dict)
    assert exc.body.get("code") == "model_not_found"


# --- curl over TLS: ALPN picks the protocol ----------------------------------------


def curl_tls(base: str, cafile: Path, *flags: str) -> tuple[str, str]:
    """POST a streamed chat with curl; return (negotiated HTTP version, body)."""
    marker = "\n--http-version:"
    r = subprocess.run(
        [
            "curl", "-sS", "-N", "--cacert", str(cafile), *flags,
            "-H", "content-type: application/json", "-d", BODY,
            "-w", marker + "%{http_version}",
            base + "/v1/chat/completions",
        ],
        capture_output=True, text=True, timeout=30, check=True,
    )
    body, _, version = r.stdout.rpartition(marker)
    return version.strip(), body


def test_curl_http2_over_tls_negotiates_h2_by_alpn(tls_gateway):
    base, cafile = tls_gateway
    version, body = curl_tls(base, cafile, "--http2")
    assert version == "2"
    assert streamed_text(body) == "alpha beta gamma"
    assert body.rstrip().endswith("data: [DONE]")


def test_curl_http11_over_tls_still_works(tls_gateway):
    base, cafile = tls_gateway
    version, body = curl_tls(base, cafile, "--http1.1")
    assert version == "1.1"
    assert streamed_text(body) == "alpha beta gamma"


def test_curl_h2c_prior_knowledge_reports_http2(gateway):
    version, body = curl_tls(gateway, Path("/dev/null"), "--http2-prior-knowledge")
    assert version == "2"
    assert streamed_text(body) == "alpha beta gamma"
