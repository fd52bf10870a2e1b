"""The official ``openai`` SDK against aiserve-sim, in-process (httpx's ASGI transport):
its parsers accept what the sim sends for tools, structured output, reasoning and logprobs.

(This openai release speaks through httpx2, whose ASGI transport reads the whole reply
before the SDK parses it: streams are checked for shape here, not for pacing.)"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx2
import openai
import pytest
import trio
import trio.testing
from pydantic import BaseModel

from aiserve_trio.util.vectors import vector

from .test_sim_chat import TOOL_RESULT, Weather, sim

pytestmark = [
    # The SDK stops reading a stream at [DONE] without closing the async generators
    # it nests (SSE decoder -> httpx byte iterator); Trio finalizes them and warns.
    pytest.mark.filterwarnings("ignore:Async generator .(httpx2?|openai)\\.:ResourceWarning"),
]


class Lookup(BaseModel):
    query: str
    limit: int


@pytest.fixture
async def client() -> AsyncIterator[openai.AsyncOpenAI]:
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=sim()), base_url="http://sim")
    async with http:
        yield openai.AsyncOpenAI(api_key="sk-sim", base_url="http://sim/v1", http_client=http)


def user(text: str = "hi") -> Any:
    return [{"role": "user", "content": text}]


async def test_parse_with_a_pydantic_response_format(
    autojump_clock: trio.testing.MockClock, client: openai.AsyncOpenAI
) -> None:
    r = await client.chat.completions.parse(
        model="sim-model", messages=user(), response_format=Weather
    )
    assert r.choices[0].message.parsed == Weather(city="sim", days=1, unit="sim")


async def test_streamed_tool_call_with_pydantic_function_tools(
    autojump_clock: trio.testing.MockClock, client: openai.AsyncOpenAI
) -> None:
    tools = [openai.pydantic_function_tool(Lookup), openai.pydantic_function_tool(Weather)]
    async with client.chat.completions.stream(
        model="sim-model",
        messages=user(),
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "Weather"}},
        stream_options={"include_usage": True},
    ) as stream:
        done = [ev async for ev in stream if ev.type == "tool_calls.function.arguments.done"]
        final = await stream.get_final_completion()
    assert done[0].parsed_arguments == Weather(city="sim", days=1, unit="sim")
    [call] = final.choices[0].message.tool_calls or []
    assert call.function.name == "Weather"
    assert call.function.parsed_arguments == Weather(city="sim", days=1, unit="sim")
    assert final.choices[0].finish_reason == "tool_calls"
    assert final.usage is not None
    assert final.usage.prompt_tokens_details is not None
    assert final.usage.prompt_tokens_details.cached_tokens == 0


async def test_a_function_calling_round_trip_ends(
    autojump_clock: trio.testing.MockClock, client: openai.AsyncOpenAI
) -> None:
    tools: Any = [openai.pydantic_function_tool(Weather, name="get_weather")]
    first = await client.chat.completions.create(model="sim-model", messages=user(), tools=tools)
    [call] = first.choices[0].message.tool_calls or []
    assert call.type == "function"
    history: Any = [
        *user(),
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT},
    ]
    second = await client.chat.completions.create(model="sim-model", messages=history, tools=tools)
    assert second.choices[0].finish_reason == "stop"
    assert TOOL_RESULT in (second.choices[0].message.content or "")


async def test_reasoning_and_logprobs(
    autojump_clock: trio.testing.MockClock, client: openai.AsyncOpenAI
) -> None:
    r = await client.chat.completions.create(
        model="sim-model",
        messages=user(),
        reasoning_effort="high",
        logprobs=True,
        top_logprobs=2,
        max_completion_tokens=3,
    )
    choice = r.choices[0]
    assert (choice.message.model_extra or {}).get("reasoning_content")
    assert choice.logprobs is not None
    assert [t.token for t in choice.logprobs.content or []] == ["the", " quick", " brown"]
    assert r.usage is not None
    assert r.usage.completion_tokens_details is not None
    assert (r.usage.completion_tokens_details.reasoning_tokens or 0) > 0


async def test_embeddings_in_the_sdks_default_base64(
    autojump_clock: trio.testing.MockClock, client: openai.AsyncOpenAI
) -> None:
    r = await client.embeddings.create(model="sim-embed", input=["a", "b"], dimensions=4)
    assert [d.index for d in r.data] == [0, 1]
    assert r.data[0].embedding == pytest.approx(vector("a", 4), rel=1e-6)
    assert r.usage.prompt_tokens == 2
