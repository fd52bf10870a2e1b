"""The official ``openai`` and ``anthropic`` SDKs, unchanged but for ``base_url``, through the
gateway's Responses and Messages routes to aiserve-sim, an upstream that speaks only Chat
Completions (real processes: the hypercorn binary and aiserve-sim)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from pydantic import BaseModel

from .conftest import config_text
from .servers import hypercorn_gateway
from .sim_process import run_sim

pytestmark = pytest.mark.slow

PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4"
    "nGNgYGD4DwABBAEAcCBlCwAAAABJRU5ErkJggg=="
)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with run_sim() as sim:
        extra = f"""
[adapters.up]
kind = "openai"
base_url = "http://{sim}/v1"
models = ["sim-model"]

# openai: base_url = GATEWAY/oai/v1; anthropic: base_url = GATEWAY/claude
[[routes]]
path = "/oai/v1/responses"
name = "oai_responses"
kind = "responses"
adapter = "up"

[[routes]]
path = "/claude/v1/messages"
name = "claude_messages"
kind = "messages"
adapter = "up"
"""
        cfg: Path = tmp_path_factory.mktemp("conf") / "gateway.toml"
        cfg.write_text(config_text() + extra)
        with hypercorn_gateway(cfg) as (base, _):
            yield base


@pytest.fixture
def oai(gateway: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(api_key="unused", base_url=f"{gateway}/oai/v1", max_retries=0) as sdk:
        yield sdk


@pytest.fixture
def claude(gateway: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(api_key="unused", base_url=f"{gateway}/claude", max_retries=0) as sdk:
        yield sdk


WEATHER: Any = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}


class Forecast(BaseModel):
    city: str
    days: int


# --- openai: client.responses ---------------------------------------------------


def test_responses_text(oai: openai.OpenAI) -> None:
    r = oai.responses.create(model="sim-model", input="Say something", instructions="Be brief.")
    assert r.status == "completed"
    assert r.output[0].type == "message"
    assert r.output_text.startswith("the quick brown fox")
    assert r.instructions == "Be brief."
    assert r.usage is not None
    assert r.usage.input_tokens > 0
    assert r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_responses_stream_sends_the_typed_events_in_order(oai: openai.OpenAI) -> None:
    events = list(oai.responses.create(model="sim-model", input="Say something", stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    head = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    tail = [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert types == head + ["response.output_text.delta"] * len(deltas) + tail
    done = events[-1]
    assert done.type == "response.completed"
    assert done.response.output_text == "".join(d.delta for d in deltas)
    assert done.response.usage is not None
    assert done.response.usage.output_tokens > 0


def test_responses_stream_helper_accumulates_the_same_response(oai: openai.OpenAI) -> None:
    with oai.responses.stream(model="sim-model", input="Say something") as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_text == text
    assert final.status == "completed"


def test_responses_function_call_round_trip(oai: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    history: Any = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = oai.responses.create(model="sim-model", input=history, tools=tools)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1
    assert calls[0].name == "get_weather"
    assert "city" in json.loads(calls[0].arguments)
    history += first.output
    history.append(
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temp": -3}'}
    )
    second = oai.responses.create(model="sim-model", input=history, tools=tools)
    assert second.output_text.startswith('The tool returned: {"temp": -3}')


def test_responses_streamed_function_call(oai: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    with oai.responses.stream(model="sim-model", input="weather?", tools=tools) as stream:
        args = "".join(
            e.delta for e in stream if e.type == "response.function_call_arguments.delta"
        )
        final = stream.get_final_response()
    call = final.output[-1]
    assert call.type == "function_call"
    assert call.arguments == args
    assert "city" in json.loads(args)


def test_responses_json_schema_output(oai: openai.OpenAI) -> None:
    r = oai.responses.parse(model="sim-model", input="forecast for Oslo", text_format=Forecast)
    assert isinstance(r.output_parsed, Forecast)
    assert r.output_parsed.days >= 1


def test_responses_reasoning_and_an_image(oai: openai.OpenAI) -> None:
    content: Any = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "What is in this picture?"},
                {"type": "input_image", "image_url": f"data:image/png;base64,{PNG}"},
            ],
        }
    ]
    r = oai.responses.create(model="sim-model", reasoning={"effort": "low"}, input=content)
    reasoning = r.output[0]
    assert reasoning.type == "reasoning"
    assert reasoning.content
    assert reasoning.content[0].text
    assert r.output_text.startswith("I see 1 image.")
    assert r.usage is not None
    assert r.usage.output_tokens_details.reasoning_tokens > 0


def test_responses_previous_response_id_continues_a_function_call(oai: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    first = oai.responses.create(model="sim-model", input="Weather in Oslo?", tools=tools)
    call = first.output[-1]
    assert call.type == "function_call"
    # Only the tool's output is sent: the question and the call come from the stored response.
    second = oai.responses.create(
        model="sim-model",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=tools,
    )
    assert second.previous_response_id == first.id
    assert second.output_text.startswith("The tool returned: sunny")
    assert second.usage is not None
    assert first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens  # the stored turns went up too
    with pytest.raises(openai.NotFoundError) as err:
        oai.responses.create(model="sim-model", previous_response_id="resp_unknown", input="hi")
    assert err.value.body is not None
    assert err.value.body["code"] == "previous_response_not_found"  # type: ignore[index]


def test_responses_refuses_a_field_it_cannot_carry(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model="sim-model", input="hi", extra_body={"conversation": "c1"})
    assert err.value.body is not None
    assert err.value.body["param"] == "conversation"  # type: ignore[index]


# --- anthropic: client.messages ---------------------------------------------------------


# aiserve-sim writes free text until `max_tokens`; asked to pick one of the labels a
# system message lists, it answers with the label and stops.
LABELS = "Answer with one of the labels.\nLabels: yes, no"


def test_messages_text(claude: anthropic.Anthropic) -> None:
    m = claude.messages.create(
        model="sim-model",
        max_tokens=256,
        system=LABELS,
        messages=[{"role": "user", "content": "yes please"}],
    )
    assert m.stop_reason == "end_turn"
    assert m.content[0].type == "text"
    assert m.content[0].text == "yes"
    assert m.usage.input_tokens > 0
    assert m.usage.output_tokens > 0


def test_messages_max_tokens_is_the_stop_reason(claude: anthropic.Anthropic) -> None:
    m = claude.messages.create(
        model="sim-model", max_tokens=7, messages=[{"role": "user", "content": "Say something"}]
    )
    assert m.stop_reason == "max_tokens"
    assert m.usage.output_tokens == 7
    assert m.content[0].type == "text"
    assert m.content[0].text.startswith("the quick brown fox")


def test_messages_stream(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(
        model="sim-model",
        max_tokens=256,
        system=[{"type": "text", "text": LABELS}],
        messages=[{"role": "user", "content": "no thanks"}],
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn"
    assert final.content[0].type == "text"
    assert final.content[0].text == text == "no"
    assert final.usage.output_tokens > 0
    assert final.usage.input_tokens > 0


def test_messages_raw_stream_events_in_order(claude: anthropic.Anthropic) -> None:
    events = list(
        claude.messages.create(
            model="sim-model",
            max_tokens=12,
            stream=True,
            messages=[{"role": "user", "content": "Say something"}],
        )
    )
    types = [e.type for e in events]
    n = types.count("content_block_delta")
    assert n > 1
    assert types == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * n,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    delta = events[-2]
    assert delta.type == "message_delta"
    assert delta.delta.stop_reason == "max_tokens"
    assert delta.usage.output_tokens == 12


def test_messages_tool_use_round_trip(claude: anthropic.Anthropic) -> None:
    tools: Any = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}]
    history: Any = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = claude.messages.create(model="sim-model", max_tokens=256, messages=history, tools=tools)
    assert first.stop_reason == "tool_use"
    use = first.content[-1]
    assert use.type == "tool_use"
    assert use.name == "get_weather"
    assert "city" in use.input
    history += [
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "-3 C, snow"}],
        },
    ]
    second = claude.messages.create(
        model="sim-model", max_tokens=256, messages=history, tools=tools
    )
    assert second.content[0].type == "text"
    assert second.content[0].text.startswith("The tool returned: -3 C, snow")


def test_messages_streamed_tool_use_with_thinking(claude: anthropic.Anthropic) -> None:
    tools: Any = [{"name": "get_weather", "input_schema": WEATHER}]
    with claude.messages.stream(
        model="sim-model",
        max_tokens=1024,
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
        tools=tools,
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    thinking, use = final.content
    assert thinking.type == "thinking"
    assert thinking.thinking
    assert use.type == "tool_use"
    assert "city" in use.input


def test_messages_image_block(claude: anthropic.Anthropic) -> None:
    m = claude.messages.create(
        model="sim-model",
        max_tokens=256,
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": PNG},
                    },
                    {"type": "text", "text": "What is in this picture?"},
                ],
            }
        ],
    )
    assert m.content[0].type == "text"
    assert m.content[0].text.startswith("I see 1 image.")


def test_messages_without_max_tokens_is_anthropics_400(gateway: str) -> None:
    r = httpx.post(
        f"{gateway}/claude/v1/messages",
        json={"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-api-key": "k", "anthropic-version": "2023-06-01"},
    )
    assert r.status_code == 400
    assert r.json() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "`max_tokens`: field required [missing_required_parameter]",
        },
    }
