"""aiserve-sim's Bedrock dialect, proven by boto3's ``bedrock-runtime`` client: ``converse``
and ``converse_stream`` (the binary event stream, its CRCs checked by botocore), text,
reasoning, a streamed tool use and its result, the errors."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import botocore.config
import botocore.exceptions
import pytest

from .sim_process import run_sim

pytestmark = pytest.mark.slow

TOOLS: Any = {
    "tools": [
        {
            "toolSpec": {
                "name": "get_weather",
                "description": "The weather in a city",
                "inputSchema": {
                    "json": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}},
                        "required": ["city"],
                    }
                },
            }
        }
    ]
}
HI: Any = [{"role": "user", "content": [{"text": "hello"}]}]
MODEL = "anthropic.claude-sonnet-4-5-v1:0"


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with run_sim() as addr:
        yield addr


@pytest.fixture
def client(sim: str) -> Any:
    return boto3.client(
        "bedrock-runtime",
        region_name="us-east-1",
        endpoint_url=f"http://{sim}",
        aws_access_key_id="AKIDSIMULATED",
        aws_secret_access_key="sim-secret",
        config=botocore.config.Config(retries={"total_max_attempts": 1}),
    )


def fault(client: Any, value: str) -> None:
    def add(request: Any, **_: Any) -> None:
        request.headers["X-Sim-Fault"] = value

    client.meta.events.register("before-sign.bedrock-runtime.*", add)


def test_converse_whole_and_streamed(client: Any) -> None:
    whole = client.converse(modelId=MODEL, messages=HI)
    assert whole["stopReason"] == "end_turn"
    (block,) = whole["output"]["message"]["content"]
    assert block["text"].startswith("the quick")
    assert whole["usage"]["inputTokens"] > 0
    events = list(client.converse_stream(modelId=MODEL, messages=HI)["stream"])
    kinds = [next(iter(e)) for e in events]
    assert kinds[0] == "messageStart"
    assert kinds[-2:] == ["messageStop", "metadata"]
    text = "".join(
        e["contentBlockDelta"]["delta"]["text"] for e in events if "contentBlockDelta" in e
    )
    assert text.startswith("the quick")
    assert events[-1]["metadata"]["usage"]["outputTokens"] == kinds.count("contentBlockDelta")
    capped = client.converse(modelId=MODEL, messages=HI, inferenceConfig={"maxTokens": 2})
    assert capped["stopReason"] == "max_tokens"


def test_reasoning_comes_first(client: Any) -> None:
    fields = {"thinking": {"type": "enabled", "budget_tokens": 1024}}
    stream = client.converse_stream(modelId=MODEL, messages=HI, additionalModelRequestFields=fields)
    deltas = [e["contentBlockDelta"]["delta"] for e in stream["stream"] if "contentBlockDelta" in e]
    assert "reasoningContent" in deltas[0]
    assert "text" in deltas[-1]


def test_a_streamed_tool_use_and_its_result(client: Any) -> None:
    events = list(client.converse_stream(modelId=MODEL, messages=HI, toolConfig=TOOLS)["stream"])
    (start,) = [
        e["contentBlockStart"]["start"]["toolUse"] for e in events if "contentBlockStart" in e
    ]
    assert start["name"] == "get_weather"
    args = "".join(
        e["contentBlockDelta"]["delta"]["toolUse"]["input"]
        for e in events
        if "contentBlockDelta" in e
    )
    assert '"city"' in args
    assert [e["messageStop"]["stopReason"] for e in events if "messageStop" in e] == ["tool_use"]
    messages = [
        *HI,
        {
            "role": "assistant",
            "content": [
                {
                    "toolUse": {
                        "toolUseId": start["toolUseId"],
                        "name": "get_weather",
                        "input": {"city": "Oslo"},
                    }
                }
            ],
        },
        {
            "role": "user",
            "content": [
                {"toolResult": {"toolUseId": start["toolUseId"], "content": [{"text": "sunny"}]}}
            ],
        },
    ]
    answer = client.converse(modelId=MODEL, messages=messages, toolConfig=TOOLS)
    assert answer["output"]["message"]["content"][0]["text"].startswith("The tool returned: sunny")


def test_errors_in_bedrocks_shape(client: Any, sim: str) -> None:
    fault(client, "429")
    with pytest.raises(botocore.exceptions.ClientError) as info:
        client.converse(modelId=MODEL, messages=HI)
    assert info.value.response["Error"]["Code"] == "ThrottlingException"
    unsigned = boto3.client(
        "bedrock-runtime",
        region_name="us-east-1",
        endpoint_url=f"http://{sim}",
        config=botocore.config.Config(signature_version=botocore.UNSIGNED),
    )
    with pytest.raises(botocore.exceptions.ClientError) as denied:
        unsigned.converse(modelId=MODEL, messages=HI)
    assert denied.value.response["Error"]["Code"] == "AccessDeniedException"
