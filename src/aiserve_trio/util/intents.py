"""Intent labels from a model (pure): the prompt, reading the answer, the simulated answer.

A chain's ``classify`` step asks a model which of a few labels a customer's
message is about: a system message made from a template with the labels in it
(:data:`DEFAULT_PROMPT`; its ``Labels:`` line lists them) and the message. What
comes back is read by :func:`parse_label`, which is forgiving about how a model
answers (``Mortgage.``, ``"mortgage"``, ``Label: mortgage``, ``{"label":
"mortgage"}``, a sentence naming one label) and returns None when no listed
label can be read out of it.

The ``mock`` model and ``aiserve-sim`` answer such a prompt the same
deterministic way (:func:`simulated_label`): the listed label that the last
user message names first -- a word that begins with the label, so ``mortgages``
names ``mortgage``; ``card_limit`` is named by ``card limit`` -- else
``unknown``. Like ``util/vectors.py``, imported by both.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

#: The classify step's default system prompt; ``{labels}`` becomes ``a, b, c``.
DEFAULT_PROMPT = (
    "Classify the intent of the customer's message.\n"
    "Labels: {labels}\n"
    "Answer with exactly one of the labels and nothing else."
)
#: What the simulated classifiers answer when the message names no label.
UNKNOWN = "unknown"
_LABELS_LINE = re.compile(r"^Labels: *(.+?) *$", re.M)
_TRIM = " \t\r\n\"'`*._-:;,!?()[]{}<>"
_PREFIX = re.compile(r"^(?:label|intent|category|answer)\s*[:=-]\s*", re.I)


def prompt(template: str, labels: Sequence[str]) -> str:
    """The system prompt: ``template`` with ``{labels}`` replaced by the labels, comma-separated."""
    return template.replace("{labels}", ", ".join(labels))


def _word(label: str) -> re.Pattern[str]:
    """A label as the start of a word (``_`` matching a space, ``-`` or ``_``)."""
    parts = [re.escape(p) for p in label.split("_")]
    return re.compile(r"(?<!\w)" + r"[\s_-]+".join(parts), re.I)


def _first_named(text: str, labels: Sequence[str]) -> str | None:
    """The label named earliest in ``text`` (the longer one when two start together)."""
    best: tuple[int, int, str] | None = None
    for label in labels:
        m = _word(label).search(text)
        if m is not None:
            key = (m.start(), -len(label), label)
            if best is None or key < best:
                best = key
    return best[2] if best is not None else None


def parse_label(answer: str, labels: Sequence[str]) -> str | None:
    """The label a model's ``answer`` gives, or None when it gives none of ``labels``.

    Tried in order: JSON with a ``label`` (or ``intent``) string; the answer
    itself, trimmed of quotes, punctuation and a ``Label:`` prefix, equal to a
    label (case, spaces and hyphens aside); the label it names first.
    """
    text = answer.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if isinstance(value, dict):
            for key in ("label", "intent"):
                if isinstance(value.get(key), str):
                    text = value[key]
                    break
    bare = _PREFIX.sub("", text.strip(_TRIM)).strip(_TRIM).lower()
    bare = re.sub(r"[\s-]+", "_", bare)
    for label in labels:
        if bare == label.lower():
            return label
    return _first_named(text, labels)


def labels_in(system: str) -> list[str] | None:
    """The labels of a classify prompt (its ``Labels:`` line), or None if it has none."""
    m = _LABELS_LINE.search(system)
    if m is None:
        return None
    labels = [x.strip() for x in m.group(1).split(",") if x.strip()]
    return labels or None


def simulated_label(system: str, user: str) -> str | None:
    """What the mock and ``aiserve-sim`` answer to a classify prompt (module docstring).

    Args:
        system: the request's system text; without a ``Labels:`` line this is
            not a classify prompt, and the answer is None.
        user: the last user message.
    """
    labels = labels_in(system)
    if labels is None:
        return None
    return _first_named(user, labels) or UNKNOWN
