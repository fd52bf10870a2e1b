"""What a request consumed, whatever ended it (pure: no I/O).

A request is billed from a :class:`~aiserve_trio.adapters.base.Usage`: the provider's,
when its reply ended with one the gateway can believe, else the gateway's own count
(``usage_source = "counted"``):

- completion tokens: what the backend generated so far, as the response assembler
  counted it (its upstream events, about one token each: the count the token cap
  uses) -- or, where more, its delivered text's tokens as the gateway's tokenizer
  counts them (``billing.local_completion``: Anthropic, Gemini and Bedrock send
  several tokens an event) -- whether the reply finished or not;
- prompt tokens: the local count of the prompt the backend was sent (the gateway's
  tokenizer, ``adapters/tokens.py`` ``count_prompt``).

The provider's count is distrusted -- and the local count used for the part that is
wrong -- when a figure is negative, or when it reports more completion tokens than the
text it sent can hold: a token of these byte-level encodings stands for at least one
byte of UTF-8, at most four per character, so more than ``4 x characters`` (plus the
reasoning the provider says it kept hidden, and :data:`SLACK`) is impossible.

A request whose backend never answered (no piece of a reply arrived) consumed nothing
billable here: :func:`settle` is not asked.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from ..adapters.base import Usage

Source = Literal["provider", "counted"]
#: Tokens of completion a provider may report past what its text holds (framing,
#: a redacted thinking block's few tokens) before its count is called absurd.
SLACK = 64
#: UTF-8 bytes per character at most: a token is at least one byte.
BYTES_PER_CHAR = 4


class _Details(msgspec.Struct):
    reasoning_tokens: int = 0


_details = msgspec.json.Decoder(_Details)


def hidden_reasoning(usage: Usage) -> int:
    """The reasoning tokens ``usage`` says the provider generated (0 when it does not
    say, or says something unreadable or negative)."""
    raw = usage.completion_details
    if raw is None:
        return 0
    try:
        return max(0, _details.decode(raw).reasoning_tokens)
    except msgspec.DecodeError:
        return 0


def needs_prompt_count(usage: Usage | None) -> bool:
    """Whether billing ``usage`` needs the prompt counted locally (none came, or its
    prompt count is negative)."""
    return usage is None or usage.prompt_tokens < 0


class Settled(msgspec.Struct, frozen=True):
    """The usage a request is billed for, where it came from, and why the provider's
    count was not believed (None when it was, or when none came)."""

    usage: Usage
    source: Source
    distrusted: str | None = None


def settle(
    usage: Usage | None, *, generated: int, generated_chars: int, prompt: int | None
) -> Settled:
    """The usage to bill (see the module docstring).

    Args:
        usage: what the provider reported, if anything.
        generated: upstream tokens the assembler was given (counted locally).
        generated_chars: characters of text, reasoning, refusal and tool-call
            arguments those tokens carried.
        prompt: the prompt's local count, when :func:`needs_prompt_count` asked for it
            (None: not counted; then a missing prompt count is 0).
    """
    local_prompt = max(0, prompt or 0)
    generated = max(0, generated)
    if usage is None:
        return Settled(
            Usage(prompt_tokens=local_prompt, completion_tokens=generated), "counted", None
        )
    why: str | None = None
    fixed: dict[str, object] = {}
    if usage.prompt_tokens < 0:
        why = "negative"
        fixed["prompt_tokens"] = local_prompt
    if usage.cache_read_tokens < 0 or usage.cache_write_tokens < 0:
        why = "negative"
        fixed["cache_read_tokens"] = max(0, usage.cache_read_tokens)
        fixed["cache_write_tokens"] = max(0, usage.cache_write_tokens)
    completion = usage.completion_tokens
    if completion < 0:
        why = "negative"
        fixed["completion_tokens"] = generated
        fixed["completion_details"] = None
    elif completion - min(hidden_reasoning(usage), completion) > (
        BYTES_PER_CHAR * max(0, generated_chars) + SLACK
    ):
        why = why or "absurd"
        fixed["completion_tokens"] = generated
        fixed["completion_details"] = None
    if why is None:
        return Settled(usage, "provider", None)
    return Settled(msgspec.structs.replace(usage, **fixed), "counted", why)
