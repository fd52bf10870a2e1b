"""Decoding Bedrock's ``converse-stream`` events (sans-IO): bytes in, deltas out.

The body is an AWS event stream (``eventstream.py``, CRCs checked). A message whose
``:message-type`` is ``event`` carries, by ``:event-type``, a JSON payload:

=====================  ===========================================================
``messageStart``       ``role``
``contentBlockStart``  ``start.toolUse`` (``toolUseId``, ``name``): a tool call's
                       first fragment
``contentBlockDelta``  ``delta.text``, ``delta.reasoningContent.text`` (reasoning),
                       ``delta.toolUse.input`` (the arguments, in pieces)
``contentBlockStop``   the block ends
``messageStop``        ``stopReason``
``metadata``           ``usage`` (``inputTokens``: the prompt's uncached part,
                       ``cacheReadInputTokens``, ``cacheWriteInputTokens``,
                       ``outputTokens``): the last event
=====================  ===========================================================

``:message-type`` ``exception`` is an error mid-stream, named by
``:exception-type``: throttling is a 429, ``serviceUnavailableException`` a 503 and
``internalServerException`` a 500 (retried if nothing reached the client yet); a
``validationException`` is the client's 400; anything else a protocol error.
"""

from __future__ import annotations

import msgspec

from ..core.errors import BadRequest, GatewayError, UpstreamProtocolError, UpstreamStatusError
from .base import Delta, ToolCallDelta, Usage
from .eventstream import EventStreamDecoder, EventStreamError, Message
from .pieces import EventReader, Pieces

#: Bedrock's stop reasons -> OpenAI's.
STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "guardrail_intervened": "content_filter",
    "content_filtered": "content_filter",
}
#: Exceptions in the stream that are a status's worth.
EXCEPTIONS = {
    "throttlingException": 429,
    "serviceUnavailableException": 503,
    "internalServerException": 500,
    "modelNotReadyException": 503,
}


class _ToolStart(msgspec.Struct):
    toolUseId: str = ""
    name: str = ""


class _Start(msgspec.Struct):
    toolUse: _ToolStart | None = None


class _Reasoning(msgspec.Struct):
    text: str | None = None


class _ToolInput(msgspec.Struct):
    input: str = ""


class _Delta(msgspec.Struct):
    text: str | None = None
    reasoningContent: _Reasoning | None = None
    toolUse: _ToolInput | None = None


class _Usage(msgspec.Struct):
    inputTokens: int = 0
    outputTokens: int = 0
    cacheReadInputTokens: int = 0
    cacheWriteInputTokens: int = 0


class _Event(msgspec.Struct):
    contentBlockIndex: int = 0
    start: _Start | None = None
    delta: _Delta | None = None
    stopReason: str | None = None
    usage: _Usage | None = None
    message: str | None = None


_event = msgspec.json.Decoder(_Event)


class BedrockStreamDecoder(EventReader):
    """One reply's event stream, decoded read by read (used as ``ChatStreamDecoder``)."""

    __slots__ = ("_calls", "_frames", "pieces", "stop_reason", "usage")

    _unreadable = (EventStreamError, msgspec.DecodeError)

    def __init__(self, name: str) -> None:
        self._frames = EventStreamDecoder()
        super().__init__(name, self._frames)
        #: Content block index -> tool call index.
        self._calls: dict[int, int] = {}
        self.stop_reason: str | None = None
        self.usage: _Usage | None = None
        self.pieces = 0

    def _read(self, message: Message, pieces: Pieces, out: list[Delta]) -> None:
        """One message: an event, or an exception the stream reports."""
        kind = message.text(":message-type")
        if kind == "exception" or kind == "error":
            raise self._exception(message.text(":exception-type"), message.payload)
        if kind != "event":
            return
        call = self._on(message.text(":event-type"), _event.decode(message.payload), pieces)
        if call is not None:
            pieces.flush(out)
            out.append(Delta(tool_calls=[call]))

    def end(self) -> Delta:
        """The final delta, once the body has ended.

        Raises:
            UpstreamProtocolError: the stream broke, or ended before ``messageStop``
                or inside a message.
        """
        self.check()
        if self.stop_reason is None or self._frames.pending:
            raise UpstreamProtocolError(
                f"{self.name}: the model backend ended the stream before messageStop"
            )
        u = self.usage
        if u is None:
            usage = Usage(prompt_tokens=0, completion_tokens=self.pieces)
        else:
            # inputTokens leaves out the cache's reads and writes (as Anthropic's does).
            read, write = max(0, u.cacheReadInputTokens), max(0, u.cacheWriteInputTokens)
            usage = Usage(
                prompt_tokens=u.inputTokens + read + write,
                completion_tokens=u.outputTokens,
                cache_read_tokens=read,
                cache_write_tokens=write,
            )
        return Delta(finish_reason=STOP_REASONS.get(self.stop_reason, "stop"), usage=usage)

    def _exception(self, kind: str, payload: bytes) -> GatewayError:
        try:
            message = _event.decode(payload).message or ""
        except msgspec.DecodeError:
            message = payload[:300].decode("utf-8", "replace")
        said = f"{self.name}: Bedrock reported {kind} mid-stream: {message[:300]}"
        if kind == "validationException":
            return BadRequest(said)
        status = EXCEPTIONS.get(kind)
        if status is not None:
            return UpstreamStatusError(said, upstream_status=status)
        return UpstreamProtocolError(said)

    def _on(self, kind: str, ev: _Event, pieces: Pieces) -> ToolCallDelta | None:
        if kind == "contentBlockDelta" and ev.delta is not None:
            d = ev.delta
            if d.text:
                self.pieces += 1
                pieces.add(d.text)
            elif d.reasoningContent is not None and d.reasoningContent.text:
                self.pieces += 1
                pieces.add(d.reasoningContent.text, reasoning=True)
            elif d.toolUse is not None and d.toolUse.input:
                index = self._calls.get(ev.contentBlockIndex)
                if index is None:
                    raise UpstreamProtocolError(
                        f"{self.name}: the model backend sent tool input outside a toolUse block"
                    )
                return ToolCallDelta(index=index, arguments=d.toolUse.input)
        elif kind == "contentBlockStart" and ev.start is not None and ev.start.toolUse is not None:
            tool = ev.start.toolUse
            index = self._calls[ev.contentBlockIndex] = len(self._calls)
            return ToolCallDelta(index=index, id=tool.toolUseId, type="function", name=tool.name)
        elif kind == "messageStop":
            self.stop_reason = ev.stopReason or "end_turn"
        elif kind == "metadata":
            self.usage = ev.usage
        return None
