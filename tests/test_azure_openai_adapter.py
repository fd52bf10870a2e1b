"""The ``azure_openai`` adapter's pure parts: the deployment path and auth, Azure's
stream quirks (a first chunk without choices, filter results), a reply the filter stops
before any of it went out, and the error statuses at the boundary."""

from __future__ import annotations

import json
from typing import Any

import pytest

from aiserve_trio.adapters.azure_openai import AzureOpenAIAdapter, FilteredStreamDecoder
from aiserve_trio.adapters.base import InferenceRequest
from aiserve_trio.config import AzureOpenAIAdapterConfig, ConfigError, parse_config
from aiserve_trio.core.errors import BadRequest, UpstreamStatusError
from aiserve_trio.core.messages import Message

SAFE = {"hate": {"filtered": False, "severity": "safe"}}


def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
    return b"data: " + json.dumps({"choices": choices, **extra}).encode() + b"\n\n"


def adapter(**kw: Any) -> AzureOpenAIAdapter:
    cfg = AzureOpenAIAdapterConfig(base_url="http://azure", models={"gpt-4o": "prod dep"}, **kw)
    return AzureOpenAIAdapter("azure", cfg)


def test_the_deployment_path_and_the_body() -> None:
    a = adapter(api_version="2025-01-01-preview")
    req = InferenceRequest(
        request_id="r", model="gpt-4o", messages=[Message(role="user", content="hi")], deadline=1.0
    )
    path, _, body = a.exchange(req, a.upstream_model("gpt-4o"))
    assert path == "/openai/deployments/prod%20dep/chat/completions?api-version=2025-01-01-preview"
    sent = json.loads(body)
    assert sent["messages"] == [{"role": "user", "content": "hi"}]
    assert sent["stream"] is True
    assert a.upstream_model("other") == "other"


def test_the_key_or_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZ_KEY", "k1")
    monkeypatch.setenv("AZ_TOKEN", "t1")
    assert (b"api-key", b"k1") in adapter(api_key_env="AZ_KEY").auth_headers()
    assert (b"authorization", b"Bearer t1") in adapter(token_env="AZ_TOKEN").auth_headers()
    with pytest.raises(ConfigError, match="AZ_MISSING"):
        adapter(api_key_env="AZ_MISSING").auth_headers()


def test_both_auths_or_no_endpoint_are_refused_at_load() -> None:
    base = '[auth]\nenabled = false\n[[routes]]\npath = "/v1/c"\nadapter = "az"\n[adapters.az]\nkind = "azure_openai"\nmodels = ["m"]\n'
    with pytest.raises(ConfigError, match=r"adapters\.az\.token_env"):
        parse_config(base + 'base_url = "http://x"\napi_key_env = "A"\ntoken_env = "B"\n')
    with pytest.raises(ConfigError, match=r"adapters\.az\.base_url"):
        parse_config(base)


def test_azures_stream_decodes_as_openais() -> None:
    d = FilteredStreamDecoder("azure")
    first = chunk([], prompt_filter_results=[{"prompt_index": 0, "content_filter_results": SAFE}])
    text = chunk([{"index": 0, "delta": {"content": "Hi"}, "content_filter_results": SAFE}])
    end = chunk([{"index": 0, "delta": {}, "finish_reason": "stop", "content_filter_results": {}}])
    usage = chunk([], usage={"prompt_tokens": 3, "completion_tokens": 1})
    deltas = d.feed(first + text) + d.feed(end + usage + b"data: [DONE]\n\n")
    assert "".join(x.text for x in deltas) == "Hi"
    final = d.end()
    assert final.finish_reason == "stop"
    assert final.usage is not None
    assert final.usage.prompt_tokens == 3


def test_a_reply_filtered_before_anything_went_out_is_the_clients_400() -> None:
    d = FilteredStreamDecoder("azure")
    stop = chunk([{"index": 0, "delta": {}, "finish_reason": "content_filter"}])
    assert d.feed(stop + b"data: [DONE]\n\n") == []
    with pytest.raises(BadRequest) as info:
        d.end()
    assert info.value.code == "content_filter"
    # Stopped midway: the client has part of it; the finish reason says why it ended.
    d = FilteredStreamDecoder("azure")
    d.feed(chunk([{"index": 0, "delta": {"content": "Hi"}}]) + stop + b"data: [DONE]\n\n")
    assert d.end().finish_reason == "content_filter"


@pytest.mark.parametrize(
    ("status", "error", "expected", "code"),
    [
        (
            400,
            {"code": "content_filter", "status": 400, "message": "filtered", "innererror": {}},
            BadRequest,
            "content_filter",
        ),
        (
            400,
            {"code": "context_length_exceeded", "message": "too long"},
            BadRequest,
            "context_length_exceeded",
        ),
        (
            429,
            {"code": "429", "message": "Rate limit"},
            UpstreamStatusError,
            "upstream_status_error",
        ),
        (
            404,
            {"code": "DeploymentNotFound", "message": "no such deployment"},
            UpstreamStatusError,
            "upstream_status_error",
        ),
    ],
)
def test_error_statuses_at_the_boundary(
    status: int, error: dict[str, Any], expected: type, code: str
) -> None:
    err = adapter().status_error(status, json.dumps({"error": error}).encode(), None)
    assert type(err) is expected
    assert err.code == code
    assert error["message"] in err.message
