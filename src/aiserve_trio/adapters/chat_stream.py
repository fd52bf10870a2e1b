"""Decoding an OpenAI chat-completions event stream (sans-IO): bytes in, deltas out.

The stream is Server-Sent Events (see ``sse_parser.py``) whose ``data`` is one
JSON chunk per event, ending with ``data: [DONE]``. A chunk carries in
``choices[].delta`` the text (``content``), reasoning (``reasoning_content``, or
``reasoning`` as some servers name it), a ``refusal``, tool-call fragments
(``tool_calls``); ``choices[].logprobs``; the finish reason in
``choices[].finish_reason``; token counts in ``usage`` (with their details); or
an ``error`` object when the backend fails after the response has started.

:class:`ChatStreamDecoder` is fed each network read as it arrives. The texts of
the events in one read are joined into one delta: what arrived together is
written together -- one channel hop and one client write per read instead of
per token. An event with tool-call fragments or logprobs is a delta of its own
(in order), since those do not join. No I/O happens here, so every case
(splits at any byte, errors mid-read) is tested without a socket.
"""

from __future__ import annotations

import msgspec

from ..core.errors import UpstreamProtocolError
from .base import Delta, ToolCallDelta, Usage, cache_counts
from .sse_parser import SSEDecodeError, SSEParser

DONE = "[DONE]"
NULL = msgspec.Raw(b"null")


def _some(raw: msgspec.Raw) -> msgspec.Raw | None:
    return None if raw == NULL else raw


class _UFunction(msgspec.Struct):
    name: str | None = None
    arguments: str | None = None


class _UToolCall(msgspec.Struct):
    index: int = 0
    id: str | None = None
    type: str | None = None
    function: _UFunction | None = None


class _UDelta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    tool_calls: list[_UToolCall] | None = None


class _UChoice(msgspec.Struct):
    delta: _UDelta | None = None
    finish_reason: str | None = None
    # (msgspec takes no `Raw | None`: an absent or null value is the raw `null`.)
    logprobs: msgspec.Raw = NULL


class _UUsage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: msgspec.Raw = NULL
    completion_tokens_details: msgspec.Raw = NULL


class _UError(msgspec.Struct):
    message: str = ""


class _UChunk(msgspec.Struct):
    choices: list[_UChoice] = msgspec.field(default_factory=list)
    usage: _UUsage | None = None
    error: _UError | None = None


_chunk_decoder = msgspec.json.Decoder(_UChunk)
_chunks_decoder = msgspec.json.Decoder(list[_UChunk])
_DONE_BYTES = DONE.encode()


