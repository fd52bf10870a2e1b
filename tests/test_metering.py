"""What a request is billed for (``stages/metering.py``), case by case and with no request
running: the provider's usage when it can be believed, the gateway's own count where it
cannot -- none came, a figure is negative, or more completion tokens than the text it
sent can hold. ``test_billing*.py`` check the same figure end to end."""

from __future__ import annotations

import msgspec
import pytest

from aiserve_trio.adapters.base import Usage
from aiserve_trio.stages.metering import (
    BYTES_PER_CHAR,
    SLACK,
    hidden_reasoning,
    needs_prompt_count,
    settle,
)


def details(reasoning: int) -> msgspec.Raw:
    return msgspec.Raw(msgspec.json.encode({"reasoning_tokens": reasoning}))


def test_no_usage_is_billed_as_counted() -> None:
    s = settle(None, generated=12, generated_chars=40, prompt=30)
    assert (s.usage.prompt_tokens, s.usage.completion_tokens) == (30, 12)
    assert (s.source, s.distrusted) == ("counted", None)
    assert needs_prompt_count(None)


def test_a_believable_usage_is_the_providers_unchanged() -> None:
    usage = Usage(prompt_tokens=100, completion_tokens=10, cache_read_tokens=40)
    s = settle(usage, generated=11, generated_chars=35, prompt=None)
    assert s.usage is usage
    assert (s.source, s.distrusted) == ("provider", None)
    assert not needs_prompt_count(usage)


def test_a_negative_prompt_count_is_replaced_by_the_local_one() -> None:
    usage = Usage(prompt_tokens=-5, completion_tokens=10)
    assert needs_prompt_count(usage)
    s = settle(usage, generated=10, generated_chars=35, prompt=77)
    assert (s.usage.prompt_tokens, s.usage.completion_tokens) == (77, 10)
    assert (s.source, s.distrusted) == ("counted", "negative")


def test_negative_cache_counts_are_no_discount() -> None:
    usage = Usage(
        prompt_tokens=50, completion_tokens=5, cache_read_tokens=-3, cache_write_tokens=-1
    )
    s = settle(usage, generated=5, generated_chars=20, prompt=None)
    assert (s.usage.cache_read_tokens, s.usage.cache_write_tokens) == (0, 0)
    assert s.usage.prompt_tokens == 50
    assert s.distrusted == "negative"


@pytest.mark.parametrize(
    ("completion", "reasoning", "believed"),
    [
        (BYTES_PER_CHAR * 100 + SLACK, 0, True),  # as much as 100 characters can hold
        (BYTES_PER_CHAR * 100 + SLACK + 1, 0, False),  # one more: impossible
        (BYTES_PER_CHAR * 100 + SLACK + 500, 500, True),  # hidden reasoning it says it kept
        (BYTES_PER_CHAR * 100 + SLACK + 501, 500, False),
    ],
)
def test_more_completion_than_the_text_can_hold_is_the_local_count(
    completion: int, reasoning: int, believed: bool
) -> None:
    usage = Usage(
        prompt_tokens=20, completion_tokens=completion, completion_details=details(reasoning)
    )
    s = settle(usage, generated=90, generated_chars=100, prompt=None)
    if believed:
        assert (s.usage, s.source) == (usage, "provider")
    else:
        assert (s.usage.completion_tokens, s.usage.completion_details) == (90, None)
        assert (s.usage.prompt_tokens, s.source, s.distrusted) == (20, "counted", "absurd")


def test_a_negative_completion_is_the_generated_count() -> None:
    s = settle(
        Usage(prompt_tokens=5, completion_tokens=-1), generated=7, generated_chars=9, prompt=None
    )
    assert (s.usage.completion_tokens, s.distrusted) == (7, "negative")


@pytest.mark.parametrize(
    ("raw", "tokens"),
    [(None, 0), (b'{"reasoning_tokens": 12}', 12), (b'{"reasoning_tokens": -4}', 0), (b"[", 0)],
)
def test_hidden_reasoning_reads_only_a_sane_count(raw: bytes | None, tokens: int) -> None:
    d = None if raw is None else msgspec.Raw(raw)
    assert (
        hidden_reasoning(Usage(prompt_tokens=0, completion_tokens=0, completion_details=d))
        == tokens
    )
