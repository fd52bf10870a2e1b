"""Decoding Anthropic's Messages event stream (sans-IO): bytes in, deltas out.

The stream is Server-Sent Events whose ``data`` is one JSON object; its
``type`` says what it is:

=======================  ==========================================================
``message_start``        ``message.usage``: ``input_tokens`` (the prompt's uncached
                         part), ``cache_read_input_tokens``,
                         ``cache_creation_input_tokens`` (written to the cache)
``content_block_start``  a block opens at ``index``: ``text``, ``thinking``, or
                         ``tool_use`` (``id``, ``name``): a tool call's first fragment
``content_block_delta``  ``text_delta`` (``text``), ``thinking_delta`` (``thinking``:
                         reasoning), ``input_json_delta`` (``partial_json``: the
                         call's arguments, in pieces), ``signature_delta`` (ignored)
``content_block_stop``   the block ends (nothing to send)
``message_delta``        ``delta.stop_reason``, ``usage.output_tokens``
``message_stop``         the end: nothing after it counts
``ping``                 a keep-alive
``error``                the backend failed mid-stream (``error.type``, ``message``):
                         ``overloaded_error`` is a 529, ``rate_limit_error`` a 429
=======================  ==========================================================

Block indexes count every block; a tool call's ``index`` in the OpenAI sense
counts tool calls only, so the decoder numbers them as they open. The texts of
one read are joined into one delta, as ``chat_stream.py`` does. No I/O here.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..core.errors import UpstreamProtocolError, UpstreamStatusError
from .base import Delta, ToolCallDelta, Usage
from .pieces import EventReader, Pieces
from .sse_parser import Event

#: Anthropic's stop reasons -> OpenAI's finish reasons.
STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}


#: Error types in the stream that are a status's worth (retryable before the first token).
_STREAM_ERRORS = {"overloaded_error": 529, "rate_limit_error": 429, "api_error": 500}


class _Usage(msgspec.Struct):
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None


class _Message(msgspec.Struct):
    usage: _Usage | None = None


class _Block(msgspec.Struct):
    type: str = ""
    id: str | None = None
    name: str | None = None


class _BlockDelta(msgspec.Struct):
    type: str = ""
    text: str | None = None
    thinking: str | None = None
    partial_json: str | None = None
    stop_reason: str | None = None


class _Error(msgspec.Struct):
    type: str = ""
    message: str = ""


class _Event(msgspec.Struct):
    type: str
    index: int = 0
    message: _Message | None = None
    content_block: _Block | None = None
    delta: _BlockDelta | None = None
    usage: _Usage | None = None
    error: _Error | None = None


_event_decoder = msgspec.json.Decoder(_Event)


class AnthropicStreamDecoder(EventReader):
    """One reply's event stream, decoded read by read.

    Use as ``chat_stream.ChatStreamDecoder``: :meth:`feed` each read and send what
    it returns, then :meth:`check`; :meth:`end` once the body has ended.
    """

    __slots__ = (
        "_calls",
        "cache_read",
        "cache_write",
        "input_tokens",
        "output_tokens",
        "pieces",
        "stop_reason",
    )

    def __init__(self, name: str) -> None:
        super().__init__(name)
        #: Block index -> tool call index, for the ``tool_use`` blocks opened so far.
        self._calls: dict[int, int] = {}
        self.stop_reason: str | None = None
        self.input_tokens = 0
        #: Prompt tokens read from / written to Anthropic's prompt cache (not in
        #: ``input_tokens``, which counts the uncached rest).
        self.cache_read = 0
        self.cache_write = 0
        self.output_tokens: int | None = None
        self.pieces = 0

    def _read(self, event: Event, held: Any, out: list[Delta]) -> None:
        """One event (its text joined with the read's; a tool call's fragment alone).

        A malformed event, or an ``error`` event (overloaded, rate limited:
        ``UpstreamStatusError``), is raised by the next :meth:`check`, :meth:`feed` or
        :meth:`end`, after what came before it.
        """
        call = self._event(_event_decoder.decode(event.data), held)
        if call is not None:
            held.flush(out)
            out.append(Delta(tool_calls=[call]))

    def end(self) -> Delta:
        """The final delta: the finish reason and the usage Anthropic counted.

        Raises:
            UpstreamProtocolError: the stream broke, or ended before ``message_stop``.
        """
        self.check()
        if not self.done:
            raise UpstreamProtocolError(
                f"{self.name}: the model backend closed the stream before message_stop"
            )
        reason = STOP_REASONS.get(self.stop_reason or "end_turn", "stop")
        completion = self.output_tokens if self.output_tokens is not None else self.pieces
        usage = Usage(
            prompt_tokens=self.input_tokens + self.cache_read + self.cache_write,
            completion_tokens=completion,
            cache_read_tokens=self.cache_read,
            cache_write_tokens=self.cache_write,
        )
        return Delta(finish_reason=reason, usage=usage)

    def _event(self, ev: _Event, pieces: Pieces) -> ToolCallDelta | None:
        kind = ev.type
        if kind == "content_block_delta" and ev.delta is not None:
            d = ev.delta
            if d.type == "text_delta" and d.text:
                self.pieces += 1
                pieces.add(d.text)
            elif d.type == "thinking_delta" and d.thinking:
                self.pieces += 1
                pieces.add(d.thinking, reasoning=True)
            elif d.type == "input_json_delta" and d.partial_json:
                index = self._calls.get(ev.index)
                if index is None:
                    raise UpstreamProtocolError(
                        f"{self.name}: the model backend sent tool input outside a tool_use block"
                    )
                return ToolCallDelta(index=index, arguments=d.partial_json)
        elif kind == "content_block_start" and ev.content_block is not None:
            block = ev.content_block
            if block.type == "tool_use":
                index = self._calls[ev.index] = len(self._calls)
                return ToolCallDelta(
                    index=index, id=block.id, type="function", name=block.name, arguments=""
                )
        elif kind == "message_start":
            self._input(ev.message.usage if ev.message is not None else None)
        elif kind == "message_delta":
            if ev.delta is not None and ev.delta.stop_reason is not None:
                self.stop_reason = ev.delta.stop_reason
            if ev.usage is not None and ev.usage.output_tokens is not None:
                self.output_tokens = ev.usage.output_tokens
            self._input(ev.usage)
        elif kind == "message_stop":
            self.done = True
        elif kind == "error":
            err = ev.error or _Error()
            said = f"{self.name}: Anthropic reported {err.type} mid-stream: {err.message[:300]}"
            status = _STREAM_ERRORS.get(err.type)
            if status is not None:  # retried if no token has gone out yet
                raise UpstreamStatusError(said, upstream_status=status)
            raise UpstreamProtocolError(said)
        return None

    def _input(self, usage: _Usage | None) -> None:
        """The prompt's counts in ``message_start`` (or, again, ``message_delta``)."""
        if usage is None:
            return
        if usage.input_tokens is not None:
            self.input_tokens = max(0, usage.input_tokens)
        if usage.cache_read_input_tokens is not None:
            self.cache_read = max(0, usage.cache_read_input_tokens)
        if usage.cache_creation_input_tokens is not None:
            self.cache_write = max(0, usage.cache_creation_input_tokens)
