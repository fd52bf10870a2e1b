"""The ``mock`` adapter: the embedded default model, a small rule engine.

Rules (TOML, ``[[adapters.NAME.rules]]``) pair a regular expression searched in
the last user message with a templated reply; the first match wins, else the
default reply. ``{name}`` in a reply is a named group of the pattern or a
session variable, ``{name|fallback}`` gives the text to use when neither is
known. One rule is fixed and comes first: a last user message starting with
``echo:`` is streamed back verbatim (the text after the prefix), the way to try
policies by hand.

Replies stream as word-sized deltas after ``ttft_ms``, one every
``inter_token_ms``. Token counts in ``usage`` are word-piece counts (words and
punctuation marks), not a model tokenizer's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import trio

from ..config import MockAdapterConfig
from ..observability.events import NULL_HOOK, UpstreamHook
from .base import Adapter, Delta, DeltaSink, InferenceRequest, Message, Usage
from .retry import Progress

ECHO_PREFIX = "echo:"
_WORDS_RE = re.compile(r"\s*\S+|\s+$")
_PIECES_RE = re.compile(r"\w+|[^\w\s]")
_TEMPLATE_RE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?:\|([^{}]*))?\}")


def count_tokens(text: str) -> int:
    """An approximate token count: words and punctuation marks."""
    return len(_PIECES_RE.findall(text))


def split_words(text: str) -> list[str]:
    """Word-sized pieces that concatenate back to ``text`` exactly."""
    return _WORDS_RE.findall(text)


def fill_template(template: str, values: dict[str, str]) -> str:
    """Replace ``{name}`` / ``{name|fallback}`` from ``values``; unknown names keep their text."""

    def sub(m: re.Match[str]) -> str:
        name, fallback = m.group(1), m.group(2)
        if name in values:
            return values[name]
        return fallback if fallback is not None else m.group(0)

    return _TEMPLATE_RE.sub(sub, template)


@dataclass(frozen=True, slots=True)
class _Rule:
    pattern: re.Pattern[str]
    reply: str


class RuleEngine:
    """Pure reply selection: last user message + variables -> reply text."""

    def __init__(self, config: MockAdapterConfig) -> None:
        self._rules = [
            _Rule(re.compile(r.pattern, re.IGNORECASE | re.DOTALL), r.reply) for r in config.rules
        ]
        self._default = config.default_reply

    def reply(self, messages: list[Message], variables: dict[str, str]) -> str:
        last = next((m.content for m in reversed(messages) if m.role == "user"), "")
        if last.startswith(ECHO_PREFIX):
            return last[len(ECHO_PREFIX) :].lstrip(" ")
        for rule in self._rules:
            m = rule.pattern.search(last)
            if m:
                values = dict(variables)
                values.update({k: v for k, v in m.groupdict().items() if v is not None})
                return fill_template(rule.reply, values)
        return fill_template(self._default, dict(variables))


class MockAdapter(Adapter):
    """Streams the rule engine's reply with configurable pacing."""

    def __init__(
        self, name: str, config: MockAdapterConfig, *, hook: UpstreamHook = NULL_HOOK
    ) -> None:
        """Build the adapter (no retries: there is nothing to recover from).

        Args:
            name: the ``[adapters.NAME]`` key.
            config: its rules and pacing.
            hook: told of each try and of an error that ends a call.
        """
        super().__init__(name, config.models, hook=hook)
        self.config = config
        self.engine = RuleEngine(config)

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        """Send the rule engine's reply word by word, after ``ttft_ms``."""
        reply = self.engine.reply(request.messages, request.variables)
        words = split_words(reply)
        finish = "stop"
        if request.max_tokens is not None and len(words) > request.max_tokens:
            words, finish = words[: request.max_tokens], "length"
        prompt_tokens = sum(count_tokens(m.content) for m in request.messages)
        ttft = self.config.ttft_ms / 1000.0
        gap = self.config.inter_token_ms / 1000.0
        if ttft:
            await trio.sleep(ttft)
        for i, word in enumerate(words):
            if i and gap:
                await trio.sleep(gap)
            await send.send(Delta(text=word))
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=count_tokens("".join(words)))
        await send.send(Delta(finish_reason=finish, usage=usage))
