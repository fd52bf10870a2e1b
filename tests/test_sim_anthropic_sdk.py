"""aiserve-sim's Anthropic dialect, proven by Anthropic's own SDK (``anthropic``): every
stream and body the sim produces -- text, thinking, a streamed tool call, the errors --
is accepted and read as Anthropic's API would be. The gateway's adapter tests run
against this sim only because of these."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from .sim_process import run_sim

pytestmark = pytest.mark.slow

TOOLS: Any = [
    {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    }
]
HI: Any = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with run_sim() as addr:
        yield addr


@pytest.fixture
def client(sim: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(api_key="sk-sim", base_url=f"http://{sim}", max_retries=0) as c:
        yield c


def test_a_text_message_whole_and_streamed(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model="claude-sim", max_tokens=64, messages=HI)
    assert whole.role == "assistant"
    assert whole.stop_reason == "end_turn"
    (block,) = whole.content
    assert block.type == "text"
    assert block.text.split()[:2] == ["the", "quick"]
    assert whole.usage.input_tokens > 0
    assert whole.usage.output_tokens > 0
    with client.messages.stream(model="claude-sim", max_tokens=64, messages=HI) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(texts) == final.usage.output_tokens
    assert final.content[0].type == "text"
    assert "".join(texts) == final.content[0].text
    assert final.stop_reason == "end_turn"


def test_max_tokens_ends_the_reply_with_max_tokens(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model="claude-sim", max_tokens=2, messages=HI) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 2


def test_a_streamed_tool_call_and_the_round_trip(client: anthropic.Anthropic) -> None:
    messages: Any = [{"role": "user", "content": "weather in Oslo?"}]
    with client.messages.stream(
        model="claude-sim", max_tokens=256, messages=messages, tools=TOOLS
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds
    assert final.stop_reason == "tool_use"
    (call,) = [b for b in final.content if b.type == "tool_use"]
    assert call.name == "get_weather"
    assert call.id.startswith("toolu_")
    assert isinstance(call.input, dict)
    assert set(call.input) == {"city", "days"}
    # The result goes back as a tool_result block: the sim quotes it.
    messages += [
        {"role": "assistant", "content": final.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}],
        },
    ]
    answer = client.messages.create(
        model="claude-sim", max_tokens=256, messages=messages, tools=TOOLS
    )
    assert answer.content[0].type == "text"
    assert answer.content[0].text.startswith("The tool returned: sunny, 21 C")
    whole = client.messages.create(
        model="claude-sim",
        max_tokens=256,
        messages=[{"role": "user", "content": "again"}],
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert [b.type for b in whole.content] == ["tool_use"]
    assert whole.stop_reason == "tool_use"


def test_thinking_comes_first(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model="claude-sim",
        max_tokens=2048,
        messages=HI,
        thinking={"type": "enabled", "budget_tokens": 1024},
    ) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].type == "thinking"
    assert final.content[0].thinking.startswith("Let me think")


def test_errors_in_anthropics_shape(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.APIStatusError) as info:
        client.messages.create(
            model="claude-sim", max_tokens=8, messages=HI, extra_headers={"X-Sim-Fault": "529"}
        )
    assert info.value.status_code == 529
    assert info.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    with pytest.raises(anthropic.RateLimitError) as limited:
        client.messages.create(
            model="claude-sim", max_tokens=8, messages=HI, extra_headers={"X-Sim-Fault": "429"}
        )
    assert limited.value.response.headers["retry-after"] == "1"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="claude-sim", max_tokens=0, messages=HI)
    with pytest.raises(anthropic.AuthenticationError):  # no key sent at all
        client.messages.create(
            model="claude-sim",
            max_tokens=8,
            messages=HI,
            extra_headers={"Authorization": anthropic.Omit()},
        )


PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4"
    "nGNgYGD4DwABBAEAcCBlCwAAAABJRU5ErkJggg=="
)


def test_count_tokens_counts_what_the_message_is_charged(client: anthropic.Anthropic) -> None:
    system: Any = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    counted = client.messages.count_tokens(
        model="claude-sim", system=system, messages=HI, tools=TOOLS
    )
    sent = client.messages.create(
        model="claude-sim",
        max_tokens=16,
        system=system,
        messages=HI,
        tools=TOOLS,
        tool_choice={"type": "none"},
    )
    assert counted.input_tokens == sent.usage.input_tokens > 0
    bare = client.messages.count_tokens(model="claude-sim", messages=HI)
    assert bare.input_tokens < counted.input_tokens  # the system prompt counts


def test_cache_control_on_system_and_message_blocks_is_taken(
    client: anthropic.Anthropic,
) -> None:
    ephemeral: Any = {"type": "ephemeral"}
    reply = client.messages.create(
        model="claude-sim",
        max_tokens=16,
        system=[{"type": "text", "text": "You are terse.", "cache_control": ephemeral}],
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "hello there", "cache_control": ephemeral}],
            }
        ],
        extra_headers={"anthropic-beta": "prompt-caching-2024-07-31"},
    )
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert reply.content[0].type == "text"


def test_a_stop_sequence_ends_the_text_before_it(client: anthropic.Anthropic) -> None:
    # The sim's words: "the quick brown fox jumps over ...".
    stops = ["jumps", "k br"]
    whole = client.messages.create(
        model="claude-sim", max_tokens=64, messages=HI, stop_sequences=stops
    )
    assert whole.content[0].type == "text"
    assert whole.content[0].text == "the quic"  # the first to occur, cut inside a word
    assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", "k br")
    assert whole.usage.output_tokens == 2  # "the", " quick" (in part)
    with client.messages.stream(
        model="claude-sim", max_tokens=64, messages=HI, stop_sequences=stops
    ) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == "the quic"
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "k br")
    assert final.content[0].type == "text"
    assert final.content[0].text == "the quic"
    # A sequence the reply never reaches changes nothing.
    far = client.messages.create(
        model="claude-sim", max_tokens=64, messages=HI, stop_sequences=["zebra"]
    )
    assert far.stop_sequence is None
    assert far.stop_reason == "end_turn"


def test_streamed_thinking_is_accumulated_with_its_signature(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model="claude-sim",
        max_tokens=2048,
        messages=HI,
        thinking={"type": "enabled", "budget_tokens": 1024},
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "signature" in kinds  # the SDK's event for a signature_delta
    thought = final.content[0]
    assert thought.type == "thinking"
    assert thought.signature == "sim-signature"
    # Sent back with the next turn, as a client keeps its thinking: taken.
    again = client.messages.create(
        model="claude-sim",
        max_tokens=16,
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=[
            *HI,
            {"role": "assistant", "content": final.content},
            {"role": "user", "content": "and?"},
        ],
    )
    assert [b.type for b in again.content] == ["thinking", "text"]


def test_base64_images_are_seen(client: anthropic.Anthropic) -> None:
    image: Any = {"type": "base64", "media_type": "image/png", "data": PNG}
    reply = client.messages.create(
        model="claude-sim",
        max_tokens=32,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": image},
                    {"type": "image", "source": image},
                    {"type": "text", "text": "what are these?"},
                ],
            }
        ],
    )
    assert reply.content[0].type == "text"
    assert reply.content[0].text.startswith("I see 2 images.")


def test_structured_outputs_parse_into_the_model(client: anthropic.Anthropic) -> None:
    # messages.parse sends output_config.format with the model's JSON schema; the reply's
    # text is an instance of it, whole and streamed.
    from pydantic import BaseModel

    class Forecast(BaseModel):
        city: str
        days: int

    parsed = client.messages.parse(
        model="claude-sim", max_tokens=256, messages=HI, output_format=Forecast
    )
    assert isinstance(parsed.parsed_output, Forecast)
    schema: Any = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    with client.messages.stream(
        model="claude-sim",
        max_tokens=256,
        messages=HI,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    ) as stream:
        text = "".join(stream.text_stream)
    assert isinstance(json.loads(text)["n"], int)
