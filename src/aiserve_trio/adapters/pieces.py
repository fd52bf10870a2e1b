"""The text and reasoning of one upstream read, joined into one delta (pure).

What arrived together is written together: one channel hop and one client write per
read instead of per token (``chat_stream.py`` does the same for OpenAI's stream). A
tool-call fragment does not join: what came before it goes first, in order.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import Any, ClassVar, Protocol

import msgspec

from ..core.api import NativeEvents
from ..core.errors import GatewayError, UpstreamProtocolError
from .base import Delta
from .sse_parser import Event, SSEDecodeError, SSEParser

__all__ = ["EventReader", "NativeText", "Pieces", "encoded", "malformed", "one_event"]


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


def encoded(event: Event) -> bytes:
    """An event as the provider sent it (its ``event:`` and ``data:`` lines)."""
    return b"event: %s\ndata: %s\n\n" % (event.event.encode(), event.data.encode())


class NativeText:
    """A native stream's consecutive text events of one block and kind (``at``: the
    block's index and the event's kind), joined into one delta with their bytes."""

    __slots__ = ("at", "pieces", "raw")

    def __init__(self) -> None:
        self.at: tuple[int, str] = (-1, "")
        self.raw: list[bytes] = []
        #: Where the decoder puts the events' text.
        self.pieces = Pieces()

    def add(self, at: tuple[int, str], raw: bytes, out: list[Delta]) -> Pieces:
        """Take one text event's bytes (another block's first sends what came before)."""
        if self.raw and at != self.at:
            self.flush(out)
        self.at = at
        self.raw.append(raw)
        return self.pieces

    def flush(self, out: list[Delta]) -> None:
        """Append the events so far as one delta carrying their bytes (none if none)."""
        if not self.raw:
            return
        joined: list[Delta] = []
        self.pieces.flush(joined)
        index, kind = self.at
        events = NativeEvents(raw=b"".join(self.raw), kind=kind, index=index)
        d = joined[0] if joined else Delta(tokens=0)
        out.append(msgspec.structs.replace(d, native=events))
        self.raw = []


def one_event(delta: Delta | None, raw: bytes, kind: str, index: int) -> Delta:
    """A native stream's event that is not joined: ``delta`` (what it holds, if anything)
    carrying its bytes; a boundary when it holds nothing (held-back text goes first)."""
    d = delta if delta is not None else Delta(tokens=0)
    holds = bool(d.text or d.reasoning or d.refusal or d.tool_calls)
    events = NativeEvents(raw=raw, kind=kind, index=index, boundary=not holds)
    return msgspec.structs.replace(d, native=events)


class Held(Protocol):
    """What a decoder joins across the events of one read (:class:`Pieces`, :class:`NativeText`)."""

    def flush(self, out: list[Delta]) -> None: ...


class Framing(Protocol):
    """How a provider's stream is cut into events (:class:`SSEParser`, or AWS's
    ``eventstream.EventStreamDecoder``): bytes in, the events they complete out."""

    def feed(self, data: bytes) -> Iterable[Any]: ...


class EventReader(abc.ABC):
    """A provider's event stream read read by read (the base of the stream decoders):
    :meth:`feed` hands each event of a read to :meth:`_read`, and keeps a malformed event
    or a failure the stream reports for the next :meth:`check`, after what came before it.

    The events are server-sent events unless a subclass hands in another framing (and
    names what it raises on bytes it cannot read, ``_unreadable``)."""

    __slots__ = ("_error", "_parser", "done", "name")

    _unreadable: ClassVar[tuple[type[Exception], ...]] = (SSEDecodeError, msgspec.DecodeError)

    def __init__(self, name: str, framing: Framing | None = None) -> None:
        self.name = name
        self._parser: Framing = SSEParser() if framing is None else framing
        self._error: GatewayError | None = None
        #: The stream's end came: nothing after it counts.
        self.done = False

    def feed(self, data: bytes) -> list[Delta]:
        """The deltas one read completes.

        Raises:
            GatewayError: an earlier read broke the stream.
        """
        self.check()
        out: list[Delta] = []
        if self.done:
            return out
        held = self._held()
        try:
            for event in self._parser.feed(data):
                self._read(event, held, out)
                if self.done:
                    break
        except GatewayError as reported:
            self._error = reported
        except self._unreadable as exc:
            self._error = malformed(self.name, exc)
        held.flush(out)
        return out

    def check(self) -> None:
        """Raises: GatewayError: what broke the stream (a malformed event, or an error it
        reported mid-stream)."""
        if self._error is not None:
            raise self._error

    def _held(self) -> Held:
        """A fresh joiner for one read's events."""
        return Pieces()

    @abc.abstractmethod
    def _read(self, event: Any, held: Any, out: list[Delta]) -> None:
        """One event: its text into ``held``, or a delta of its own into ``out`` (what
        ``held`` holds goes first)."""
