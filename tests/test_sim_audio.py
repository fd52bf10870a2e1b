"""aiserve-sim's parts in a chain: speech to text (multipart) and classify prompts.

In process, on the virtual clock; the form is the one the gateway's ``openai``
adapter sends (``adapters/transcription.py``), so both sides are held to one shape.
"""

from __future__ import annotations

import json

import pytest
import trio
import trio.testing

from aiserve_trio.adapters.transcription import multipart_body, read_transcript
from aiserve_trio.sim import SimApp, SimSettings, Timing
from aiserve_trio.sim.audio import FormError, parse_form
from aiserve_trio.util.intents import DEFAULT_PROMPT, prompt
from aiserve_trio.util.wav import make_wav

from .asgi_client import Client, Response

PATH = "/v1/audio/transcriptions"


def sim() -> SimApp:
    return SimApp(SimSettings(timing=Timing(prefill_overhead_ms=40, prefill_per_token_ms=5), seed=1))


async def transcribe(
    app: SimApp, audio: bytes, fmt: str = "wav", **fields: str
) -> Response:
    kind, body = multipart_body("b0undary", {"model": "whisper-1", **fields}, audio, fmt)
    return await Client(app).request(
        "POST", PATH, body=body, headers={"content-type": kind.decode()}
    )


async def test_the_sim_hears_a_wavs_comment_after_a_prefill_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = sim()
    t0 = trio.current_time()
    r = await transcribe(app, make_wav("I want to pay in instalments"))
    assert r.status == 200
    assert read_transcript(r.body) == "I want to pay in instalments"
    # 40 ms + 6 words x 5 ms
    assert trio.current_time() - t0 == pytest.approx(0.070)
    assert (app.stats.requests, app.stats.completed) == (1, 1)
    (logged,) = app.log.as_dict()["requests"]
    assert logged["path"] == PATH
    assert logged["headers"]["content-type"].startswith("multipart/form-data; boundary=")


async def test_other_audio_and_the_text_format(autojump_clock: trio.testing.MockClock) -> None:
    app = sim()
    r = await transcribe(app, make_wav(None, seconds=2.0))
    assert read_transcript(r.body) == "[2.0 seconds of audio without speech]"
    r = await transcribe(app, b"\xff\xfb" * 8, "mp3", response_format="text")
    assert r.headers["content-type"].startswith("text/plain")
    assert r.body == b"[16 bytes of mp3 audio without speech]"


async def test_budget_and_faults_apply_as_for_chat(autojump_clock: trio.testing.MockClock) -> None:
    app = sim()
    kind, body = multipart_body("b", {"model": "whisper-1"}, make_wav("hello"), "wav")
    r = await Client(app).request(
        "POST", PATH, body=body, headers={"content-type": kind.decode(), "x-sim-fault": "503"}
    )
    assert r.status == 503
    assert app.stats.faults["503"] == 1


@pytest.mark.parametrize(
    ("content_type", "body", "why"),
    [
        ("application/json", b"{}", "multipart/form-data"),
        ("multipart/form-data", b"", "names no boundary"),
        (
            "multipart/form-data; boundary=b",
            b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nw\r\n--b--\r\n',
            "no `file` part",
        ),
        (
            "multipart/form-data; boundary=b",
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.ogg"\r\n\r\nxx\r\n'
            b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nw\r\n--b--\r\n',
            "must be one of wav, mp3",
        ),
        (
            "multipart/form-data; boundary=b",
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nxx\r\n'
            b"--b--\r\n",
            "no `model` field",
        ),
    ],
)
def test_a_form_the_sim_cannot_read_is_refused(content_type: str, body: bytes, why: str) -> None:
    with pytest.raises(FormError, match=why):
        parse_form(content_type, body)


async def test_a_wav_that_is_not_one_is_a_400(autojump_clock: trio.testing.MockClock) -> None:
    r = await transcribe(sim(), b"RIFF....nope")
    assert r.status == 400
    assert "not a WAV file" in r.json()["error"]["message"]


async def test_a_classify_prompt_gets_exactly_the_label(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = sim()
    system = prompt(DEFAULT_PROMPT, ["mortgage", "instalment"])
    for user, label in (("my mortgages", "mortgage"), ("good morning", "unknown")):
        body = {
            "model": "sim-model",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        }
        r = await Client(app).chat(body)
        assert r.json()["choices"][0]["message"]["content"] == label
        r = await Client(app).chat({**body, "stream": True})
        texts = [
            c["choices"][0]["delta"].get("content", "")
            for e in r.events()[:-1]
            if (c := json.loads(e))["choices"]
        ]
        assert "".join(texts) == label
