"""What a native route's adapter does to the client's body before sending it (pure)."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["native_body"]

_enc = msgspec.json.Encoder()


class _Head(msgspec.Struct):
    """What a native body says that the adapter may have to change."""

    model: str = ""
    stream: bool = False


_head = msgspec.json.Decoder(_Head)
_object = msgspec.json.Decoder(dict[str, Any])


def native_body(body: bytes, model: str) -> bytes:
    """A client's request in the provider's own API (Messages, Responses), for the
    provider: the same bytes, but for the provider's name of the model when it has
    another, and ``stream`` (the gateway always streams from the provider; a client
    that did not stream gets the stream added up)."""
    head = _head.decode(body)
    if head.model == model and head.stream:
        return body
    fields = _object.decode(body)
    fields["model"] = model
    fields["stream"] = True
    return _enc.encode(fields)
