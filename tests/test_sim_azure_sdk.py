"""aiserve-sim's Azure OpenAI dialect, proven by the official SDK's ``openai.AzureOpenAI``:
the deployment path and ``api-version``, Azure's first chunk with empty ``choices`` and its
``content_filter_results``, a streamed tool call, a filtered prompt's error."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx2
import openai
import pytest

from .sim_process import run_sim
from .test_sdk_fidelity import TOOLS

pytestmark = pytest.mark.slow

HI: Any = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with run_sim() as addr:
        yield addr


@pytest.fixture
def client(sim: str) -> Iterator[openai.AzureOpenAI]:
    with openai.AzureOpenAI(
        api_key="sim-azure-key",
        api_version="2024-10-21",
        azure_endpoint=f"http://{sim}",
        max_retries=0,
    ) as c:
        yield c


def test_text_whole_and_streamed(client: openai.AzureOpenAI, sim: str) -> None:
    whole = client.chat.completions.create(model="prod-gpt4o", messages=HI)
    assert whole.choices[0].message.content is not None
    assert whole.choices[0].message.content.startswith("the quick")
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage is not None
    chunks = list(client.chat.completions.create(model="prod-gpt4o", messages=HI, stream=True))
    assert chunks[0].choices == []  # Azure's first chunk: the prompt's filter results only
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith("the quick")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None
    got = httpx2.get(f"http://{sim}/sim/requests").json()["requests"][-1]
    assert got["path"] == "/openai/deployments/prod-gpt4o/chat/completions?api-version=2024-10-21"
    assert got["headers"]["api-key"] == "sim-azure-key"


def test_a_streamed_tool_call(client: openai.AzureOpenAI) -> None:
    name, args, finish = "", "", None
    stream = client.chat.completions.create(
        model="prod-gpt4o", messages=HI, tools=TOOLS, stream=True
    )
    for chunk in stream:
        if not chunk.choices:
            continue
        for call in chunk.choices[0].delta.tool_calls or []:
            if call.function is not None:
                name = name or (call.function.name or "")
                args += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, finish) == ("get_weather", "tool_calls")
    assert set(json.loads(args)) == {"city"}


def test_a_filtered_prompt_and_a_missing_key(client: openai.AzureOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="prod-gpt4o", messages=[{"role": "user", "content": "sim-content-filter"}]
        )
    assert info.value.code == "content_filter"
    body: Any = info.value.body
    assert body["innererror"]["code"] == "ResponsibleAIPolicyViolation"
    with pytest.raises(openai.AuthenticationError):  # no key sent at all
        client.chat.completions.create(
            model="prod-gpt4o", messages=HI, extra_headers={"api-key": openai.Omit()}
        )
