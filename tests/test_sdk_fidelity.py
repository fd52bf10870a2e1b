"""The official ``openai`` SDK, unchanged, through the gateway to aiserve-sim (real processes):
function calling, structured output, reasoning, image parts and embeddings."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from aiserve_trio.util.vectors import vector

from .stack import stack as stack

pytestmark = pytest.mark.slow


class Forecast(BaseModel):
    city: str
    days: int
    unit: str


@pytest.fixture
def client(stack: tuple[str, str]) -> Iterator[openai.OpenAI]:
    base, _ = stack
    # Only base_url changes: the SDK posts to {base_url}/chat/completions and /embeddings.
    with openai.OpenAI(api_key="unused-locally", base_url=f"{base}/sdk/v1", max_retries=0) as sdk:
        # Closed at the end: an SDK client collected with a pooled connection open
        # warns (ResourceWarning), and the suite turns warnings into errors.
        yield sdk


TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def test_a_function_calling_round_trip(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "What is the weather in Oslo?"}]
    stream = client.chat.completions.create(
        model="sim-model", messages=messages, tools=TOOLS, stream=True
    )
    call_id, name, args, finish = "", "", "", None
    for chunk in stream:
        choice = chunk.choices[0] if chunk.choices else None
        if choice is None:
            continue
        for call in choice.delta.tool_calls or []:
            call_id = call.id or call_id
            if call.function is not None:
                name += call.function.name or ""
                args += call.function.arguments or ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert name == "get_weather"
    assert "city" in json.loads(args)
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": '{"temp": -3, "sky": "snow"}'},
    ]
    final = client.chat.completions.create(model="sim-model", messages=messages, tools=TOOLS)
    answer = final.choices[0].message
    assert final.choices[0].finish_reason == "stop"
    assert answer.tool_calls is None
    assert answer.content is not None
    assert '"temp": -3' in answer.content  # the sim quotes the tool result it got


def test_structured_output_parses_into_the_pydantic_model(client: openai.OpenAI) -> None:
    r = client.beta.chat.completions.parse(
        model="sim-model",
        messages=[{"role": "user", "content": "forecast for Oslo"}],
        response_format=Forecast,
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Forecast)
    assert parsed.days >= 1


def test_a_reasoning_stream(client: openai.OpenAI) -> None:
    reasoning, content = "", ""
    first_content_at = first_reasoning_at = -1
    stream = client.chat.completions.create(
        model="sim-model",
        messages=[{"role": "user", "content": "think about it"}],
        reasoning_effort="high",
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = None
    for i, chunk in enumerate(stream):
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        if extra.get("reasoning_content"):
            reasoning += extra["reasoning_content"]
            first_reasoning_at = first_reasoning_at if first_reasoning_at >= 0 else i
        if delta.content:
            content += delta.content
            first_content_at = first_content_at if first_content_at >= 0 else i
    assert reasoning
    assert content
    assert first_reasoning_at < first_content_at
    assert usage is not None
    assert usage.completion_tokens_details is not None
    assert (usage.completion_tokens_details.reasoning_tokens or 0) > 0


def test_an_image_part_arrives(client: openai.OpenAI) -> None:
    png = (
        "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4"
        "nGNgYGD4DwABBAEAcCBlCwAAAABJRU5ErkJggg=="
    )
    r = client.chat.completions.create(
        model="sim-model",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": png}},
                ],
            }
        ],
    )
    assert (r.choices[0].message.content or "").startswith("I see 1 image.")


def test_embeddings(client: openai.OpenAI) -> None:
    r = client.embeddings.create(model="sim-model", input=["alpha", "beta"], dimensions=6)
    assert [d.index for d in r.data] == [0, 1]
    assert r.data[0].embedding == pytest.approx(vector("alpha", 6), abs=1e-6)
    assert r.usage.prompt_tokens > 0
