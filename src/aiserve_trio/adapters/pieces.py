"""The text and reasoning of one upstream read, joined into one delta (pure).

What arrived together is written together: one channel hop and one client write per
read instead of per token (``chat_stream.py`` does the same for OpenAI's stream). A
tool-call fragment does not join: what came before it goes first, in order.
"""

from __future__ import annotations

from ..errors import UpstreamProtocolError
from .base import Delta

__all__ = ["Pieces", "malformed"]


def malformed(name: str, exc: Exception) -> UpstreamProtocolError:
    """The error a decoder keeps for bytes it cannot read (``exc`` as its cause)."""
    broken = UpstreamProtocolError(f"{name}: the model backend sent a malformed event")
    broken.__cause__ = exc  # as `raise ... from exc` would, when check() raises it
    return broken


class Pieces:
    """Text and reasoning pieces of one read, until :meth:`flush` makes them a delta."""

    __slots__ = ("text", "thought")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.thought: list[str] = []

    def add(self, text: str, *, reasoning: bool = False) -> None:
        (self.thought if reasoning else self.text).append(text)

    def flush(self, out: list[Delta]) -> None:
        """Append the pieces so far to ``out`` as one delta (nothing if there are none)."""
        if self.text or self.thought:
            out.append(
                Delta(
                    text="".join(self.text),
                    reasoning="".join(self.thought),
                    tokens=len(self.text) + len(self.thought),
                )
            )
            self.text = []
            self.thought = []
