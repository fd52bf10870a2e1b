"""Chat messages as the client sent them, and as the gateway may change them.

A :class:`Message` holds the fields the gateway reads or rewrites (role, the
text of its content, tool calls, the tool-call id it answers) next to the
message's original JSON (``raw``). A message the gateway did not change goes
upstream byte for byte as the client sent it, unknown fields included; one
that a policy rewrote is re-encoded by patching only the fields that changed
into that JSON, so nothing else the client sent is lost either.

Content is a string, ``None`` (an assistant message with tool calls only), or a
list of :class:`Part` (``text``, ``image_url``, ``input_audio``, ``file``, ...):
only text parts carry text the gateway reads; every other part travels as it came.
Tool-call arguments are JSON text; :func:`map_json_strings` rewrites the string
values inside them and keeps them valid JSON.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from .errors import BadRequest

Rewrite = Callable[[str], str]
_T = TypeVar("_T")

_encoder = msgspec.json.Encoder()
_raw_dict = msgspec.json.Decoder(dict[str, msgspec.Raw])
_any = msgspec.json.Decoder()


class FunctionCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str = ""
    arguments: str = ""


class ToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A tool call of an assistant message (complete, not a streamed fragment)."""

    id: str
    function: FunctionCall
    type: str = "function"


class Part(msgspec.Struct, kw_only=True, frozen=True):
    """One part of a multi-part content: its type, its text if it is a text part."""

    type: str
    text: str | None = None
    #: The part's JSON as the client sent it; None when the gateway made it.
    raw: msgspec.Raw | None = None

    def to_raw(self) -> msgspec.Raw:
        if self.raw is not None:
            return self.raw
        fields: dict[str, Any] = {"type": self.type}
        if self.text is not None:
            fields["text"] = self.text
        return msgspec.Raw(_encoder.encode(fields))


class Message(msgspec.Struct, kw_only=True, frozen=True):
    """One chat message (see the module docstring)."""

    role: str
    content: str | list[Part] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    #: On ``role: "tool"`` messages: the call this message answers.
    tool_call_id: str | None = None
    #: The message's JSON as the client sent it; None when the gateway made it.
    raw: msgspec.Raw | None = None
    #: Which of the fields above differ from ``raw`` (patched in when encoding).
    edited: frozenset[str] = frozenset()

    def text(self) -> str:
        """The message's text: the content string, or its text parts joined."""
        c = self.content
        if c is None:
            return ""
        if isinstance(c, str):
            return c
        return "".join(p.text or "" for p in c if p.type == "text")

    def part_types(self) -> set[str]:
        """The types of the content's parts (empty for string content)."""
        c = self.content
        return {p.type for p in c} if isinstance(c, list) else set()

    def map_text(self, fn: Rewrite) -> Message:
        """The message with ``fn`` applied to every text it carries.

        That is the content string or each text part, and the string values
        inside each tool call's arguments. Returns ``self`` when nothing changed
        (so the message still goes upstream byte for byte).
        """
        edited = set(self.edited)
        content = self.content
        if isinstance(content, str):
            new = fn(content)
            if new != content:
                content = new
                edited.add("content")
        elif isinstance(content, list):
            parts: list[Part] = []
            for p in content:
                if p.type == "text" and p.text:
                    new = fn(p.text)
                    if new != p.text:
                        p = Part(type=p.type, text=new, raw=_patch(p.raw, {"text": new}))
                        edited.add("content")
                parts.append(p)
            content = parts
        calls = self.tool_calls
        if calls:
            out = []
            for call in calls:
                args = map_json_strings(call.function.arguments, fn)
                if args != call.function.arguments:
                    fc = FunctionCall(name=call.function.name, arguments=args)
                    call = ToolCall(id=call.id, type=call.type, function=fc)
                    edited.add("tool_calls")
                out.append(call)
            calls = out
        if edited == self.edited:
            return self
        return msgspec.structs.replace(
            self, content=content, tool_calls=calls, edited=frozenset(edited)
        )

    def to_raw(self) -> msgspec.Raw:
        """The message's JSON for the upstream: as sent, or patched where it was edited."""
        if self.raw is not None and not self.edited:
            return self.raw
        fields: dict[str, Any] = {}
        if self.raw is None:
            fields["role"] = self.role
            if self.name is not None:
                fields["name"] = self.name
            if self.tool_call_id is not None:
                fields["tool_call_id"] = self.tool_call_id
        if self.raw is None or "content" in self.edited:
            c = self.content
            fields["content"] = [p.to_raw() for p in c] if isinstance(c, list) else c
        if self.tool_calls is not None and (self.raw is None or "tool_calls" in self.edited):
            fields["tool_calls"] = self.tool_calls
        return _patch(self.raw, fields)


