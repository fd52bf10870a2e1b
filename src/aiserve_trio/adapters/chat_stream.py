"""Decoding an OpenAI chat-completions event stream (sans-IO): bytes in, deltas out.

The stream is Server-Sent Events (see ``sse_parser.py``) whose ``data`` is one
JSON chunk per event, ending with ``data: [DONE]``. A chunk carries text in
``choices[].delta.content``, the finish reason in ``choices[].finish_reason``,
token counts in ``usage`` (``stream_options.include_usage``), or an
``error`` object when the backend fails after the response has started.

:class:`ChatStreamDecoder` is fed each network read as it arrives and returns
at most one delta per read: the text of every event in the read, joined. What
arrived together is written together -- one channel hop and one client write
per read instead of per token. No I/O happens here, so every case (splits at
any byte, errors mid-read) is tested without a socket.
"""

from __future__ import annotations

import msgspec

from ..errors import UpstreamProtocolError
from .base import Delta, Usage
from .sse_parser import SSEDecodeError, SSEParser

DONE = "[DONE]"


class _UDelta(msgspec.Struct):
    content: str | None = None


class _UChoice(msgspec.Struct):
    delta: _UDelta | None = None
    finish_reason: str | None = None


class _UUsage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _UError(msgspec.Struct):
    message: str = ""


class _UChunk(msgspec.Struct):
    choices: list[_UChoice] = msgspec.field(default_factory=list)
    usage: _UUsage | None = None
    error: _UError | None = None


_chunk_decoder = msgspec.json.Decoder(_UChunk)


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
        text: list[str] = []
        try:
            for event in self._parser.feed(data):
                if event.data == DONE:
                    self.done = True
                    break
                self._chunk(event.data, text)
        except UpstreamProtocolError as reported:
            self._error = reported
        except (SSEDecodeError, msgspec.DecodeError) as exc:
            broken = UpstreamProtocolError(f"{self.name}: the model backend sent a malformed event")
            broken.__cause__ = exc  # as `raise ... from exc` would, when check() raises it
            self._error = broken
        return [Delta(text="".join(text))] if text else []

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

    def _chunk(self, data: str, text: list[str]) -> None:
        chunk = _chunk_decoder.decode(data)
        if chunk.error is not None:
            raise UpstreamProtocolError(
                f"{self.name}: the model backend reported an error mid-stream: "
                f"{chunk.error.message[:300]}"
            )
        if chunk.usage is not None:
            self.usage = Usage(
                prompt_tokens=chunk.usage.prompt_tokens,
                completion_tokens=chunk.usage.completion_tokens,
            )
        for choice in chunk.choices:
            if choice.delta is not None and choice.delta.content:
                self.pieces += 1
                text.append(choice.delta.content)
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
