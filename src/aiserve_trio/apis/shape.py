"""How many pieces a request has, counted before any of it is translated (pure).

A request's cost on the event loop grows with its pieces, not its bytes: 100,000
one-character text blocks (3 MB, under ``max_body_bytes``) cost a codec's
translation, the parse stage's decoding and every walker a hundred thousand
iterations each (issue 51). So the limits on pieces -- content parts per message
(``limits.max_content_parts``) and per request (``max_request_parts``; a Responses
``input`` item counts as one too), tools (``max_tools``; OpenAI's own limit is
128), messages (``max_messages``, for the Messages API whose blocks may become
more messages) -- are checked here first, on decoders that keep every piece as
raw JSON (one C call, ~5 ms for 8 MB; nothing is built per piece), so a request
over them is a 400 before any Python loop visits its pieces.

The counts are tolerant: a piece of the wrong type is not counted and is left to
the API's own decoder, which refuses it naming the field.
"""

from __future__ import annotations

import msgspec

from ..core.errors import BadRequest
from ..security.settings import LimitsConfig

#: An absent field (``Raw`` takes any JSON value; ``Raw | None`` would take only null).
_NULL = msgspec.Raw(b"null")


class _Top(msgspec.Struct):
    """The fields that hold pieces, in any of the three APIs (the rest is skipped unread)."""

    messages: msgspec.Raw = _NULL
    input: msgspec.Raw = _NULL
    system: msgspec.Raw = _NULL
    tools: msgspec.Raw = _NULL


class _Piece(msgspec.Struct):
    """A message or an input item: the fields that may hold a list of parts."""

    type: str = "message"
    content: msgspec.Raw = _NULL
    output: msgspec.Raw = _NULL
    summary: msgspec.Raw = _NULL


_top = msgspec.json.Decoder(_Top)
_piece = msgspec.json.Decoder(_Piece)
_list = msgspec.json.Decoder(list[msgspec.Raw])


def _items(raw: msgspec.Raw) -> list[msgspec.Raw] | None:
    """``raw``'s elements if it is a JSON array, else None."""
    try:
        return _list.decode(raw)
    except msgspec.MsgspecError:
        return None


def _too_many(param: str, what: str, n: int, limit: int) -> BadRequest:
    return BadRequest(
        f"`{param}` has {n} {what}; the limit is {limit}",
        param=param,
        code="array_above_max_length",
    )


def check_shape(body: bytes, kind: str, limits: LimitsConfig) -> None:
    """Refuse a request of ``kind`` (``chat``, ``responses``, ``messages``) with more
    pieces than ``limits`` allow, before it is translated or decoded further.

    A body that is not a JSON object passes: the decoder after this refuses it.

    Raises:
        BadRequest: ``array_above_max_length`` (``too_many_messages`` for messages),
            ``param`` naming the list -- in the API's own error shape, since the
            endpoint renders every error through its codec.
    """
    try:
        top = _top.decode(body)
    except msgspec.MsgspecError:
        return
    tools = _items(top.tools)
    if tools is not None and len(tools) > limits.max_tools:
        raise _too_many("tools", "tools", len(tools), limits.max_tools)
    field = "input" if kind == "responses" else "messages"
    pieces = _items(top.input if kind == "responses" else top.messages)
    total = 0
    if kind == "messages":
        system = _items(top.system)
        total += len(system or ())
    if pieces is None:
        _check_total(total, field, limits)
        return
    if kind == "responses":
        # Each input item is a piece of its own (items may merge into one message).
        total += len(pieces)
    elif len(pieces) > limits.max_messages:
        raise BadRequest(
            f"`messages` has {len(pieces)} entries; the limit is {limits.max_messages}",
            param="messages",
            code="too_many_messages",
        )
    _check_total(total, field, limits)
    #: Responses items that are a message each (others may merge, or make none).
    messages = 0
    for i, raw in enumerate(pieces):
        try:
            piece = _piece.decode(raw)
        except msgspec.MsgspecError:
            continue
        if kind == "responses" and piece.type in ("message", "function_call_output"):
            messages += 1
            if messages > limits.max_messages:
                raise BadRequest(
                    f"`input` has more than {limits.max_messages} messages and tool "
                    f"outputs; the limit is {limits.max_messages}",
                    param="input",
                    code="too_many_messages",
                )
        for key in ("content", "output", "summary"):
            parts = _items(getattr(piece, key))
            if parts is None:
                continue
            if len(parts) > limits.max_content_parts:
                param = f"{field}[{i}].{key}"
                raise _too_many(param, "content parts", len(parts), limits.max_content_parts)
            total += len(parts)
        _check_total(total, field, limits)


def _check_total(total: int, field: str, limits: LimitsConfig) -> None:
    if total > limits.max_request_parts:
        raise BadRequest(
            f"the request has more than {limits.max_request_parts} content parts "
            f"(items of `{field}` and the parts of each), the limit",
            param=field,
            code="array_above_max_length",
        )
