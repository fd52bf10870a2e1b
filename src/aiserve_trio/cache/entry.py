"""What the cache stores: the reply as the client got it, piece by piece.

A reply is kept as the pieces the response assembler *released* (after the
route's output filters): :class:`Replayed` deltas, the last one carrying the
finish reason and usage. Fed to an assembler without filters they give the
same chunks, the same ``chat.completion`` body, the same usage -- for a
streamed and a non-streamed request alike -- so a hit never runs the output
policies twice and never runs them differently.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec

from ..adapters.base import Delta, ToolCallDelta, Usage
from .key import KEY_VERSION


class Replayed(Delta, kw_only=True):
    """A piece of a reply that has already been through the route's output policies.

    The sse stage frames such deltas without running the filters again. The
    first one a request gets says where its answer came from.
    """

    #: On the first piece only: ``hit``, ``semantic-hit``, ``miss``, ``coalesced`` or ``bypass``.
    cache: str | None = None
    #: On the first piece of a ``semantic-hit``: the similarity of the stored question.
    similarity: float | None = None


class Entry(msgspec.Struct, kw_only=True, frozen=True):
    """A stored reply and what is known about it."""

    pieces: list[Replayed]
    #: The route's label, for whoever looks at it in Redis.
    route: str = ""
    #: Unix seconds when it was written.
    created: float = 0.0
    version: int = KEY_VERSION


# --- encoding ------------------------------------------------------------------------
# msgspec cannot decode ``Raw | None`` (logprobs, usage details), so pieces travel as
# Structs of their own, where a missing Raw is JSON ``null``; defaults are left out.

_NULL = msgspec.Raw(b"null")


class _Usage(msgspec.Struct, kw_only=True, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    prompt_details: msgspec.Raw = _NULL
    completion_details: msgspec.Raw = _NULL
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0


class _Piece(msgspec.Struct, kw_only=True, omit_defaults=True):
    text: str = ""
    reasoning: str = ""
    refusal: str = ""
    tool_calls: list[ToolCallDelta] | None = None
    logprobs: msgspec.Raw = _NULL
    finish_reason: str | None = None
    usage: _Usage | None = None
    model: str | None = None


class _Entry(msgspec.Struct, kw_only=True):
    pieces: list[_Piece]
    route: str = ""
    created: float = 0.0
    version: int = 0


def _raw(value: msgspec.Raw) -> msgspec.Raw | None:
    return None if bytes(value) == b"null" else value


def _to_wire(p: Replayed) -> _Piece:
    u = p.usage
    return _Piece(
        text=p.text,
        reasoning=p.reasoning,
        refusal=p.refusal,
        tool_calls=p.tool_calls,
        logprobs=p.logprobs if p.logprobs is not None else _NULL,
        finish_reason=p.finish_reason,
        model=p.model,
        usage=None
        if u is None
        else _Usage(
            prompt_tokens=u.prompt_tokens,
            completion_tokens=u.completion_tokens,
            prompt_details=u.prompt_details if u.prompt_details is not None else _NULL,
            completion_details=u.completion_details if u.completion_details is not None else _NULL,
            cache_read_tokens=u.cache_read_tokens,
            cache_write_tokens=u.cache_write_tokens,
        ),
    )


def _from_wire(p: _Piece) -> Replayed:
    u = p.usage
    return Replayed(
        text=p.text,
        reasoning=p.reasoning,
        refusal=p.refusal,
        tool_calls=p.tool_calls,
        logprobs=_raw(p.logprobs),
        finish_reason=p.finish_reason,
        model=p.model,
        usage=None
        if u is None
        else Usage(
            prompt_tokens=u.prompt_tokens,
            completion_tokens=u.completion_tokens,
            prompt_details=_raw(u.prompt_details),
            completion_details=_raw(u.completion_details),
            cache_read_tokens=u.cache_read_tokens,
            cache_write_tokens=u.cache_write_tokens,
        ),
    )


_encoder = msgspec.json.Encoder()
_entry_decoder = msgspec.json.Decoder(_Entry)
_pieces_decoder = msgspec.json.Decoder(list[_Piece])


def encode(entry: Entry) -> bytes:
    wire = _Entry(
        pieces=[_to_wire(p) for p in entry.pieces],
        route=entry.route,
        created=entry.created,
        version=entry.version,
    )
    return _encoder.encode(wire)


def decode(blob: bytes | str) -> Entry | None:
    """The entry, or None for one this version cannot read (it is then a miss)."""
    try:
        wire = _entry_decoder.decode(blob)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if wire.version != KEY_VERSION:
        return None
    pieces = [_from_wire(p) for p in wire.pieces]
    return Entry(pieces=pieces, route=wire.route, created=wire.created, version=wire.version)


def encode_pieces(pieces: Sequence[Replayed]) -> bytes:
    """Pieces published for other gateways (see ``redis.py``)."""
    return _encoder.encode([_to_wire(p) for p in pieces])


def decode_pieces(blob: bytes | str) -> list[Replayed]:
    """Raises: msgspec.DecodeError, msgspec.ValidationError (not pieces of this version)."""
    return [_from_wire(p) for p in _pieces_decoder.decode(blob)]


def new_entry(pieces: list[Replayed], route: str) -> Entry:
    return Entry(pieces=list(pieces), route=route, created=time.time())


def why_not_stored(pieces: list[Replayed]) -> str | None:
    """Why a finished reply must not be stored, or None when it may be.

    Only a reply that finished cleanly is: not cut (no finish reason), not
    refused (a refusal, or the backend's ``content_filter``).
    """
    if not pieces or pieces[-1].finish_reason is None:
        return "unfinished"
    if pieces[-1].finish_reason == "content_filter" or any(p.refusal for p in pieces):
        return "refused"
    return None
