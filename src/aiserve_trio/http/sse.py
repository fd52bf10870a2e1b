"""Every Server-Sent Events byte the gateway sends is made here (sans-IO).

- chat streams: :class:`ChatFramer` numbers OpenAI ``chat.completion.chunk``
  events with ``id:`` fields; a stream ends with :data:`DONE`, and a stream
  that fails after it started ends with an error event and then :data:`DONE`
  -- never cut silently, never a fake clean finish;
- session event streams (``EventSource``): :func:`session_event` per turn,
  :data:`RETRY`, :data:`PING`, :data:`CLOSE`, :func:`bus_error_event`;
- both, when the server shuts down under an open stream: :func:`shutdown_event`.
"""

from __future__ import annotations

import msgspec

from ..core.api import ChatCompletionChunk, ChunkChoice, ChunkDelta, Usage, encoder, error_json
from ..core.errors import GatewayError, Overloaded

DONE = b"data: [DONE]\n\n"
#: A comment: keeps proxies and browsers from timing an idle stream out.
PING = b": ping\n\n"
#: Browsers wait this long before reconnecting an ended EventSource.
RETRY = b"retry: 1000\n\n"
#: The end of a session event stream the server closes on purpose.
CLOSE = b"event: close\ndata: {}\n\n"
CHUNK = "chat.completion.chunk"


class ChatFramer:
    """Frames one completion's events. Each call returns the bytes of one event."""

    __slots__ = ("_buf", "_created", "_id", "_seq", "model")

    def __init__(self, completion_id: str, model: str, created: int) -> None:
        self._id = completion_id
        #: What every chunk names as the model (the one that answered, once known).
        self.model = model
        self._created = created
        self._seq = 0
        self._buf = bytearray()

    def _event(self, payload: ChatCompletionChunk) -> bytes:
        buf = self._buf
        buf.clear()
        buf += b"id: %d\ndata: " % self._seq
        self._seq += 1
        encoder.encode_into(payload, buf, -1)
        buf += b"\n\n"
        return bytes(buf)

    def _chunk(
        self, delta: ChunkDelta, finish: str | None = None, logprobs: msgspec.Raw | None = None
    ) -> ChatCompletionChunk:
        choice = ChunkChoice(index=0, delta=delta, finish_reason=finish)
        if logprobs is not None:
            choice.logprobs = logprobs
        return ChatCompletionChunk(
            id=self._id,
            object=CHUNK,
            created=self._created,
            model=self.model,
            choices=[choice],
        )

    def role(self) -> bytes:
        """The opening event: the assistant role with empty content."""
        return self._event(self._chunk(ChunkDelta(role="assistant", content="")))

    def content(self, text: str) -> bytes:
        return self._event(self._chunk(ChunkDelta(content=text)))

    def delta(self, delta: ChunkDelta, logprobs: msgspec.Raw | None = None) -> bytes:
        """One chunk of the reply: any of content, reasoning, refusal, tool-call fragments."""
        return self._event(self._chunk(delta, logprobs=logprobs))

    def finish(self, reason: str) -> bytes:
        return self._event(self._chunk(ChunkDelta(), reason))

    def usage(self, usage: Usage) -> bytes:
        chunk = ChatCompletionChunk(
            id=self._id,
            object=CHUNK,
            created=self._created,
            model=self.model,
            choices=[],
            usage=usage,
        )
        return self._event(chunk)

    def error(self, err: GatewayError) -> bytes:
        """The final error event; the stream then ends with :data:`DONE`."""
        ev = b"id: %d\ndata: %s\n\n" % (self._seq, error_json(err))
        self._seq += 1
        return ev


def session_event(event_id: str, turn_json: bytes) -> bytes:
    """One session turn as an event; ``id:`` is the bus's id, for ``Last-Event-ID``."""
    return b"id: %s\nevent: turn\ndata: %s\n\n" % (event_id.encode(), turn_json)


def bus_error_event(err: GatewayError) -> bytes:
    """A bus failure as a session stream's last event (a named event, so that
    ``EventSource``'s own ``error`` handler is not confused with it)."""
    return b"event: bus_error\ndata: %s\n\n" % error_json(err)


def shutdown_event(session_stream: bool) -> bytes:
    """The last bytes of a stream the server ends while shutting down.

    A session event stream gets :data:`CLOSE` (the browser reconnects
    elsewhere); a chat stream gets the OpenAI error envelope and :data:`DONE`.
    """
    if session_stream:
        return CLOSE
    return b"data: %s\n\n%s" % (error_json(SHUTTING_DOWN), DONE)


#: What a stream the server ends while shutting down is told.
SHUTTING_DOWN = Overloaded("the gateway is shutting down; the reply was cut", code="shutting_down")
