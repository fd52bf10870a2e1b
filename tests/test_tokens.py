"""Token budget control: counting with a real tokenizer, trimming the oldest history."""

from __future__ import annotations

import pytest

from aiserve_trio.adapters.base import InferenceRequest, Message
from aiserve_trio.adapters.tokens import (
    REPLY_PRIMING,
    count_prompt,
    encoding_name_for,
    fit_messages,
    fit_request,
    get_encoding,
    message_counter,
)
from aiserve_trio.core.errors import BadRequest


def one_per_message(m: Message) -> int:
    """A stand-in tokenizer: every message costs 10 tokens."""
    return 10


def msgs(*roles: str) -> list[Message]:
    return [Message(role=r, content=f"{r} {i}") for i, r in enumerate(roles)]


@pytest.mark.parametrize(
    ("model", "name"),
    [
        ("gpt-4o-mini", "o200k_base"),
        ("gpt-4.1", "o200k_base"),
        ("o3-mini", "o200k_base"),
        ("openai/gpt-5", "o200k_base"),
        ("gpt-4", "cl100k_base"),
        ("gpt-3.5-turbo", "cl100k_base"),
        ("sim-model", "cl100k_base"),
        ("meta-llama/Llama-3-8B", "cl100k_base"),
    ],
)
def test_tokenizer_by_model_family(model: str, name: str) -> None:
    assert encoding_name_for(model) == name


def test_override_wins() -> None:
    assert encoding_name_for("gpt-4o", "cl100k_base") == "cl100k_base"


def test_real_tokenizer_counts() -> None:
    enc = get_encoding("cl100k_base")
    assert enc.encode_ordinary("hello world") == [15339, 1917]
    count = message_counter(enc)
    # 3 framing + "user" (1) + "hello world" (2)
    assert count(Message(role="user", content="hello world")) == 6
    assert count(Message(role="user", content="hello world", name="bob")) == 8


def test_unknown_tokenizer() -> None:
    with pytest.raises(ValueError, match="unknown tokenizer"):
        get_encoding("no_such_base")


def test_fits_untouched() -> None:
    m = msgs("system", "user", "assistant", "user")
    fitted = fit_messages(m, max_tokens=100, context_window=1000, count=one_per_message)
    assert fitted.messages == m
    assert fitted.trimmed == 0
    assert fitted.prompt_tokens == 40 + REPLY_PRIMING


def test_trims_oldest_non_system_first() -> None:
    m = msgs("system", "user", "assistant", "user", "assistant", "user")
    # 60 + 3 priming + 20 reply = 83; a window of 65 needs 2 messages gone.
    fitted = fit_messages(m, max_tokens=20, context_window=65, count=one_per_message)
    assert fitted.trimmed == 2
    assert [x.content for x in fitted.messages] == ["system 0", "user 3", "assistant 4", "user 5"]
    assert fitted.prompt_tokens == 43


def test_system_messages_anywhere_are_kept() -> None:
    m = msgs("user", "system", "assistant", "developer", "user")
    fitted = fit_messages(m, max_tokens=1, context_window=34, count=one_per_message)
    assert [x.role for x in fitted.messages] == ["system", "developer", "user"]
    assert fitted.trimmed == 2


def test_last_message_is_never_dropped() -> None:
    m = msgs("system", "user")
    with pytest.raises(BadRequest) as info:
        fit_messages(m, max_tokens=10, context_window=20, count=one_per_message)
    assert info.value.code == "context_length_exceeded"
    assert info.value.status == 400


def test_no_max_tokens_leaves_room_for_one() -> None:
    m = msgs("user", "user")
    assert fit_messages(m, max_tokens=None, context_window=24, count=one_per_message).trimmed == 0
    assert fit_messages(m, max_tokens=None, context_window=23, count=one_per_message).trimmed == 1


def test_with_the_real_tokenizer_long_history_is_cut() -> None:
    count = message_counter(get_encoding("cl100k_base"))
    history = [
        Message(role="user" if i % 2 else "assistant", content="word " * 50) for i in range(20)
    ]
    m = [Message(role="system", content="be brief"), *history, Message(role="user", content="hi?")]
    fitted = fit_messages(m, max_tokens=100, context_window=500, count=count)
    assert fitted.trimmed > 0
    assert fitted.prompt_tokens is not None
    assert fitted.prompt_tokens + 100 <= 500
    assert sum(count(x) for x in fitted.messages) + REPLY_PRIMING == fitted.prompt_tokens
    assert fitted.messages[0].role == "system"
    assert fitted.messages[-1].content == "hi?"


# --- fit_request: the tokenizer only when the prompt might not fit ---------------


def inference(content: str, *, max_tokens: int | None = 10) -> InferenceRequest:
    return InferenceRequest(
        request_id="r",
        model="sim-model",
        messages=[Message(role="system", content="be brief"), Message(role="user", content=content)],
        deadline=1e9,
        max_tokens=max_tokens,
    )


async def test_a_prompt_that_fits_by_its_bytes_is_sent_whole_and_uncounted() -> None:
    # No such table: a load would raise, so passing proves nothing was tokenized.
    fitted = await fit_request(inference("héllo " * 100), 1000, "no_such_base")
    assert fitted.prompt_tokens is None
    assert fitted.trimmed == 0
    assert [m.content for m in fitted.messages] == ["be brief", "héllo " * 100]


async def test_a_prompt_over_the_window_in_bytes_is_counted_exactly() -> None:
    # 6,000 bytes but ~1,000 tokens: over a 2,000 window by bytes, inside it by tokens.
    req = inference("word " * 1000 + "end")
    fitted = await fit_request(req, 2000, None)
    count = message_counter(get_encoding("cl100k_base"))
    assert fitted.prompt_tokens == REPLY_PRIMING + sum(count(m) for m in req.messages)
    assert fitted.trimmed == req.trimmed == 0
    with pytest.raises(ValueError, match="unknown tokenizer"):
        await fit_request(req, 2000, "no_such_base")


async def test_a_prompt_over_the_window_in_tokens_is_refused() -> None:
    with pytest.raises(BadRequest, match="context window of 500"):
        await fit_request(inference("word " * 1000), 500, None)


async def test_count_prompt_matches_the_counter() -> None:
    req = inference("how many tokens is this?")
    count = message_counter(get_encoding("cl100k_base"))
    expected = REPLY_PRIMING + sum(count(m) for m in req.messages)
    assert await count_prompt(req.messages, "sim-model", None) == expected


async def test_fitting_returns_a_new_request_and_leaves_the_given_one_alone() -> None:
    history = [Message(role="user", content="word " * 200) for _ in range(6)]
    req = InferenceRequest(
        request_id="r",
        model="sim-model",
        messages=[*history, Message(role="user", content="and?")],
        deadline=1e9,
        max_tokens=10,
    )
    before = list(req.messages)
    fitted = await fit_request(req, 500, None)
    assert fitted is not req
    assert fitted.trimmed > 0
    assert fitted.prompt_tokens is not None
    assert fitted.prompt_tokens + 10 <= 500
    assert fitted.messages[-1].content == "and?"
    assert (req.messages, req.trimmed, req.prompt_tokens) == (before, 0, None)
