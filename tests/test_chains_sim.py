"""A chain over real HTTP: the gateway's ``openai`` adapters in front of an aiserve-sim process.

Speech to text goes out as OpenAI's multipart form, the classify prompt and the
answer as chat completions; the sim's request log shows what each call carried.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest

from aiserve_trio.runtime.asgi import App
from aiserve_trio.util.wav import audio_part, make_wav

from .conftest import make_config
from .sim_gateway import running, sim_reset
from .sim_process import run_sim

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:Async generator .httpcore2:ResourceWarning"),
]


@pytest.fixture(scope="module")
def sim_addr() -> Iterator[str]:
    with run_sim() as addr:
        yield addr


def chain_config(addr: str) -> str:
    return f"""
[adapters.sim]
kind = "openai"
base_url = "http://{addr}/v1"
models = ["sim-model"]

[adapters.sim_large]
kind = "openai"
base_url = "http://{addr}/v1"
models = ["sim-model-large"]

[[routes]]
path = "/v1/bank"
name = "bank"
adapter = "sim"
[[routes.steps]]
name = "asr"
kind = "transcribe"
model = "whisper-1"
[[routes.steps]]
name = "intent"
kind = "classify"
labels = ["mortgage", "instalment"]
[[routes.steps]]
name = "pick"
kind = "route"
when = {{ mortgage = {{ adapter = "sim_large" }} }}
[[routes.steps]]
name = "answer"
kind = "generate"
[[routes.steps]]
name = "comply"
kind = "rewrite"
policy = "no-rate-figures"
"""


async def sim_requests(addr: str) -> list[dict[str, Any]]:
    async with httpx2.AsyncClient() as c:
        r = await c.get(f"http://{addr}/sim/requests")
        return list(r.json()["requests"])


async def test_a_spoken_request_goes_through_the_sims_endpoints(sim_addr: str) -> None:
    await sim_reset(sim_addr)
    app = App(make_config(chain_config(sim_addr)))
    wav = make_wav("I need a mortgage for a flat", seconds=0.5)
    body = {
        "model": "sim-model",
        "stream": True,
        "metadata": {"channel_ref": "ivr-7"},
        "messages": [{"role": "user", "content": [audio_part(wav)]}],
    }
    async with running(app) as client:
        r = await client.request("POST", "/v1/bank", json_body=body)
    assert r.status == 200, r.body
    assert r.headers["x-aiserve-steps"] == "asr,intent,pick,answer,comply"
    assert r.headers["x-aiserve-deployment"] == "sim_large"
    assert r.events()[-1] == "[DONE]"
    asr, classify, answer = await sim_requests(sim_addr)
    # 1. speech to text: a multipart form with the file and the model
    assert asr["path"] == "/v1/audio/transcriptions"
    assert asr["headers"]["content-type"].startswith("multipart/form-data; boundary=")
    form = asr["body"]
    assert 'name="model"\r\n\r\nwhisper-1' in form
    assert 'name="file"; filename="audio.wav"' in form
    assert "x-request-timeout-ms" in asr["headers"]  # the step's budget went with it
    # 2. the classifier: the transcript under the labels prompt
    assert classify["path"] == "/v1/chat/completions"
    asked = json.loads(classify["body"])
    assert "Labels: mortgage, instalment" in asked["messages"][0]["content"]
    assert asked["messages"][1]["content"] == "I need a mortgage for a flat"
    # 3. the answer, by the larger model, with the transcript and the label
    sent = json.loads(answer["body"])
    assert sent["model"] == "sim-model-large"
    assert sent["messages"][0]["content"] == [
        {"type": "text", "text": "I need a mortgage for a flat"}
    ]
    assert sent["metadata"] == {"channel_ref": "ivr-7", "intent": "mortgage"}


async def test_audio_the_sim_cannot_read_is_the_clients_400(sim_addr: str) -> None:
    app = App(make_config(chain_config(sim_addr)))
    part = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(b"RIFF-but-not").decode(), "format": "wav"},
    }
    body = {"model": "sim-model", "messages": [{"role": "user", "content": [part]}]}
    async with running(app) as client:
        r = await client.request("POST", "/v1/bank", json_body=body)
    assert r.status == 400
    error = r.json()["error"]
    assert error["param"] == "messages[0].content[0]"
    assert error["code"] == "invalid_audio"
    assert "not a WAV file" in error["message"]
