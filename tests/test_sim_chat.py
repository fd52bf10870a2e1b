"""aiserve-sim's Chat Completions features over HTTP, in-process on the virtual clock:
request shapes, tools, structured output, reasoning, logprobs, images, usage details."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest
import trio
import trio.testing
from pydantic import BaseModel, Field

from aiserve_trio.sim import SimApp, SimSettings, Timing, plan_reply
from aiserve_trio.sim.model import token_text
from aiserve_trio.sim.reply import split_text

from .asgi_client import Client, Response
from .test_sim_schema import WEATHER, schema_errors

ITL = 0.010
TTFT = 0.100


def sim() -> SimApp:
    t = Timing(prefill_overhead_ms=TTFT * 1000, prefill_per_token_ms=0, itl_ms=ITL * 1000)
    return SimApp(SimSettings(timing=t, seed=1))


def body(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    msgs = list(messages) or [{"role": "user", "content": "hi"}]
    return {"model": "sim-model", "messages": msgs, **extra}


def chunks(r: Response) -> list[dict[str, Any]]:
    events = r.events()
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def deltas(r: Response) -> list[dict[str, Any]]:
    """The deltas before the finish chunk."""
    return [
        c["choices"][0]["delta"]
        for c in chunks(r)
        if c["choices"] and c["choices"][0]["finish_reason"] is None
    ]


def finish(r: Response) -> str:
    [reason] = [c["choices"][0]["finish_reason"] for c in chunks(r) if c["choices"] and c["choices"][0]["finish_reason"]]
    return str(reason)


def tool(name: str, params: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": params, **extra}}


class Weather(BaseModel):
    city: str
    days: int = Field(ge=1, le=14)
    unit: str = "celsius"


TOOLS = [
    tool("get_weather", WEATHER),
    tool("get_forecast", Weather.model_json_schema(), strict=True),
]
TOOL_RESULT = '{"temperature": 21, "sky": "clear"}'
ROUND_TRIP: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": TOOL_RESULT},
]


# --- request decoding ----------------------------------------------------------------


async def test_every_openai_request_shape_is_accepted(autojump_clock: trio.testing.MockClock) -> None:
    r = await Client(sim()).chat(
        body(
            {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
            {
                "role": "user",
                "name": "ann",
                "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "https://x/cat.png", "detail": "low"}},
                    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                    {"type": "file", "file": {"file_id": "file-1", "filename": "a.pdf"}},
                    {"type": "some_future_part", "whatever": {"x": 1}},
                ],
            },
            *ROUND_TRIP[1:],
            max_tokens=4,
            temperature=0.2,
            top_p=0.9,
            seed=3,
            stop=["\n"],
            n=1,
            user="u",
            metadata={"k": "v"},
            store=False,
            frequency_penalty=0,
            presence_penalty=0,
            logit_bias={"50256": -100},
            service_tier="auto",
            modalities=["text"],
            prediction=None,
            a_field_from_the_future={"nested": [1, 2]},
        )
    )
    assert r.status == 200, r.body
    assert r.json()["choices"][0]["message"]["content"].startswith("The tool returned")


async def test_prompt_tokens_count_text_parts_and_85_per_image(
    autojump_clock: trio.testing.MockClock,
) -> None:
    client = Client(sim())

    async def prompt(content: Any) -> int:
        r = await client.chat(body({"role": "user", "content": content}, max_tokens=1))
        return int(r.json()["usage"]["prompt_tokens"])

    as_string = await prompt("hello there")
    as_parts = await prompt([{"type": "text", "text": "hello"}, {"type": "text", "text": " there"}])
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with_images = await prompt([{"type": "text", "text": "hello there"}, image, image])
    assert as_parts == as_string
    assert with_images == as_string + 2 * 85


async def test_a_body_that_is_not_the_api_is_still_400(autojump_clock: trio.testing.MockClock) -> None:
    client = Client(sim())
    for bad in ({"messages": "hi"}, {"messages": [{"role": "user", "content": 5}]}, {}):
        r = await client.chat(bad)
        assert r.status == 400
        assert r.json()["error"]["type"] == "invalid_request_error"


# --- tools -----------------------------------------------------------------------------


async def test_a_tool_call_streams_as_openai_does(autojump_clock: trio.testing.MockClock) -> None:
    t0 = trio.current_time()
    r = await Client(sim()).chat(body(tools=TOOLS, stream=True))
    ds = deltas(r)
    head = ds[0]["tool_calls"][0]
    assert ds[0]["role"] == "assistant"
    assert re.fullmatch(r"call_[0-9a-f]{24}", head["id"])
    assert head == {
        "index": 0,
        "id": head["id"],
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    frags = [d["tool_calls"][0] for d in ds[1:]]
    assert len(frags) >= 3
    assert all(f == {"index": 0, "function": {"arguments": f["function"]["arguments"]}} for f in frags)
    args = json.loads("".join(f["function"]["arguments"] for f in frags))
    assert schema_errors(WEATHER, args) == []
    assert args == {"city": "sim", "unit": "celsius"}
    assert not any("content" in d for d in ds)
    assert finish(r) == "tool_calls"
    # Paced like tokens: the name and the first fragment at TTFT, then one fragment per ITL.
    times = [t - t0 for t, _ in r.chunks]
    assert times[0] == pytest.approx(TTFT)
    assert times[len(frags) - 1] == pytest.approx(TTFT + (len(frags) - 1) * ITL)


async def test_a_tool_call_not_streamed(autojump_clock: trio.testing.MockClock) -> None:
    r = await Client(sim()).chat(body(tools=TOOLS))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] is None
    [call] = msg["tool_calls"]
    assert call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "sim", "unit": "celsius"}
    n = len(split_text(call["function"]["arguments"]))
    assert r.json()["usage"]["completion_tokens"] == n


async def test_tool_choice_names_the_function_and_strict_fills_every_property(
    autojump_clock: trio.testing.MockClock,
) -> None:
    choice = {"type": "function", "function": {"name": "get_forecast"}}
    r = await Client(sim()).chat(body(tools=TOOLS, tool_choice=choice, stream=True))
    ds = deltas(r)
    assert ds[0]["tool_calls"][0]["function"]["name"] == "get_forecast"
    text = "".join(d["tool_calls"][0]["function"]["arguments"] for d in ds[1:])
    assert Weather.model_validate_json(text) == Weather(city="sim", days=1, unit="sim")


@pytest.mark.parametrize(
    ("tool_choice", "calls"),
    [(None, False), ("auto", False), ("required", True), ("none", False),
     ({"type": "function", "function": {"name": "get_weather"}}, True)],
)
async def test_after_a_tool_result_auto_answers_with_the_result(
    autojump_clock: trio.testing.MockClock, tool_choice: Any, calls: bool
) -> None:
    extra = {"tool_choice": tool_choice} if tool_choice is not None else {}
    r = await Client(sim()).chat(body(*ROUND_TRIP, tools=TOOLS, **extra))
    choice = r.json()["choices"][0]
    if calls:
        assert choice["finish_reason"] == "tool_calls"
    else:
        assert choice["finish_reason"] == "stop"
        assert choice["message"]["content"].startswith(f"The tool returned: {TOOL_RESULT}")
        assert "tool_calls" not in choice["message"]


async def test_tool_choice_none_answers_with_text(autojump_clock: trio.testing.MockClock) -> None:
    r = await Client(sim()).chat(body(tools=TOOLS, tool_choice="none", max_tokens=2))
    assert r.json()["choices"][0]["message"]["content"] == "the quick"


async def test_max_tokens_cuts_the_arguments(autojump_clock: trio.testing.MockClock) -> None:
    r = await Client(sim()).chat(body(tools=TOOLS, max_tokens=1, stream=True))
    assert len(deltas(r)) == 2  # the call's name, one fragment
    assert finish(r) == "length"


async def test_a_schema_without_an_instance_is_400(autojump_clock: trio.testing.MockClock) -> None:
    bad = [tool("f", {"$ref": "#/$defs/nowhere"})]
    r = await Client(sim()).chat(body(tools=bad))
    assert r.status == 400
    assert "$ref" in r.json()["error"]["message"]


# --- structured output ---------------------------------------------------------------


def json_schema_format(model: type[BaseModel]) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": model.__name__, "schema": model.model_json_schema(), "strict": True},
    }


async def test_json_schema_content_validates_and_streams_in_pieces(
    autojump_clock: trio.testing.MockClock,
) -> None:
    client = Client(sim())
    r = await client.chat(body(response_format=json_schema_format(Weather), stream=True))
    pieces = [d["content"] for d in deltas(r)]
    assert len(pieces) >= 3
    Weather.model_validate_json("".join(pieces))
    assert finish(r) == "stop"
    whole = await client.chat(body(response_format=json_schema_format(Weather)))
    assert whole.json()["choices"][0]["message"]["content"] == "".join(pieces)


async def test_json_object_is_a_json_object(autojump_clock: trio.testing.MockClock) -> None:
    r = await Client(sim()).chat(body(response_format={"type": "json_object"}))
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)


# --- reasoning -------------------------------------------------------------------------


async def test_reasoning_comes_before_the_content_and_is_counted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    client = Client(sim())
    counts = {}
    for effort in ("low", "medium", "high"):
        r = await client.chat(
            body(reasoning_effort=effort, max_tokens=3, stream=True,
                 stream_options={"include_usage": True})
        )
        ds = deltas(r)
        kinds = ["reasoning" if "reasoning_content" in d else "content" for d in ds]
        n = kinds.count("reasoning")
        assert kinds == ["reasoning"] * n + ["content"] * 3
        assert ds[0]["role"] == "assistant"
        usage = chunks(r)[-1]["usage"]
        assert usage["completion_tokens_details"] == {"reasoning_tokens": n}
        assert usage["completion_tokens"] == n + 3
        counts[effort] = n
    assert 0 < counts["low"] < counts["medium"] < counts["high"]


async def test_reasoning_not_streamed(autojump_clock: trio.testing.MockClock) -> None:
    r = await Client(sim()).chat(body(reasoning_effort="low", max_tokens=2))
    obj = r.json()
    msg = obj["choices"][0]["message"]
    assert msg["content"] == "the quick"
    assert msg["reasoning_content"]
    assert obj["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0


# --- logprobs --------------------------------------------------------------------------


async def test_each_content_delta_carries_its_logprobs(autojump_clock: trio.testing.MockClock) -> None:
    r = await Client(sim()).chat(body(logprobs=True, top_logprobs=3, max_tokens=4, stream=True))
    content = [c["choices"][0] for c in chunks(r) if c["choices"] and "content" in c["choices"][0]["delta"]]
    assert len(content) == 4
    for i, ch in enumerate(content):
        [entry] = ch["logprobs"]["content"]
        assert entry["token"] == ch["delta"]["content"] == token_text(i)
        assert entry["bytes"] == list(token_text(i).encode())
        assert entry["logprob"] < 0
        tops = entry["top_logprobs"]
        assert len(tops) == 3
        assert tops[0]["token"] == entry["token"]
        assert len({t["token"] for t in tops}) == 3
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)


async def test_logprobs_not_streamed_cover_every_token(autojump_clock: trio.testing.MockClock) -> None:
    r = await Client(sim()).chat(body(logprobs=True, max_tokens=5))
    choice = r.json()["choices"][0]
    entries = choice["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == choice["message"]["content"]
    assert all(e["top_logprobs"] == [] for e in entries)


async def test_no_logprobs_unless_asked(autojump_clock: trio.testing.MockClock) -> None:
    client = Client(sim())
    r = await client.chat(body(max_tokens=2, stream=True))
    assert all("logprobs" not in c["choices"][0] for c in chunks(r) if c["choices"])
    assert "logprobs" not in (await client.chat(body(max_tokens=2))).json()["choices"][0]


# --- images and usage ----------------------------------------------------------------


async def test_the_reply_says_how_many_images_it_saw(autojump_clock: trio.testing.MockClock) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    client = Client(sim())
    one = await client.chat(body({"role": "user", "content": [{"type": "text", "text": "?"}, image]}))
    assert one.json()["choices"][0]["message"]["content"].startswith("I see 1 image.")
    two = await client.chat(
        body({"role": "user", "content": [image]}, {"role": "user", "content": [image]}, stream=True)
    )
    assert two.text().startswith("I see 2 images.")


async def test_usage_has_the_token_details(autojump_clock: trio.testing.MockClock) -> None:
    client = Client(sim())
    whole = (await client.chat(body(max_tokens=2))).json()["usage"]
    streamed = chunks(
        await client.chat(body(max_tokens=2, stream=True, stream_options={"include_usage": True}))
    )[-1]["usage"]
    for usage in (whole, streamed):
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
        assert usage["completion_tokens_details"] == {"reasoning_tokens": 0}
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] == usage["prompt_tokens"] + 2


# --- the timing model with reasoning and natural lengths -----------------------------


def test_plan_counts_reasoning_first_and_cuts_a_natural_length() -> None:
    t = Timing(prefill_overhead_ms=10, prefill_per_token_ms=0, itl_ms=1, output_tokens_mean=50)
    rng = random.Random(0)
    p = plan_reply(t, 0, None, rng, length=7, reasoning=3)
    assert (p.tokens, p.visible, p.reasoning, p.finish_reason) == (10, 7, 3, "stop")
    p = plan_reply(t, 0, 4, rng, length=7)
    assert (p.visible, p.finish_reason) == (4, "length")
    p = plan_reply(t, 0, None, rng, at_least=80)
    assert (p.visible, p.finish_reason) == (80, "stop")
