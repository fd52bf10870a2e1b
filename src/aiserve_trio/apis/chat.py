"""Chat Completions as a codec, the identity one: its body is the pipeline's own (sans-IO).

A route of ``kind = "chat"`` runs through the same :class:`~.common.Codec` as the
other APIs, so that the core never asks which API it serves:

- ``decode`` hands the body back as it came (the very same bytes: nothing to
  translate, nothing to scan again), with no view of its own;
- the framer is :class:`~aiserve_trio.http.sse.ChatFramer` (``chat.completion.chunk``
  events, numbered) behind the :class:`~.common.Framer` protocol: its per-token
  ``delta`` is ChatFramer's own; ``close`` writes the finish chunk, the usage chunk
  when the request asked for it (``stream_options.include_usage``) and ``[DONE]``;
  ``fail`` the error event and ``[DONE]``;
- ``body`` is the ``chat.completion`` JSON, ``error`` the OpenAI error envelope.
"""

from __future__ import annotations

from ..core.api import ChatCompletion, Usage, encoder, error_json
from ..core.errors import GatewayError
from ..http.sse import DONE, PING, ChatFramer
from .common import Codec

__all__ = ["CODEC", "ChatStreamFramer"]


class ChatStreamFramer(ChatFramer):
    """A chat stream's framer: :class:`ChatFramer` with the protocol's ``close`` and ``fail``."""

    __slots__ = ("_include_usage",)

    def __init__(
        self, completion_id: str, model: str, created: int, view: object, include_usage: bool
    ) -> None:
        super().__init__(completion_id, model, created)
        self._include_usage = include_usage

    def close(self, finish_reason: str, usage: Usage) -> bytes:
        """The finish chunk, the usage chunk if the client asked for it, ``[DONE]``."""
        out = self.finish(finish_reason)
        if self._include_usage:
            out += self.usage(usage)
        return out + DONE

    def fail(self, err: GatewayError) -> bytes:
        """The error event, then ``[DONE]``: never cut silently."""
        return self.error(err) + DONE


def decode(body: bytes) -> tuple[bytes, object]:
    """The body as it came: it is the pipeline's own."""
    return body, None


def body(completion: ChatCompletion, view: object) -> bytes:
    """The whole reply: the ``chat.completion`` JSON."""
    return encoder.encode(completion)


def error_body(err: GatewayError) -> tuple[int, bytes]:
    """Any gateway error in the OpenAI envelope, with its own status."""
    return err.status, error_json(err)


CODEC = Codec(
    kind="chat",
    ping=PING,
    decode=decode,
    framer=ChatStreamFramer,
    body=body,
    error=error_body,
)
