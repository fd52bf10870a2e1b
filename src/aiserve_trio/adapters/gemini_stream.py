"""Decoding Gemini's ``streamGenerateContent?alt=sse`` stream (sans-IO): bytes in, deltas out.

Each event's ``data`` is a whole ``GenerateContentResponse``:
``candidates[0].content.parts`` -- ``text`` (``thought: true``: reasoning) or a
``functionCall`` (``name``, ``args``: whole, never in pieces) --,
``candidates[0].finishReason`` and ``usageMetadata`` (``promptTokenCount``,
``candidatesTokenCount``, ``thoughtsTokenCount``, ``cachedContentTokenCount``: the
part of the prompt, counted in ``promptTokenCount``, read from a cache). The
stream has no end marker:
it is finished when a finish reason came and the body ended.

A function call becomes one tool-call delta carrying its id (Gemini's ``id`` if it
gives one, else one made from the request's), name and whole arguments; calls are
numbered in order. ``finishReason`` ``STOP`` with calls is ``tool_calls``;
``MAX_TOKENS`` is ``length``; the safety family is ``content_filter``. A prompt
blocked outright (``promptFeedback.blockReason``, no candidates) is the client's
400 ``content_filter``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..core.errors import BadRequest, UpstreamProtocolError
from .base import Delta, ToolCallDelta, Usage
from .pieces import EventReader, Pieces
from .sse_parser import Event

#: Gemini's finish reasons -> OpenAI's (anything else: ``stop``).
FINISH_REASONS = {
    "STOP": "stop",
    "MAX_TOKENS": "length",
    "SAFETY": "content_filter",
    "RECITATION": "content_filter",
    "BLOCKLIST": "content_filter",
    "PROHIBITED_CONTENT": "content_filter",
    "SPII": "content_filter",
    "IMAGE_SAFETY": "content_filter",
}
_enc = msgspec.json.Encoder()


class _Call(msgspec.Struct):
    name: str = ""
    args: dict[str, Any] | None = None
    id: str | None = None


class _Part(msgspec.Struct):
    text: str | None = None
    thought: bool = False
    functionCall: _Call | None = None


class _Content(msgspec.Struct):
    parts: list[_Part] = msgspec.field(default_factory=list)


class _Candidate(msgspec.Struct):
    content: _Content | None = None
    finishReason: str | None = None


class _UsageMeta(msgspec.Struct):
    promptTokenCount: int = 0
    candidatesTokenCount: int = 0
    thoughtsTokenCount: int = 0
    cachedContentTokenCount: int = 0


class _Feedback(msgspec.Struct):
    blockReason: str | None = None


class _Response(msgspec.Struct):
    candidates: list[_Candidate] = msgspec.field(default_factory=list)
    usageMetadata: _UsageMeta | None = None
    promptFeedback: _Feedback | None = None


_response = msgspec.json.Decoder(_Response)


class GeminiStreamDecoder(EventReader):
    """One reply's stream, decoded read by read (used as ``chat_stream.ChatStreamDecoder``)."""

    __slots__ = ("call_prefix", "calls", "finish", "pieces", "usage")

    def __init__(self, name: str, call_prefix: str) -> None:
        """Args:
        name: the adapter's, for errors.
        call_prefix: tool call ids are this and the call's number when Gemini gives none.
        """
        super().__init__(name)
        self.call_prefix = call_prefix
        self.calls = 0
        self.finish: str | None = None
        self.usage: _UsageMeta | None = None
        self.pieces = 0

    def end(self) -> Delta:
        """The final delta, once the body has ended.

        Raises:
            UpstreamProtocolError: the stream broke, or ended without a finish reason.
        """
        self.check()
        if self.finish is None:
            raise UpstreamProtocolError(
                f"{self.name}: the model backend ended the stream without a finish reason"
            )
        reason = FINISH_REASONS.get(self.finish, "stop")
        if reason == "stop" and self.calls:
            reason = "tool_calls"
        u = self.usage or _UsageMeta()
        completion = u.candidatesTokenCount + u.thoughtsTokenCount
        usage = Usage(
            prompt_tokens=u.promptTokenCount,
            completion_tokens=completion or self.pieces,
            cache_read_tokens=max(0, u.cachedContentTokenCount),
        )
        return Delta(finish_reason=reason, usage=usage)

    def _read(self, event: Event, pieces: Pieces, out: list[Delta]) -> None:
        """One event: a whole response (the client's error when the prompt was blocked)."""
        r = _response.decode(event.data)
        if r.usageMetadata is not None:
            self.usage = r.usageMetadata
        if not r.candidates and r.promptFeedback is not None and r.promptFeedback.blockReason:
            raise BadRequest(
                f"{self.name}: Gemini blocked the prompt ({r.promptFeedback.blockReason})",
                param="messages",
                code="content_filter",
            )
        for cand in r.candidates[:1]:
            for part in cand.content.parts if cand.content is not None else ():
                call = part.functionCall
                if call is not None:
                    pieces.flush(out)
                    index = self.calls
                    self.calls += 1
                    tool = ToolCallDelta(
                        index=index,
                        id=call.id or f"{self.call_prefix}{index}",
                        type="function",
                        name=call.name,
                        arguments=_enc.encode(call.args or {}).decode(),
                    )
                    out.append(Delta(tool_calls=[tool]))
                elif part.text:
                    self.pieces += 1
                    pieces.add(part.text, reasoning=part.thought)
            if cand.finishReason:
                self.finish = cand.finishReason
