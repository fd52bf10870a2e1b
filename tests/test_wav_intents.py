"""The simulated speech to text (wav.py) and intent labels (intents.py): pure, no sockets."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from aiserve_trio.util.intents import DEFAULT_PROMPT, parse_label, prompt, simulated_label
from aiserve_trio.util.wav import WavError, make_wav, read_wav, transcript
from aiserve_trio.util.wavtool import main

LABELS = ["mortgage", "instalment", "card_limit"]

# --- wav.py ------------------------------------------------------------------------


def test_a_wav_carries_its_transcript_and_length() -> None:
    audio = make_wav("I want to pay in instalments", seconds=1.5)
    info = read_wav(audio)
    assert info.comment == "I want to pay in instalments"
    assert info.seconds == pytest.approx(1.5)
    assert transcript(audio, "wav") == "I want to pay in instalments"


def test_unicode_and_odd_lengths_survive_the_chunk_padding() -> None:
    text = "我想办理分期付款"  # odd byte count with the NUL: the chunk is padded
    assert read_wav(make_wav(text, seconds=0.25)).comment == text


def test_a_wav_without_a_comment_is_heard_as_its_length() -> None:
    audio = make_wav(None, seconds=2.0)
    assert read_wav(audio).comment is None
    assert transcript(audio, "wav") == "[2.0 seconds of audio without speech]"


def test_mp3_is_heard_as_its_size() -> None:
    assert transcript(b"\xff\xfb" * 100, "mp3") == "[200 bytes of mp3 audio without speech]"


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"not a wav at all", "no RIFF/WAVE header"),
        (make_wav("x")[:-10], "runs past the end"),
        (b"RIFF\x04\x00\x00\x00WAVE", "needs a `fmt ` and a `data` chunk"),
    ],
)
def test_bytes_that_are_not_a_wav_are_refused(data: bytes, why: str) -> None:
    with pytest.raises(WavError, match=why):
        transcript(data, "wav")


def test_the_command_line_makes_a_wav_and_a_chat_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ask.wav"
    assert main(["make", "echo: hello from the phone", str(path), "--seconds", "0.5"]) == 0
    assert read_wav(path.read_bytes()).comment == "echo: hello from the phone"
    assert main(["chat", str(path), "--model", "aiserve-mock", "--stream"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["model"] == "aiserve-mock"
    assert body["stream"] is True
    (part,) = body["messages"][0]["content"]
    assert part["type"] == "input_audio"
    assert part["input_audio"]["format"] == "wav"
    assert base64.b64decode(part["input_audio"]["data"]) == path.read_bytes()


# --- intents.py --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "label"),
    [
        ("mortgage", "mortgage"),
        ("Mortgage.", "mortgage"),
        ('"instalment"', "instalment"),
        ("Label: instalment", "instalment"),
        ("**card limit**", "card_limit"),
        ('{"label": "card_limit"}', "card_limit"),
        ("This is about an instalment plan, not a mortgage.", "instalment"),
        ("I cannot tell.", None),
        ("", None),
    ],
)
def test_a_models_answer_is_read_forgivingly(answer: str, label: str | None) -> None:
    assert parse_label(answer, LABELS) == label


def test_the_prompt_lists_the_labels() -> None:
    text = prompt(DEFAULT_PROMPT, LABELS)
    assert "Labels: mortgage, instalment, card_limit\n" in text


@pytest.mark.parametrize(
    ("user", "label"),
    [
        ("I would like two mortgages", "mortgage"),  # a word beginning with the label
        ("Can I raise my card limit? Or pay in instalments?", "card_limit"),  # named first
        ("hello there", "unknown"),
    ],
)
def test_the_simulated_classifier_answers_the_label_named_first(user: str, label: str) -> None:
    assert simulated_label(prompt(DEFAULT_PROMPT, LABELS), user) == label


def test_without_a_labels_line_there_is_nothing_to_classify() -> None:
    assert simulated_label("You are a helpful assistant.", "mortgage") is None
