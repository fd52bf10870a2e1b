"""One ``/v1/chat/completions`` serving a model on each native provider plus the mock, the
model picking the adapter: the unchanged openai SDK through the gateway (real hypercorn,
``configs/examples/providers.toml`` as shipped but for the sim's port) to aiserve-sim
speaking each provider's own API -- and each upstream request in its provider's native
format. Then retries and group fallbacks on a provider's 429 / 529 before the first token."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest

from aiserve_trio.config import parse_config
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client
from .servers import ROOT, hypercorn_gateway
from .sim_gateway import running, sim_reset, sim_stats
from .sim_process import run_sim
from .test_sdk_fidelity import TOOLS

pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "configs" / "examples" / "providers.toml"
ENV = {
    "ANTHROPIC_API_KEY": "sim-anthropic-key",
    "AZURE_OPENAI_API_KEY": "sim-azure-key",
    "GEMINI_API_KEY": "sim-gemini-key",
    "AWS_ACCESS_KEY_ID": "AKIDSIMULATED",
    "AWS_SECRET_ACCESS_KEY": "sim-secret",
    "AWS_EC2_METADATA_DISABLED": "true",
}
#: Model -> (the sim's path for it, the auth header and value the provider wants).
NATIVE: dict[str, tuple[str, str, str | None]] = {
    "claude-sonnet-4-5": ("/v1/messages", "x-api-key", "sim-anthropic-key"),
    "gpt-4o": (
        "/openai/deployments/prod-gpt4o-deployment/chat/completions?api-version=2024-10-21",
        "api-key",
        "sim-azure-key",
    ),
    "gemini-2.5-flash": (
        "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse",
        "x-goog-api-key",
        "sim-gemini-key",
    ),
    "nova-pro": ("/model/amazon.nova-pro-v1:0/converse-stream", "x-amz-date", None),
}


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with run_sim() as addr:
        yield addr


@pytest.fixture(scope="module")
def gateway(sim: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    text = EXAMPLE.read_text().replace("127.0.0.1:8100", sim)
    path: Path = tmp_path_factory.mktemp("providers") / "providers.toml"
    path.write_text(text)
    with hypercorn_gateway(path, env=ENV) as (base, _):
        yield base


@pytest.fixture
def sdk(gateway: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(api_key="unused", base_url=f"{gateway}/v1", max_retries=0) as client:
        yield client


#: Model -> what its upstream body must be for the system prompt and "hello".
NATIVE_BODY: dict[str, Any] = {
    "claude-sonnet-4-5": lambda b: (
        b["system"] == "Be brief."
        and b["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    ),
    "gpt-4o": lambda b: (
        b["messages"]
        == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    ),
    "gemini-2.5-flash": lambda b: (
        b["systemInstruction"] == {"parts": [{"text": "Be brief."}]}
        and b["contents"] == [{"role": "user", "parts": [{"text": "hello"}]}]
    ),
    "nova-pro": lambda b: (
        b["system"] == [{"text": "Be brief."}]
        and b["messages"] == [{"role": "user", "content": [{"text": "hello"}]}]
    ),
}


def last_upstream(sim: str) -> dict[str, Any]:
    requests = httpx2.get(f"http://{sim}/sim/requests").json()["requests"]
    return dict(requests[-1])


@pytest.mark.parametrize("model", [*NATIVE, "aiserve-mock"])
def test_text_whole_and_streamed_through_the_openai_sdk(
    sdk: openai.OpenAI, sim: str, model: str
) -> None:
    hi: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    whole = sdk.chat.completions.create(model=model, messages=hi)
    assert whole.model == model
    text = whole.choices[0].message.content
    assert text
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage is not None
    assert whole.usage.prompt_tokens > 0
    pieces = []
    for chunk in sdk.chat.completions.create(model=model, messages=hi, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert "".join(pieces)
    if model in NATIVE:
        path, header, value = NATIVE[model]
        up = last_upstream(sim)
        assert up["path"] == path
        assert up["headers"][header] == value or value is None
        assert "".join(pieces).startswith("the quick brown")
        assert NATIVE_BODY[model](json.loads(up["body"])), up["body"]


def test_anthropics_native_request(sdk: openai.OpenAI, sim: str) -> None:
    messages: Any = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the weather in Oslo?"},
    ]
    sdk.chat.completions.create(
        model="claude-sonnet-4-5", messages=messages, tools=TOOLS, stop=["END"], temperature=0.5
    )
    up = last_upstream(sim)
    assert up["headers"]["anthropic-version"] == "2023-06-01"
    body = json.loads(up["body"])
    assert body["model"] == "claude-sonnet-4-5"
    assert body["system"] == "Be brief."
    assert body["max_tokens"] == 4096  # the adapter's default: the client sent none
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "What is the weather in Oslo?"}]}
    ]
    assert body["tools"][0]["input_schema"]["required"] == ["city"]
    assert (body["stop_sequences"], body["temperature"], body["stream"]) == (["END"], 0.5, True)


@pytest.mark.parametrize("model", list(NATIVE))
def test_a_streamed_tool_call_and_its_round_trip(sdk: openai.OpenAI, model: str) -> None:
    messages: Any = [{"role": "user", "content": "What is the weather in Oslo?"}]
    call_id, name, args, finish = "", "", "", None
    for chunk in sdk.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, stream=True
    ):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        for call in choice.delta.tool_calls or []:
            assert call.index == 0
            call_id = call_id or (call.id or "")
            if call.function is not None:
                name = name or (call.function.name or "")
                args += call.function.arguments or ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert name == "get_weather"
    assert call_id
    assert set(json.loads(args)) == {"city"}
    messages += [
        {
            "role": "assistant",
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
    ]
    answer = sdk.chat.completions.create(model=model, messages=messages, tools=TOOLS)
    assert answer.choices[0].message.content is not None
    assert answer.choices[0].message.content.startswith("The tool returned: sunny")


def test_azures_content_filter_is_the_clients_400(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "sim-content-filter"}]
        )
    assert info.value.code == "content_filter"
    assert "content management policy" in info.value.message


def test_what_a_provider_cannot_carry_is_refused_naming_the_field(sdk: openai.OpenAI) -> None:
    # The capabilities are the chosen adapter's: Azure relays response_format, Anthropic
    # cannot carry it, and says so before any call.
    hi: Any = [{"role": "user", "content": "hi"}]
    fmt: Any = {"type": "json_object"}
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="claude-sonnet-4-5", messages=hi, response_format=fmt)
    assert (info.value.code, info.value.param) == ("unsupported_field", "response_format")
    answer = sdk.chat.completions.create(model="gpt-4o", messages=hi, response_format=fmt)
    assert answer.choices[0].message.content == '{"answer":"sim","ok":true}'
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="nova-pro", messages=hi, n=2)
    assert info.value.param == "n"


def test_an_unserved_model_is_404_naming_what_the_path_serves(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        sdk.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    body: Any = info.value.body
    assert body["code"] == "model_not_found"
    for model in [*NATIVE, "aiserve-mock"]:
        assert model in body["message"]
    listed = {m.id: m.owned_by for m in sdk.models.list()}
    assert listed["claude-sonnet-4-5"] == "claude"
    assert listed["aiserve-mock"] == "mock"
    assert listed["gpt-4o"] == "azure"
    assert listed["gemini-2.5-flash"] == "gemini"
    assert listed["nova-pro"] == "bedrock"
    assert listed["claude-sonnet-4-5"] == "claude"  # the group


def test_bedrock_requests_carry_a_valid_sigv4_signature(sdk: openai.OpenAI, sim: str) -> None:
    sdk.chat.completions.create(model="nova-pro", messages=[{"role": "user", "content": "hi"}])
    up = last_upstream(sim)
    headers = up["headers"]
    auth = headers["authorization"]
    assert auth.startswith("AWS4-HMAC-SHA256 Credential=AKIDSIMULATED/")
    assert "/us-east-1/bedrock/aws4_request" in auth
    signed = auth.split("SignedHeaders=")[1].split(",")[0].split(";")
    assert {"host", "x-amz-date"} <= set(signed)
    # Signed again here with the same secret: the gateway's signature is the real thing.
    from urllib.parse import quote

    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    url = f"http://{sim}/model/{quote('amazon.nova-pro-v1:0', safe='')}/converse-stream"
    req = AWSRequest(
        method="POST",
        url=url,
        data=up["body"].encode(),
        headers={k: headers[k] for k in signed if k != "host"},
    )
    req.context["timestamp"] = headers["x-amz-date"]
    signer = SigV4Auth(Credentials("AKIDSIMULATED", "sim-secret"), "bedrock", "us-east-1")
    expected = signer.signature(signer.string_to_sign(req, signer.canonical_request(req)), req)
    assert auth.endswith(f"Signature={expected}")
    body = json.loads(up["body"])
    assert body["messages"] == [{"role": "user", "content": [{"text": "hi"}]}]


def test_the_claude_group_is_served_by_anthropic_directly_when_it_answers(gateway: str) -> None:
    r = httpx2.post(
        f"{gateway}/v1/chat/completions",
        json={"model": "claude-sonnet-4-5", "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )
    assert r.status_code == 200
    assert r.headers["x-aiserve-deployment"] == "anthropic"


# --- retries and fallbacks, in process against the same sim --------------------------


def providers_app(sim: str, faulty: dict[str, str], extra: str = "", route: str = "") -> App:
    faults = "{ " + ", ".join(f'"{k}" = "{v}"' for k, v in faulty.items()) + " }"
    text = f"""
