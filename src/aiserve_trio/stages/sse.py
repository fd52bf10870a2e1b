"""The sse stage: output policies over the delta stream, SSE framing, the write.

:class:`SSEFramer` is sans-IO: it turns reply pieces into OpenAI
``chat.completion.chunk`` events (bytes), numbering them with ``id:`` fields.
:func:`sse_stage` is the shell: it reads deltas from the inference stage, passes
the text through the route's output filters, and writes either an event stream
or, when the client did not ask to stream, one ``chat.completion`` JSON body.
"""

from __future__ import annotations

import trio

from ..adapters.base import Delta
from ..api import (
    ChatCompletion,
    ChatCompletionChunk,
    Choice,
    ChunkChoice,
    ChunkDelta,
    ResponseMessage,
    Usage,
    encoder,
    error_json,
)
from ..errors import GatewayError, UpstreamProtocolError
from ..policies.base import OutputFilter
from .request import JSON_HEADERS, SSE_HEADERS, RequestState, Responder

DONE = b"data: [DONE]\n\n"
CHUNK = "chat.completion.chunk"


class SSEFramer:
    """Frames one completion's events. Each call returns the bytes of one event."""

    __slots__ = ("_buf", "_created", "_id", "_model", "_seq")

    def __init__(self, completion_id: str, model: str, created: int) -> None:
        self._id = completion_id
        self._model = model
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

    def _chunk(self, delta: ChunkDelta, finish: str | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self._id,
            object=CHUNK,
            created=self._created,
            model=self._model,
            choices=[ChunkChoice(index=0, delta=delta, finish_reason=finish)],
        )

    def role(self) -> bytes:
        """The opening event: the assistant role with empty content."""
        return self._event(self._chunk(ChunkDelta(role="assistant", content="")))

    def content(self, text: str) -> bytes:
        return self._event(self._chunk(ChunkDelta(content=text)))

    def finish(self, reason: str) -> bytes:
        return self._event(self._chunk(ChunkDelta(), reason))

    def usage(self, usage: Usage) -> bytes:
        chunk = ChatCompletionChunk(
            id=self._id,
            object=CHUNK,
            created=self._created,
            model=self._model,
            choices=[],
            usage=usage,
        )
        return self._event(chunk)

    def error(self, err: GatewayError) -> bytes:
        """The final error event; the stream then ends with ``[DONE]``."""
        ev = b"id: %d\ndata: %s\n\n" % (self._seq, error_json(err))
        self._seq += 1
        return ev


def apply_filters(filters: list[OutputFilter], text: str) -> str:
    for f in filters:
        if not text:
            break
        text = f.feed(text)
    return text


def finish_filters(filters: list[OutputFilter]) -> str:
    """Flush the held-back tails in order, each through the filters after it."""
    out = ""
    for f in filters:
        out = (f.feed(out) if out else "") + f.finish()
    return out


def _usage(state: RequestState) -> Usage:
    u = state.usage
    prompt = u.prompt_tokens if u else 0
    completion = u.completion_tokens if u else 0
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


async def sse_stage(
    state: RequestState, deltas: trio.MemoryReceiveChannel[Delta], responder: Responder
) -> None:
    """Write the reply: an event stream, or one JSON body if the client did not stream.

    Raises:
        UpstreamProtocolError: the upstream's stream ended without a finish reason.
    """
    filters = state.filters
    framer: SSEFramer | None = None
    # The role chunk goes out with the first content (one write fewer per stream).
    out = b""
    async with deltas:
        while True:
            try:
                batch = [await deltas.receive()]
            except trio.EndOfChannel:
                break
            # Deltas that queued up while the last write was in flight go out
            # in one write: fewer sends under load, no added wait when idle.
            while True:
                try:
                    batch.append(deltas.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            if framer is None and "sse" not in state.stage_started:
                # Parse has run by now, so whether to stream is known.
                state.mark("sse")
                filters = state.filters
                if state.stream:
                    framer = state.framer = SSEFramer(state.request_id, state.model, state.created)
                    # The head goes out with the first delta, so that failures
                    # before it are still proper HTTP statuses.
                    await responder.start(200, [*SSE_HEADERS, *state.response_headers()])
                    out = framer.role()
                    if state.on_stream_start is not None:
                        state.on_stream_start()
            for delta in batch:
                if delta.text:
                    text = apply_filters(filters, delta.text) if filters else delta.text
                    if text:
                        state.delivered.append(text)
                        if framer is not None:
                            out += framer.content(text)
                if delta.finish_reason is not None:
                    state.finish_reason = delta.finish_reason
                    state.usage = delta.usage or state.usage
            if out and state.finish_reason is None:
                # (With the finish in hand, what is left goes out with the final
                # events below, in one write.)
                if state.first_token_at is None and state.delivered:
                    state.first_token_at = trio.current_time()
                await responder.body(out)
                out = b""
    if state.finish_reason is None:
        if state.upstream_started:
            raise UpstreamProtocolError("the model backend ended the reply without finishing it")
        return  # an earlier stage failed and says why
    tail = finish_filters(filters)
    if tail:
        state.delivered.append(tail)
    if framer is not None:
        if state.first_token_at is None and state.delivered:
            state.first_token_at = trio.current_time()
        out += framer.content(tail) if tail else b""
        out += framer.finish(state.finish_reason)
        if state.include_usage:
            out += framer.usage(_usage(state))
        await responder.body(out + DONE, more=False)
        return
    body = ChatCompletion(
        id=state.request_id,
        created=state.created,
        model=state.model,
        choices=[
            Choice(
                index=0,
                message=ResponseMessage(role="assistant", content="".join(state.delivered)),
                finish_reason=state.finish_reason,
            )
        ],
        usage=_usage(state),
    )
    state.first_token_at = trio.current_time()
    await responder.complete(200, [*JSON_HEADERS, *state.response_headers()], encoder.encode(body))
