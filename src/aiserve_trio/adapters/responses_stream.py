"""Decoding OpenAI's Responses event stream (sans-IO): bytes in, deltas out.

The stream is Server-Sent Events whose ``data`` is one JSON object; its ``type``
says what it is:

=========================================  ================================================
``response.output_text.delta``             ``delta``: content text
``response.reasoning_text.delta``,         ``delta``: reasoning (the model's own text, or
``response.reasoning_summary_text.delta``  the summary of it OpenAI gives instead)
``response.refusal.delta``                 ``delta``: a refusal
``response.output_item.added``             an item opens at ``output_index``; a
                                           ``function_call`` (``call_id``, ``name``) is a
                                           tool call's first fragment
``response.function_call_arguments.delta`` ``delta``: the call's arguments, in pieces
``response.output_text.done``,             the whole text / arguments: sent only when no
``response.function_call_arguments.done``  delta of that item came first (a server that
                                           sends them whole)
``response.completed``                     the end: ``response.usage``; the finish reason
                                           is ``tool_calls`` if a call was made, else
                                           ``stop``
``response.incomplete``                    the end, cut: ``incomplete_details.reason``
                                           (``max_output_tokens``: ``length``,
                                           ``content_filter``)
``response.failed``, ``error``             the backend failed mid-stream (``code``
                                           ``rate_limit_exceeded``: a 429,
                                           ``server_error``: a 500, retried before the
                                           first token; else a protocol error)
=========================================  ================================================

Anything else (``response.created``, ``content_part.*``, ``output_item.done``, ...)
carries nothing new. Output indexes count every item; a tool call's ``index`` in
the OpenAI Chat sense counts calls only, so the decoder numbers them as they open.
The texts of one read are joined into one delta, as ``chat_stream.py`` does. No I/O.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..core.errors import UpstreamProtocolError, UpstreamStatusError
from .base import Delta, ToolCallDelta, Usage
from .pieces import EventReader, Pieces
from .sse_parser import Event

#: ``incomplete_details.reason`` -> OpenAI Chat's finish reason.
INCOMPLETE = {"max_output_tokens": "length", "content_filter": "content_filter"}
#: Error codes in the stream that are a status's worth (retried before the first token).
_STREAM_ERRORS = {"rate_limit_exceeded": 429, "server_error": 500}
#: Event types whose ``delta`` is text, and which text it is.
_TEXT = {
    "response.output_text.delta": "text",
    "response.reasoning_text.delta": "reasoning",
    "response.reasoning_summary_text.delta": "reasoning",
    "response.refusal.delta": "refusal",
}


class _Item(msgspec.Struct):
    type: str = ""
    id: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None


class _Details(msgspec.Struct):
    cached_tokens: int = 0
    reasoning_tokens: int = 0


class _Usage(msgspec.Struct):
    input_tokens: int = 0
    output_tokens: int = 0
    input_tokens_details: _Details | None = None
    output_tokens_details: _Details | None = None


class _Error(msgspec.Struct):
    message: str = ""
    code: str | None = None


class _Incomplete(msgspec.Struct):
    reason: str | None = None


class _Response(msgspec.Struct):
    usage: _Usage | None = None
    incomplete_details: _Incomplete | None = None
    error: _Error | None = None


class _Event(msgspec.Struct):
    type: str = ""
    delta: str | None = None
    text: str | None = None
    arguments: str | None = None
    item_id: str | None = None
    output_index: int = 0
    item: _Item | None = None
    response: _Response | None = None
    # an ``error`` event's own fields
    message: str | None = None
    code: str | None = None


_event_decoder = msgspec.json.Decoder(_Event)


class ResponsesStreamDecoder(EventReader):
    """One reply's Responses event stream, decoded read by read.

    Use as ``chat_stream.ChatStreamDecoder``: :meth:`feed` each read and send what it
    returns, then :meth:`check`; :meth:`end` once the body has ended.
    """

    __slots__ = (
        "_calls",
        "_streamed",
        "finish_reason",
        "pieces",
        "usage",
    )

    def __init__(self, name: str) -> None:
        super().__init__(name)
        #: Output index -> tool call index, for the function calls opened so far.
        self._calls: dict[int, int] = {}
        #: Output indexes of the items some delta came for (their ``.done`` repeats it).
        self._streamed: set[int] = set()
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.pieces = 0

    def _read(self, event: Event, held: Any, out: list[Delta]) -> None:
        """One event (its text joined with the read's; a refusal or a call's fragment
        alone). A malformed event, or a failure the stream reports (a rate limit or a
        server error: ``UpstreamStatusError``), is raised by the next :meth:`check`,
        :meth:`feed` or :meth:`end`, after what came before it."""
        alone = self._event(_event_decoder.decode(event.data), held)
        if alone is not None:
            held.flush(out)
            out.append(alone)

    def end(self) -> Delta:
        """The final delta: the finish reason and the usage the backend counted (None
        when it gave none: the caller counts the prompt and uses :attr:`pieces`).

        Raises:
            UpstreamProtocolError: the stream broke, or ended before ``response.completed``
                (or ``response.incomplete``).
        """
        self.check()
        if not self.done:
            raise UpstreamProtocolError(
                f"{self.name}: the model backend closed the stream before response.completed"
            )
        return Delta(finish_reason=self.finish_reason or "stop", usage=self.usage)

    def _event(self, ev: _Event, pieces: Pieces) -> Delta | None:
        kind = ev.type
        which = _TEXT.get(kind)
        if which is not None:
            if not ev.delta:
                return None
            self._streamed.add(ev.output_index)
            return self._text(which, ev.delta, pieces)
        if kind == "response.function_call_arguments.delta":
            self._streamed.add(ev.output_index)
            return self._arguments(ev, ev.delta)
        if kind == "response.output_item.added" and ev.item is not None:
            if ev.item.type == "function_call":
                index = self._calls[ev.output_index] = len(self._calls)
                if ev.item.arguments:
                    self._streamed.add(ev.output_index)
                call = ToolCallDelta(
                    index=index,
                    id=ev.item.call_id,
                    type="function",
                    name=ev.item.name,
                    arguments=ev.item.arguments or "",
                )
                return Delta(tool_calls=[call])
        elif kind == "response.output_text.done" and ev.output_index not in self._streamed:
            self._streamed.add(ev.output_index)
            return self._text("text", ev.text or "", pieces) if ev.text else None
        elif kind == "response.function_call_arguments.done":
            if ev.output_index not in self._streamed:
                self._streamed.add(ev.output_index)
                return self._arguments(ev, ev.arguments)
        elif kind in ("response.completed", "response.incomplete"):
            self._end(ev.response or _Response(), kind == "response.incomplete")
        elif kind in ("response.failed", "error"):
            err = ev.response.error if ev.response is not None else None
            message = err.message if err is not None else (ev.message or "")
            code = err.code if err is not None else ev.code
            said = f"{self.name}: the model backend reported a failure mid-stream: {message[:300]}"
            status = _STREAM_ERRORS.get(code or "")
            if status is not None:  # retried if no token has gone out yet
                raise UpstreamStatusError(said, upstream_status=status)
            raise UpstreamProtocolError(said)
        return None

    def _text(self, which: str, text: str, pieces: Pieces) -> Delta | None:
        self.pieces += 1
        if which == "refusal":  # Pieces join text and reasoning only: a refusal goes alone
            return Delta(refusal=text)
        pieces.add(text, reasoning=which == "reasoning")
        return None

    def _arguments(self, ev: _Event, args: str | None) -> Delta | None:
        index = self._calls.get(ev.output_index)
        if index is None:
            raise UpstreamProtocolError(
                f"{self.name}: the model backend sent arguments outside a function_call item"
            )
        if not args:
            return None
        return Delta(tool_calls=[ToolCallDelta(index=index, arguments=args)])

    def _end(self, response: _Response, incomplete: bool) -> None:
        self.done = True
        if incomplete:
            reason = response.incomplete_details.reason if response.incomplete_details else None
            self.finish_reason = INCOMPLETE.get(reason or "", "length")
        else:
            self.finish_reason = "tool_calls" if self._calls else "stop"
        u = response.usage
        if u is not None:
            cached = u.input_tokens_details.cached_tokens if u.input_tokens_details else 0
            reasoning = u.output_tokens_details.reasoning_tokens if u.output_tokens_details else 0
            self.usage = Usage(
                prompt_tokens=max(0, u.input_tokens),
                completion_tokens=max(0, u.output_tokens),
                prompt_details=_raw({"cached_tokens": max(0, cached)}),
                completion_details=_raw({"reasoning_tokens": max(0, reasoning)}),
                cache_read_tokens=max(0, cached),
            )


def _raw(obj: dict[str, Any]) -> msgspec.Raw:
    return msgspec.Raw(msgspec.json.encode(obj))