[auth]
enabled = false

[adapters.direct]
kind = "anthropic"
base_url = "http://{sim}"
models = ["claude-sonnet-4-5"]
api_key_env = "ANTHROPIC_API_KEY"
backoff_base_ms = 5
backoff_max_ms = 10
headers = {faults}
{extra}
[[routes]]
path = "/v1/chat/completions"
name = "chat"
{route or 'adapters = ["direct"]'}
"""
    return App(parse_config(text))


def ask(text: str = "hi") -> dict[str, Any]:
    return {
        "model": "claude-sonnet-4-5",
        "stream": True,
        "messages": [{"role": "user", "content": text}],
    }


@pytest.mark.parametrize("status", ["529", "429:0"])
async def test_a_retryable_status_before_the_first_token_is_retried(
    sim: str, status: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "k")
    await sim_reset(sim)
    app = providers_app(sim, {"X-Sim-Fault": status, "X-Sim-Fault-Times": "1"})
    async with running(app) as client:
        r = await client.request("POST", "/v1/chat/completions", json_body=ask())
    assert r.status == 200, r.body
    assert r.events()[-1] == "[DONE]"
    stats = await sim_stats(sim)
    assert sorted(stats["attempts"].values()) == [2]  # one request id, tried twice
    retried = app.metrics.registry.get_sample_value(
        "aiserve_upstream_retries_total", {"adapter": "direct"}
    )
    assert retried == 1


async def test_anthropic_overloaded_on_every_try_falls_back_to_bedrock_within_the_group(
    sim: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "k")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDSIMULATED")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "sim-secret")
    extra = f"""