class ChatStreamDecoder:
    """One reply's event stream, decoded read by read.

    Use: :meth:`feed` each read and deliver what it returns, then :meth:`check`;
    :meth:`end` once the body has ended.

    Attributes:
        done: ``[DONE]`` has arrived; nothing after it counts.
        finish_reason: the last finish reason a chunk gave.
        usage: the token counts the backend reported, if any.
        pieces: the text pieces received (the completion count when the
            backend reports no usage).
    """

    __slots__ = ("_error", "_parser", "done", "finish_reason", "name", "pieces", "usage")

    def __init__(self, name: str) -> None:
        """Start decoding one reply.

        Args:
            name: the adapter's name, for error messages.
        """
        self.name = name
        self._parser = SSEParser()
        self._error: UpstreamProtocolError | None = None
        self.done = False
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.pieces = 0

    def feed(self, data: bytes) -> list[Delta]:
        """The delta one read completes: the text of all its events, joined (none if no text).

        When an event in ``data`` is malformed or reports an error, the text
        of the events before it is still returned -- the client gets what the
        backend produced before failing -- and the error is raised by the next
        call to :meth:`check`, :meth:`feed` or :meth:`end`.

        Raises:
            UpstreamProtocolError: an earlier read broke the stream.
        """
        self.check()
        if self.done:
            return []  # read on to the end (the connection is reused), but ignore it
        out: list[Delta] = []
        joined = _Joined()
        fast = self._whole_read(data, joined, out)
        if fast is not None:
            return fast
        try:
            for event in self._parser.feed(data):
                if event.data == DONE:
                    self.done = True
                    break
                self._chunk(_chunk_decoder.decode(event.data), joined, out)
        except UpstreamProtocolError as reported:
            self._error = reported
        except (SSEDecodeError, msgspec.DecodeError) as exc:
            broken = UpstreamProtocolError(f"{self.name}: the model backend sent a malformed event")
            broken.__cause__ = exc  # as `raise ... from exc` would, when check() raises it
            self._error = broken
        joined.flush(out)
        return out

    def _whole_read(self, data: bytes, joined: _Joined, out: list[Delta]) -> list[Delta] | None:
        """:meth:`feed` for a read of whole plain events: all its chunks decoded in one call.

        A backend usually sends several events per read, each one ``data:`` line;
        decoding them as one JSON array saves a parse and a decoder call per
        event. Anything else -- a partial event, a comment, a malformed or
        error chunk -- returns None having changed nothing, and the read goes
        the event-by-event way, which says exactly which event broke.
        """
        batch = self._parser.whole_data_array(data, _DONE_BYTES)
        if batch is None:
            return None
        array, events, done = batch
        try:
            chunks = _chunks_decoder.decode(array)
        except msgspec.DecodeError:
            return None
        # One chunk per event: an event that is not exactly one object (empty, or
        # two objects) is malformed, and the event-by-event way says so.
        if len(chunks) != events or any(c.error is not None for c in chunks):
            return None
        for c in chunks:
            self._chunk(c, joined, out)
        self.done = done
        joined.flush(out)
        return out

    def check(self) -> None:
        """Raise the error that broke the stream, if one did.

        Raises:
            UpstreamProtocolError: a malformed event or an error reported mid-stream.
        """
        if self._error is not None:
            raise self._error

    def end(self) -> Delta:
        """The final delta, once the body has ended.

        Its ``finish_reason`` is the backend's (``"stop"`` if it gave none);
        its ``usage`` is the backend's, or None when the backend did not count
        (the caller counts the prompt then, and uses :attr:`pieces`).

        Raises:
            UpstreamProtocolError: the stream broke, or ended without ``[DONE]``
                (a stream the upstream cut must not look finished to the client).
        """
        self.check()
        if not self.done:
            raise UpstreamProtocolError(
                f"{self.name}: the model backend closed the stream without [DONE]"
            )
        return Delta(finish_reason=self.finish_reason or "stop", usage=self.usage)

    def _chunk(self, chunk: _UChunk, joined: _Joined, out: list[Delta]) -> None:
        if chunk.error is not None:
            raise UpstreamProtocolError(
                f"{self.name}: the model backend reported an error mid-stream: "
                f"{chunk.error.message[:300]}"
            )
        u = chunk.usage
        if u is not None:
            details = _some(u.prompt_tokens_details)
            read, write = cache_counts(details)
            self.usage = Usage(
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                prompt_details=details,
                completion_details=_some(u.completion_tokens_details),
                cache_read_tokens=read,
                cache_write_tokens=write,
            )
        for choice in chunk.choices:
            d = choice.delta
            if d is not None:
                if d.content or d.reasoning_content or d.reasoning or d.refusal:
                    self.pieces += 1
                logprobs = _some(choice.logprobs)
                if d.tool_calls or logprobs is not None:
                    # Fragments and logprobs do not join: what came before goes first.
                    joined.flush(out)
                    out.append(_alone(d, logprobs))
                else:
                    joined.add(d)
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason


class _Joined:
    """The texts of the events of one read, joined into one delta."""

    __slots__ = ("events", "reasoning", "refusal", "text")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.refusal: list[str] = []
        self.events = 0

    def add(self, d: _UDelta) -> None:
        r = d.reasoning_content or d.reasoning
        if d.content or r or d.refusal:
            self.events += 1
        if d.content:
            self.text.append(d.content)
        if r:
            self.reasoning.append(r)
        if d.refusal:
            self.refusal.append(d.refusal)

    def flush(self, out: list[Delta]) -> None:
        if self.text or self.reasoning or self.refusal:
            out.append(
                Delta(
                    text="".join(self.text),
                    reasoning="".join(self.reasoning),
                    refusal="".join(self.refusal),
                    tokens=self.events,
                )
            )
        self.text, self.reasoning, self.refusal, self.events = [], [], [], 0


def _alone(d: _UDelta, logprobs: msgspec.Raw | None) -> Delta:
    calls = [ToolCallDelta.of(c) for c in d.tool_calls] if d.tool_calls else None
    return Delta(
        text=d.content or "",
        reasoning=d.reasoning_content or d.reasoning or "",
        refusal=d.refusal or "",
        tool_calls=calls,
        logprobs=logprobs,
    )