def _patch(raw: msgspec.Raw | None, fields: dict[str, Any]) -> msgspec.Raw:
    """``raw`` (a JSON object) with ``fields`` set, other keys kept as they were."""
    base: dict[str, Any] = dict(_raw_dict.decode(raw)) if raw is not None else {}
    base.update(fields)
    return msgspec.Raw(_encoder.encode(base))


def map_json_strings(text: str, fn: Rewrite) -> str:
    """``fn`` applied to every string value inside the JSON ``text`` (keys untouched).

    Text that is not JSON is rewritten as a whole: a model's broken arguments
    are still text a policy must see.
    """
    if not text:
        return text
    try:
        value = _any.decode(text)
    except (msgspec.DecodeError, RecursionError):
        return fn(text)
    changed = False

    def walk(v: Any) -> Any:
        nonlocal changed
        if isinstance(v, str):
            new = fn(v)
            changed = changed or new != v
            return new
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        return v

    out = walk(value)
    return _encoder.encode(out).decode() if changed else text


# --- decoding what the client sent ----------------------------------------------


class _PartIn(msgspec.Struct):
    type: str
    text: str | None = None


class _MessageIn(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[msgspec.Raw] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


_message_in = msgspec.json.Decoder(_MessageIn)
_part_in = msgspec.json.Decoder(_PartIn)
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def decode_message(raw: msgspec.Raw, index: int) -> Message:
    """One message of a request body, with its original JSON kept.

    Raises:
        BadRequest: not a message object, an unknown role, a part without a type;
            ``param`` names the message (``messages[3].content[1]``).
    """
    where = f"messages[{index}]"
    m = _decoded(_message_in, raw, where)
    if m.role not in ROLES:
        raise BadRequest(
            f"`{where}.role` must be one of {', '.join(sorted(ROLES))}; got {m.role[:40]!r}",
            param=f"{where}.role",
            code="invalid_type",
        )
    content: str | list[Part] | None
    if isinstance(m.content, list):
        parts = []
        for j, praw in enumerate(m.content):
            p = _decoded(_part_in, praw, f"{where}.content[{j}]")
            parts.append(Part(type=p.type, text=p.text, raw=praw))
        content = parts
    else:
        content = m.content
    return Message(
        role=m.role,
        content=content,
        name=m.name,
        tool_calls=m.tool_calls,
        tool_call_id=m.tool_call_id,
        raw=raw,
    )


_AT = " - at `$"
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")


def invalid_field(exc: msgspec.ValidationError, where: str = "") -> tuple[str, str | None, str]:
    """What msgspec refused in a request body: its message, the field as a client names it
    (``messages[0].role``, ``where`` its prefix) and the error code -- ``invalid_type``, or
    ``missing_required_parameter`` for a field that is not there."""
    msg, _, at = str(exc).partition(_AT)
    path = where + at.rstrip("`")
    if path.startswith("."):
        path = path[1:]
    if (missing := _MISSING.match(msg)) is not None:
        field = missing["field"]
        return msg, f"{path}.{field}" if path else field, "missing_required_parameter"
    return msg, path or None, "invalid_type"


def _decoded(decoder: msgspec.json.Decoder[_T], raw: msgspec.Raw, where: str) -> _T:
    """``raw`` decoded; a wrong type is a 400 whose ``param`` is its path from ``where``.

    Raises:
        BadRequest: ``invalid_type`` (or ``invalid_json`` for bytes that are not JSON).
    """
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        msg, param, code = invalid_field(exc, where)
        raise BadRequest(
            f"invalid request: {msg} - at `$.{param}`", param=param, code=code
        ) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
