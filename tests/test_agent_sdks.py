"""Agent SDKs through the gateway, each with its owner's own client and each finishing a
tool-using turn (issue 44): the OpenAI Agents SDK over the Chat Completions and the Responses
routes, LangChain's ``ChatOpenAI`` and ``ChatAnthropic`` (``stream``, ``bind_tools`` with the
tool's result sent back, ``with_structured_output``). Real processes: the hypercorn binary and
aiserve-sim, which calls the first tool offered (or the one a ``sim-call:`` line names) and,
given the tool's result, answers quoting it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import agents
import httpx
import pytest
from langchain_anthropic import ChatAnthropic
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI
from pydantic import BaseModel, SecretStr

from .agent_routes import PROVIDER_KEY, agent_gateway
from .sim_process import run_sim

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with run_sim() as addr:
        yield addr


@pytest.fixture(scope="module")
def gateway(sim: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with agent_gateway(sim, tmp_path_factory.mktemp("conf")) as base:
        yield base


def sim_requests(sim: str) -> list[dict[str, Any]]:
    """What the sim received, oldest first (path, headers, body)."""
    return list(httpx.get(f"http://{sim}/sim/requests").json()["requests"])


class Forecast(BaseModel):
    city: str
    days: int


# --- OpenAI Agents SDK --------------------------------------------------------------


#: (the model class, the base URL's path, what the sim then receives): the SDK's default
#: class speaks Responses, translated to Chat for the openai adapter or passed through.
AGENT_CASES = {
    "chat": (agents.OpenAIChatCompletionsModel, "/oai/v1", "/v1/chat/completions"),
    "responses": (agents.OpenAIResponsesModel, "/oai/v1", "/v1/chat/completions"),
    "responses-native": (agents.OpenAIResponsesModel, "/native/v1", "/v1/responses"),
}


async def _agents_run(gateway: str, case: str) -> tuple[agents.RunResult, list[str]]:
    model_class, prefix, _ = AGENT_CASES[case]
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    base_url = gateway + prefix
    async with AsyncOpenAI(api_key="k", base_url=base_url, max_retries=0) as client:
        model = model_class(model="sim-model", openai_client=client)
        agent = agents.Agent(
            name="forecaster", instructions="Use the tool.", tools=[get_weather], model=model
        )
        result = await agents.Runner.run(agent, 'Weather?\nsim-call: get_weather {"city": "Oslo"}')
    return result, seen


@pytest.mark.parametrize("case", list(AGENT_CASES))
def test_openai_agents_sdk_runs_a_tool_and_answers(gateway: str, sim: str, case: str) -> None:
    agents.set_tracing_disabled(True)  # else it sends traces to OpenAI
    result, seen = asyncio.run(_agents_run(gateway, case))
    assert seen == ["Oslo"]  # the tool ran with the sim's arguments
    # the second turn carried the tool's result back, and the model answered with it
    assert result.final_output.startswith("The tool returned: sunny in Oslo")
    up = sim_requests(sim)[-1]
    assert up["path"] == AGENT_CASES[case][2]
    assert "sunny in Oslo" in up["body"]


@pytest.mark.parametrize("case", list(AGENT_CASES))
def test_openai_agents_sdk_streamed_run(gateway: str, case: str) -> None:
    model_class, prefix, _ = AGENT_CASES[case]

    async def run() -> tuple[list[str], agents.RunResultStreaming]:
        @agents.function_tool
        def get_weather(city: str) -> str:
            """The weather in a city."""
            return f"rain in {city}"

        async with AsyncOpenAI(api_key="k", base_url=gateway + prefix, max_retries=0) as c:
            model = model_class(model="sim-model", openai_client=c)
            agent = agents.Agent(name="f", tools=[get_weather], model=model)
            streamed = agents.Runner.run_streamed(agent, 'sim-call: get_weather {"city": "Bergen"}')
            kinds: list[str] = [e.type async for e in streamed.stream_events()]
            return kinds, streamed

    agents.set_tracing_disabled(True)
    kinds, streamed = asyncio.run(run())
    assert kinds.count("raw_response_event") > 5  # the model's events, as they came
    items = [i.type for i in streamed.new_items]
    assert items == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert streamed.final_output.startswith("The tool returned: rain in Bergen")


# --- LangChain ------------------------------------------------------------------------


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


#: The LangChain chat models: ChatOpenAI over Chat Completions (its default) and over
#: Responses (translated to Chat, and natively), ChatAnthropic over the native Messages
#: route; and what the sim then receives.
LC = {
    "openai": "/v1/chat/completions",
    "openai-responses": "/v1/chat/completions",
    "openai-responses-native": "/v1/responses",
    "anthropic": "/v1/messages",
}


@pytest.fixture(params=list(LC))
def lc(request: pytest.FixtureRequest, gateway: str) -> Any:
    if request.param == "anthropic":
        return ChatAnthropic(
            model_name="claude-sonnet-4-5",
            base_url=f"{gateway}/claude",
            api_key=SecretStr("client-key"),
            max_retries=0,
            timeout=30,
            stop=None,
        )
    native = request.param == "openai-responses-native"
    return ChatOpenAI(
        model="sim-model",
        base_url=f"{gateway}/native/v1" if native else f"{gateway}/oai/v1",
        api_key=SecretStr("client-key"),
        max_retries=0,
        use_responses_api=request.param != "openai",
    )


def upstream_path(lc: Any) -> str:
    if isinstance(lc, ChatAnthropic):
        return LC["anthropic"]
    return LC["openai-responses-native" if "/native/" in lc.openai_api_base else "openai"]


def test_langchain_streams(lc: Any, sim: str) -> None:
    chunks = list(lc.stream("Say something"))
    assert len([c for c in chunks if c.text]) > 1
    assert "".join(c.text for c in chunks).startswith("the quick brown fox")
    up = sim_requests(sim)[-1]
    assert up["path"] == upstream_path(lc)
    assert json.loads(up["body"])["stream"] is True


def test_langchain_tool_round_trip(lc: Any, sim: str) -> None:
    bound = lc.bind_tools([get_weather])
    history: list[Any] = [HumanMessage('Weather?\nsim-call: get_weather {"city": "Oslo"}')]
    first = bound.invoke(history)
    assert [(c["name"], c["args"]) for c in first.tool_calls] == [("get_weather", {"city": "Oslo"})]
    call = first.tool_calls[0]
    history += [first, ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"])]
    second = bound.invoke(history)
    assert not second.tool_calls
    assert second.text.startswith("The tool returned: sunny in Oslo")
    up = sim_requests(sim)[-1]
    assert up["path"] == upstream_path(lc)
    assert call["id"] in up["body"]  # the tool's result went back under the call's id
    if isinstance(lc, ChatAnthropic):  # natively: LangChain's blocks as it wrote them
        assert up["headers"]["x-api-key"] == PROVIDER_KEY  # the gateway's, not the client's
        sent = json.loads(up["body"])["messages"]
        assert sent[0]["content"] == history[0].content  # a string, not made a text block
        assert sent[-1]["content"] == [
            {
                "type": "tool_result",
                "content": "sunny in Oslo",
                "tool_use_id": call["id"],
                "is_error": False,
            }
        ]


def test_langchain_streamed_tool_call(lc: Any) -> None:
    bound = lc.bind_tools([get_weather])
    total: Any = None
    for chunk in bound.stream('sim-call: get_weather {"city": "Bergen"}'):
        total = chunk if total is None else total + chunk
    assert [(c["name"], c["args"]) for c in total.tool_calls] == [
        ("get_weather", {"city": "Bergen"})
    ]


def test_langchain_structured_output(lc: Any) -> None:
    forecast = lc.with_structured_output(Forecast).invoke("Forecast for somewhere")
    assert isinstance(forecast, Forecast)


@pytest.mark.parametrize(
    ("prefix", "model", "path"),
    [
        ("/claude", "claude-sonnet-4-5", "/v1/messages"),  # native: output_config as sent
        ("/oai", "sim-model", "/v1/chat/completions"),  # translated: response_format
    ],
    ids=["native", "translated"],
)
def test_chat_anthropic_structured_outputs(
    gateway: str, sim: str, prefix: str, model: str, path: str
) -> None:
    chat = ChatAnthropic(
        model_name=model,
        base_url=gateway + prefix,
        api_key=SecretStr("client-key"),
        max_retries=0,
        timeout=30,
        stop=None,
    )
    structured = chat.with_structured_output(Forecast, method="json_schema")
    forecast = structured.invoke("Forecast for somewhere")
    assert isinstance(forecast, Forecast)
    up = sim_requests(sim)[-1]
    assert up["path"] == path
    body = json.loads(up["body"])
    schema = (
        body["output_config"]["format"]
        if path == "/v1/messages"
        else body["response_format"]["json_schema"]
    )
    assert schema["schema"]["required"] == ["city", "days"]


def test_langchain_anthropic_on_the_translated_default_route(gateway: str) -> None:
    """The embedded default's /v1/messages (the built-in mock, translated from Messages):
    the mock calls get_weather when asked about the weather in a city, and answers the
    tool's result with its default reply."""
    chat = ChatAnthropic(
        model_name="aiserve-mock",
        base_url=gateway,
        api_key=SecretStr("client-key"),
        max_retries=0,
        timeout=30,
        stop=None,
    )
    bound = chat.bind_tools([get_weather])
    history: list[Any] = [HumanMessage("What is the weather in Oslo?")]
    first = bound.invoke(history)
    assert [(c["name"], c["args"]) for c in first.tool_calls] == [("get_weather", {"city": "Oslo"})]
    history += [first, ToolMessage("sunny", tool_call_id=first.tool_calls[0]["id"])]
    second = bound.invoke(history)
    assert not second.tool_calls
    assert second.text.startswith("I am the aiserve-trio mock model")
