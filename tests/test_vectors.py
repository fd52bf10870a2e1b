"""``util/vectors.py``: lexical vectors that the mock, aiserve-sim and the semantic cache's tests use."""

from __future__ import annotations

import math
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from aiserve_trio.util.vectors import DEFAULT_DIMENSIONS, cosine, normalise, vector, words


def wide(text: str) -> str:
    """``text`` in full-width forms (the way some phone keyboards type it)."""
    return "".join("\u3000" if c == " " else chr(ord(c) + 0xFEE0) for c in text)


def sim(a: str, b: str) -> float:
    return cosine(vector(a, DEFAULT_DIMENSIONS), vector(b, DEFAULT_DIMENSIONS))


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("How do I reset my PIN?", "how do i reset my pin"),  # case, punctuation
        ("How do I reset my PIN?", "How  do I   reset my PIN ?!"),  # spacing
        (wide("PIN reset 20"), "PIN reset 20"),  # width
        ("the 20-year rate", "the 20 year rate"),  # hyphens
        ("二十年期房贷利率是多少\uff1f", "二十年期 房贷利率是多少"),  # Chinese punctuation, spaces
    ],
)
def test_what_normalising_ignores_gives_the_same_vector(a: str, b: str) -> None:
    assert vector(a, 64) == vector(b, 64)
    assert sim(a, b) == pytest.approx(1.0)


def test_texts_sharing_words_are_nearer_than_texts_that_do_not() -> None:
    q = "What is the annual fee of the platinum credit card?"
    near = sim(q, "What is the annual fee for the platinum credit card?")
    far = sim(q, "How do I open a savings account for my child?")
    assert near > 0.8
    assert far < 0.3


def test_a_changed_word_moves_the_vector() -> None:
    assert sim("credit card annual fee", "debit card annual fee") < 0.92


def test_han_characters_are_words_and_width_is_folded() -> None:
    assert words("信用卡Ａ-1") == ["信", "用", "卡", "a", "1"]
    assert normalise("Hello,  WORLD!") == "hello world"


@given(st.text(max_size=40), st.integers(min_value=1, max_value=64))
def test_a_vector_is_a_unit_vector_or_zero_and_the_same_every_time(text: str, dims: int) -> None:
    v = vector(text, dims)
    assert len(v) == dims
    n = math.sqrt(sum(x * x for x in v))
    assert n == pytest.approx(1.0) or n == 0.0
    assert v == vector(text, dims)


@pytest.mark.parametrize("server", ["gateway", "sim"])
async def test_a_large_input_is_embedded_off_the_event_loop(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 200 KB of text is ~250 ms of hashing: the mock and aiserve-sim hand it to a
    # worker thread; a short input is embedded at once.
    from aiserve_trio.adapters import mock
    from aiserve_trio.runtime.asgi import App
    from aiserve_trio.sim import SimApp, SimSettings, Timing
    from aiserve_trio.sim import app as sim_app

    from .asgi_client import Client
    from .conftest import make_config

    module: Any = mock if server == "gateway" else sim_app
    on_loop: list[bool] = []
    real = module.embeddings_body

    def spy(*args: Any) -> Any:
        try:
            trio.lowlevel.current_task()
            on_loop.append(True)
        except RuntimeError:  # a worker thread: no Trio task here
            on_loop.append(False)
        return real(*args)

    monkeypatch.setattr(module, "embeddings_body", spy)
    timing = Timing(prefill_overhead_ms=0, prefill_per_token_ms=0)
    app: Any = App(make_config()) if server == "gateway" else SimApp(SimSettings(timing=timing))
    model = "aiserve-mock" if server == "gateway" else "sim-embed"
    long = "the quick brown fox jumps over the lazy dog 12345 " * 4_000
    client = Client(app)
    for text in (long, "short"):
        r = await client.request(
            "POST", "/v1/embeddings", json_body={"model": model, "input": text}
        )
        assert r.status == 200
        assert r.json()["data"][0]["embedding"] == pytest.approx(vector(text, DEFAULT_DIMENSIONS))
    assert on_loop == [False, True]
