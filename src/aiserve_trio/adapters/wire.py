"""The body an OpenAI-compatible backend gets: the client's, with the documented changes.

:func:`chat_body` is pure. Every top-level field the client sent goes up
exactly as it was sent (its raw JSON), in the client's order, except:

- ``model``: the route's ``upstream_model`` when one is configured;
- ``messages``: session context put in front, input policies applied, old
  history trimmed to the context window -- a message nobody changed is the
  client's JSON byte for byte;
- ``stream``: always true upstream (the first token is known as soon as it
  exists, and a cancelled request closes the stream at once), and
  ``stream_options.include_usage`` true, the client's other stream options kept;
- the token limit: when the gateway's limit (``InferenceRequest.max_tokens``)
  differs from what the client sent, or the client sent none, the gateway's
  goes up, under the client's own key (``max_completion_tokens`` or ``max_tokens``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from .base import InferenceRequest

_encoder = msgspec.json.Encoder()
_raw_dict = msgspec.json.Decoder(dict[str, msgspec.Raw])
_TRUE = msgspec.Raw(b"true")
_USAGE_ONLY = msgspec.Raw(b'{"include_usage":true}')


def chat_body(request: InferenceRequest, model: str) -> bytes:
    """The upstream request body for ``request`` (see the module docstring)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [m.to_raw() for m in request.messages],
    }
    extra = request.extra
    body.update(extra)
    limit = request.max_tokens
    if limit is not None:
        key = "max_completion_tokens" if "max_completion_tokens" in extra else "max_tokens"
        sent = extra.get(key)
        if sent is None or _int_of(sent) != limit:
            body[key] = limit
    body["stream"] = _TRUE
    opts = extra.get("stream_options")
    body["stream_options"] = _usage_on(opts) if opts is not None else _USAGE_ONLY
    return _encoder.encode(body)


def _int_of(raw: msgspec.Raw) -> int | None:
    try:
        return msgspec.json.decode(raw, type=int)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _usage_on(opts: msgspec.Raw) -> msgspec.Raw:
    try:
        fields = dict(_raw_dict.decode(opts))
    except msgspec.DecodeError:  # `null`: the client sent none
        return _USAGE_ONLY
    fields["include_usage"] = _TRUE
    return msgspec.Raw(_encoder.encode(fields))
