"""Label rules: pure functions from a recorded body to its labels.

A body is the recorded request body decoded from JSON (``{"model": ...,
"messages": [...], ...}``), the same value a recording holds, so a recording can
be labelled again with other rules. :class:`LabelRules` compiles the
``[record]`` rules once; :meth:`LabelRules.labels` applies them (see
``settings.py`` for what a rule means).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .settings import LABEL_VALUE_RE, LabelRule


def message_text(message: Any) -> str:
    """A message's text: its content string, or its text parts joined."""
    if not isinstance(message, Mapping):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"]
            for p in content
            if isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
        )
    return ""


def _messages(body: Mapping[str, Any]) -> list[Any]:
    messages = body.get("messages")
    return messages if isinstance(messages, list) else []


def last_user_text(body: Mapping[str, Any]) -> str:
    """The text of the body's last ``user`` message ("" when there is none)."""
    for message in reversed(_messages(body)):
        if isinstance(message, Mapping) and message.get("role") == "user":
            return message_text(message)
    return ""


def messages_chars(body: Mapping[str, Any]) -> int:
    """Characters of text over every message of the body."""
    return sum(len(message_text(m)) for m in _messages(body))


@dataclass(frozen=True, slots=True)
class _Compiled:
    label: str
    value: str
    #: Each must be found (keywords, regex).
    patterns: tuple[re.Pattern[str], ...]
    every_message: bool
    chars_above: int | None
    fields: tuple[str, ...]

    def holds(self, body: Mapping[str, Any]) -> bool:
        if self.fields and not any(f in body for f in self.fields):
            return False
        if self.chars_above is not None and messages_chars(body) <= self.chars_above:
            return False
        if not self.patterns:
            return True
        if self.every_message:
            texts = [message_text(m) for m in _messages(body)]
            return all(any(p.search(t) for t in texts) for p in self.patterns)
        text = last_user_text(body)
        return all(p.search(text) for p in self.patterns)


def _compile(rule: LabelRule) -> _Compiled:
    sources = []
    if rule.keywords:
        words = "|".join(re.escape(w) for w in rule.keywords)
        # Whole words: "JOINED" is not the keyword JOIN.
        sources.append(rf"(?<!\w)(?:{words})(?!\w)")
    if rule.regex is not None:
        sources.append(rule.regex)
    flags = re.IGNORECASE if rule.ignore_case else 0
    return _Compiled(
        label=rule.label,
        value=rule.value,
        patterns=tuple(re.compile(s, flags) for s in sources),
        every_message=rule.scope == "messages",
        chars_above=rule.chars_above,
        fields=tuple(rule.fields),
    )


class LabelRules:
    """The ``[record]`` label rules, compiled once."""

    def __init__(self, rules: Sequence[LabelRule], metadata_keys: Sequence[str] = ()) -> None:
        self._rules = [_compile(r) for r in rules]
        self._metadata_keys = tuple(metadata_keys)

    def labels(self, body: Mapping[str, Any]) -> dict[str, str]:
        """The labels of ``body``: the rules' (first rule per label wins), then metadata's."""
        out: dict[str, str] = {}
        for rule in self._rules:
            if rule.label not in out and rule.holds(body):
                out[rule.label] = rule.value
        metadata = body.get("metadata")
        if isinstance(metadata, Mapping):
            for key in self._metadata_keys:
                value = metadata.get(key)
                # A value the weights syntax could not name is no label; it is
                # the client's text, so it is not recorded as one either.
                if isinstance(value, str) and LABEL_VALUE_RE.match(value):
                    out[key] = value
        return out