[adapters.second]
kind = "bedrock"
region = "eu-central-1"
base_url = "http://{sim}"
models = {{ "claude-sonnet-4-5" = "anthropic.claude-sonnet-4-5-20250929-v1:0" }}

[adapters.claude]
kind = "group"
models = ["claude-sonnet-4-5"]
deployments = [{{ adapter = "direct" }}]
fallbacks = ["second"]
ttft_prior_ms = 50
"""
    app = providers_app(sim, {"X-Sim-Fault": "529"}, extra, 'adapters = ["claude"]')
    async with running(app) as client:
        r = await client.request("POST", "/v1/chat/completions", json_body=ask())
    assert r.status == 200, r.body
    assert r.headers["x-aiserve-deployment"] == "second"
    assert r.headers["x-aiserve-fallback"] == "1"
    text = "".join(
        c["delta"].get("content") or "" for e in r.events()[:-1] for c in json.loads(e)["choices"]
    )
    assert text.startswith("the quick brown")


async def test_a_persistent_overload_reaches_the_client_as_an_envelope(
    sim: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "k")
    app = providers_app(sim, {"X-Sim-Fault": "529"})
    async with running(app) as client:
        r = await Client(app).request(
            "POST", "/v1/chat/completions", json_body={**ask(), "stream": False}
        )
        assert client is not None
    assert r.status == 502
    err = r.json()["error"]
    assert err["code"] == "upstream_status_error"
    assert "overloaded_error" in err["message"]
