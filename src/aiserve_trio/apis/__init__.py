"""The client APIs besides Chat Completions, as codecs at the edge of the pipeline.

The pipeline speaks one internal request (a Chat Completions body, decoded by the
parse stage) and one stream of deltas. A route of ``kind = "responses"`` (OpenAI's
Responses API) or ``kind = "messages"`` (Anthropic's Messages API) has a
:class:`Codec` at each end, all of it sans-IO:

- ``decode(body) -> (chat body, view)``: the API's request in, the internal
  request out, with the request's own view kept for the reply (what it echoes);
  a field with no equivalent is refused with a 400 naming it;
- ``framer(...)``: a stream framer, ``delta(chunk) -> bytes`` for what the
  response assembler released, ``close(finish_reason, usage) -> bytes`` and
  ``fail(err) -> bytes``, its states in tables;
- ``body(completion, view) -> bytes``: the whole reply, when the client did not stream;
- ``error(err) -> (status, body)``: any :class:`~aiserve_trio.errors.GatewayError`
  in the API's own error shape, before the response head.

A route of ``kind = "chat"`` has no codec: its path is the pipeline's own.
"""

from __future__ import annotations

from dataclasses import replace

from . import messages, responses, responses_native
from .common import Codec, Framer

__all__ = ["CODECS", "Codec", "Framer"]

#: The codec of each route kind that has one.
CODECS: dict[str, Codec] = {
    # Its native mode lives apart: its framer extends the translated one.
    responses.CODEC.kind: replace(responses.CODEC, native=responses_native.NATIVE),
    messages.CODEC.kind: messages.CODEC,
}
