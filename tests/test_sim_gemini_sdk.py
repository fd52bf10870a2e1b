"""aiserve-sim's Gemini dialect, proven by Google's own SDK (``google-genai``): text whole
and streamed, thoughts, a function call and its response, the errors."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from google import genai
from google.genai import errors, types

from .sim_process import run_sim

pytestmark = pytest.mark.slow

WEATHER = types.FunctionDeclaration(
    name="get_weather",
    description="The weather in a city",
    parameters=types.Schema(
        type=types.Type.OBJECT,
        properties={"city": types.Schema(type=types.Type.STRING)},
        required=["city"],
    ),
)
TOOLS = types.GenerateContentConfig(
    tools=[types.Tool(function_declarations=[WEATHER])],
    automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
)


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with run_sim() as addr:
        yield addr


@pytest.fixture
def client(sim: str) -> Iterator[genai.Client]:
    options = types.HttpOptions(base_url=f"http://{sim}", api_version="v1beta")
    c = genai.Client(api_key="sim-gemini-key", http_options=options)
    yield c
    c.close()


def test_text_whole_and_streamed(client: genai.Client) -> None:
    whole = client.models.generate_content(model="gemini-sim", contents="hello")
    assert whole.text is not None
    assert whole.text.startswith("the quick")
    assert whole.candidates is not None
    assert whole.candidates[0].finish_reason == types.FinishReason.STOP
    assert whole.usage_metadata is not None
    assert whole.usage_metadata.prompt_token_count
    pieces = [
        c.text or ""
        for c in client.models.generate_content_stream(model="gemini-sim", contents="hello")
    ]
    assert "".join(pieces).startswith("the quick")
    capped = client.models.generate_content(
        model="gemini-sim",
        contents="hello",
        config=types.GenerateContentConfig(max_output_tokens=2),
    )
    assert capped.candidates is not None
    assert capped.candidates[0].finish_reason == types.FinishReason.MAX_TOKENS


def test_thoughts_come_first(client: genai.Client) -> None:
    config = types.GenerateContentConfig(
        thinking_config=types.ThinkingConfig(include_thoughts=True)
    )
    parts = []
    for chunk in client.models.generate_content_stream(
        model="gemini-sim", contents="hi", config=config
    ):
        assert chunk.candidates is not None
        content = chunk.candidates[0].content
        parts += content.parts or [] if content is not None else []
    thoughts = [p.text for p in parts if p.thought]
    assert thoughts
    assert thoughts[0] == "Let"


def test_a_function_call_and_its_response(client: genai.Client) -> None:
    calls = []
    for chunk in client.models.generate_content_stream(
        model="gemini-sim", contents="weather in Oslo?", config=TOOLS
    ):
        calls += chunk.function_calls or []
    (call,) = calls
    assert call.name == "get_weather"
    assert call.args is not None
    assert set(call.args) == {"city"}
    history = [
        types.Content(role="user", parts=[types.Part(text="weather in Oslo?")]),
        types.Content(role="model", parts=[types.Part(function_call=call)]),
        types.Content(
            role="user",
            parts=[
                types.Part.from_function_response(name="get_weather", response={"result": "sunny"})
            ],
        ),
    ]
    answer = client.models.generate_content(model="gemini-sim", contents=history, config=TOOLS)
    assert answer.text is not None
    assert answer.text.startswith("The tool returned: sunny")


def test_errors_in_googles_shape(client: genai.Client, sim: str) -> None:
    limited = types.GenerateContentConfig(
        http_options=types.HttpOptions(headers={"X-Sim-Fault": "429"})
    )
    with pytest.raises(errors.ClientError) as info:
        client.models.generate_content(model="gemini-sim", contents="hi", config=limited)
    assert info.value.code == 429
    assert info.value.status == "RESOURCE_EXHAUSTED"
    options = types.HttpOptions(
        base_url=f"http://{sim}", api_version="v1beta", headers={"x-goog-api-key": ""}
    )
    anonymous = genai.Client(api_key="x", http_options=options)
    with pytest.raises(errors.ClientError) as denied:
        anonymous.models.generate_content(model="gemini-sim", contents="hi")
    assert denied.value.code == 403
    anonymous.close()
