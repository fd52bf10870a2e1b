"""Upstream calls a group made for a request besides the one whose reply the client got.

The provider bills every call it was sent, so a request is billed for these too
(``stages/report.py``, ``outcome_of``): a hedge that lost the race, or a try the group
moved on from before its first token (``adapters/group.py``). Each is one
:class:`SideCall`, recorded as the try ends into the request's :class:`SideCalls` --
the pipeline sets one per request in :data:`SIDE_CALLS`, and the stage tasks (and the
group's tries under them) inherit it as they inherit the upstream-read counter: the
object is shared -- and settled with the rest of the request's bill once its stages
joined: the provider's usage where the call brought one, else its prompt counted
locally and the tokens that reached the gateway. Outside a request (a probe, a test
calling an adapter) nothing is recorded.

A chain's own earlier steps are carried differently, as values: its report
(``chains/plan.py``, ``ChainReport.calls``).
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from .base import Delta, InferenceRequest, Usage


class SideCall(msgspec.Struct, frozen=True, kw_only=True):
    """One extra upstream call of a request, as it ended."""

    #: The model it was asked for, by the name the gateway prices it under.
    model: str
    #: What it was sent (its prompt is counted from this when no usage came).
    request: InferenceRequest
    #: The adapter's ``tokenizer`` setting (None: by model family).
    tokenizer: str | None = None
    #: The provider's usage, when the call brought one.
    usage: Usage | None = None
    #: Upstream tokens (events) that reached the gateway, and their characters.
    generated: int = 0
    generated_chars: int = 0
    #: The text that came (counted with the tokenizer when no usage did).
    text: str = ""


class SideCalls:
    """The side calls of one request (mutable, shared by its stage tasks)."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls: list[SideCall] = []


SIDE_CALLS: ContextVar[SideCalls | None] = ContextVar("aiserve_side_calls", default=None)


def record(call: SideCall) -> None:
    """Record ``call`` for the current request (nothing outside one)."""
    calls = SIDE_CALLS.get()
    if calls is not None:
        calls.calls.append(call)


def chars_of(delta: Delta) -> int:
    """Characters of generated text a delta carries (text, reasoning, refusal, tool-call
    arguments): what a count of its tokens is checked against."""
    return (
        len(delta.text) + len(delta.reasoning) + len(delta.refusal)
        + sum(len(c.arguments or "") for c in delta.tool_calls or ())
    )  # fmt: skip


def tokenizer_of(adapter: object) -> str | None:
    """An adapter's ``tokenizer`` setting (None: by model family)."""
    name = getattr(getattr(adapter, "config", None), "tokenizer", None)
    return name if isinstance(name, str) else None
