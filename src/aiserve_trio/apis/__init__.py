"""The client APIs, as codecs at the edge of the pipeline.

The pipeline speaks one internal request (a Chat Completions body, decoded by the
parse stage) and one stream of deltas. Every route that runs it has a
:class:`Codec` at each end, all of it sans-IO -- ``kind = "chat"`` the identity
one (``chat.py``: its body is the pipeline's own), ``kind = "responses"``
(OpenAI's Responses API) and ``kind = "messages"`` (Anthropic's Messages API)
translating ones:

- ``decode(body) -> (chat body, view)``: the API's request in, the internal
  request out, with the request's own view kept for the reply (what it echoes);
  a field with no equivalent is refused with a 400 naming it;
- ``framer(...)``: a stream framer, ``delta(chunk) -> bytes`` for what the
  response assembler released, ``close(finish_reason, usage) -> bytes`` and
  ``fail(err) -> bytes``, its states in tables;
- ``body(completion, view) -> bytes``: the whole reply, when the client did not stream;
- ``error(err) -> (status, body)``: any :class:`~aiserve_trio.core.errors.GatewayError`
  in the API's own error shape, before the response head;
- what sets the API apart, as capabilities the core asks for, never its kind:
  ``native`` (pass-through), ``stored`` (replies stored under their id),
  ``echo`` (the request as the reply echoes it), ``id_prefix``.

A route is built with its kind's codec (:func:`codec_of`, ``Route.codec``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import replace

from . import chat, messages, responses, responses_native
from .common import Codec, Framer, Stored

__all__ = ["CODECS", "Codec", "Framer", "Stored", "codec_of"]


def _stored(view: object) -> Stored:
    """A Responses request's part in the stored responses: ``store``, the one it continues."""
    assert isinstance(view, responses.ResponsesRequest)
    return Stored(store=view.store is not False, previous=view.previous_response_id)


def _echo(
    view: object, rewrite: Callable[[str], str], metadata: dict[str, str] | None
) -> Generator[None, None, object]:
    """A Responses request as its reply echoes it, through the input policies' rewrite."""
    assert isinstance(view, responses.ResponsesRequest)
    return (yield from responses.redacted_steps(view, rewrite, metadata))


#: The codec of each route kind that runs the pipeline.
CODECS: dict[str, Codec] = {
    chat.CODEC.kind: chat.CODEC,
    # Its native mode lives apart: its framer extends the translated one.
    responses.CODEC.kind: replace(
        responses.CODEC,
        native=responses_native.NATIVE,
        stored=_stored,
        echo=_echo,
        id_prefix="resp_",
    ),
    messages.CODEC.kind: replace(messages.CODEC, id_prefix="msg_"),
}


def codec_of(kind: str) -> Codec:
    """The codec of a route of ``kind``; chat's for a kind that runs no pipeline
    (embeddings: its errors are the OpenAI envelope too)."""
    return CODECS.get(kind, chat.CODEC)
