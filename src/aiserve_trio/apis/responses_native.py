"""Native pass-through of OpenAI's Responses API (sans-IO): the client's request as sent,
the provider's events as sent (issue 44; ``apis/common.py``'s :class:`NativeSpec`).

For a ``responses`` route whose backend speaks Responses (``wire = "responses"``). The
input policies rewrite the text of ``instructions``, ``user``, ``metadata``'s values,
message items' text parts, function call outputs and the string values of function call
arguments (:func:`rewrite_steps`); a
session's earlier turns go before the client's input (:func:`with_history`). The framer
passes the provider's events through; when the output policies change an item's text
it writes that item's deltas from the event they came in, and the events that repeat the
item whole (``*.done``, ``output_item.done``, ``response.completed``) with the text the
client got. ``response.completed`` (or ``incomplete``) waits for the gateway's own end.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator
from typing import Any

import msgspec

from ..core.api import ChunkDelta, NativeEvents
from ..core.api import Usage as WireUsage
from .common import NativeSpec, State, encoder, rewrite_strings
from .responses import ResponsesFramer

__all__ = ["NATIVE", "NativeResponsesFramer", "collect", "rewrite_steps", "with_history"]

_object = msgspec.json.Decoder(dict[str, Any])
#: Request headers that reach the provider as the client sent them.
NATIVE_HEADERS = ("openai-beta",)
_END = frozenset({"response.completed", "response.incomplete"})


def with_history(raw: bytes, history: list[dict[str, Any]]) -> bytes:
    """``raw`` with a session's earlier turns before the client's input: system turns
    lead ``instructions``, the others become message items. Unchanged when there are none."""
    if not history:
        return raw
    body = _object.decode(raw)
    system = "\n\n".join(t["content"] for t in history if t["role"] == "system" and t["content"])
    items = [
        {"role": t["role"], "content": t["content"]}
        for t in history
        if t["role"] in ("user", "assistant") and t["content"]
    ]
    if system:
        own = body.get("instructions")
        body["instructions"] = f"{system}\n\n{own}" if isinstance(own, str) and own else system
    if items:
        own_input = body.get("input")
        if isinstance(own_input, str):
            own_input = [{"role": "user", "content": own_input}]
        body["input"] = [*items, *(own_input or [])]
    return encoder.encode(body)


def _rewrite_item(item: Any, rewrite: Callable[[str], str]) -> Any:
    """One input item with the text a person or a tool wrote rewritten; reasoning items
    (their ``encrypted_content`` vouches for them) and images stay as they are."""
    if not isinstance(item, dict):
        return item
    kind = item.get("type", "message")
    if kind == "message":
        content = item.get("content")
        if isinstance(content, str):
            return {**item, "content": rewrite(content)}
        if isinstance(content, list):
            parts = [
                {**p, "text": rewrite(p["text"])}
                if isinstance(p, dict) and isinstance(p.get("text"), str)
                else p
                for p in content
            ]
            return {**item, "content": parts}
    elif kind in ("function_call_output", "custom_tool_call_output") and isinstance(
        item.get("output"), str
    ):
        return {**item, "output": rewrite(item["output"])}
    elif kind == "function_call" and isinstance(item.get("arguments"), str):
        try:
            args = json.loads(item["arguments"])
        except ValueError:
            return {**item, "arguments": rewrite(item["arguments"])}
        new = rewrite_strings(args, rewrite)
        if new != args:
            return {**item, "arguments": json.dumps(new, ensure_ascii=False)}
    return item


def rewrite_steps(raw: bytes, rewrite: Callable[[str], str]) -> Generator[None, None, bytes]:
    """``raw`` with the input policies' rewrite applied (see the module docstring), one
    item a step; the same bytes when nothing changed."""
    body = _object.decode(raw)
    changed = False
    for key in ("instructions", "input", "user"):
        value = body.get(key)
        if isinstance(value, str):
            new = rewrite(value)
            changed |= new != value
            body[key] = new
    metadata = body.get("metadata")
    if isinstance(metadata, dict):
        new_metadata = rewrite_strings(metadata, rewrite)
        changed |= new_metadata != metadata
        body["metadata"] = new_metadata
    items = body.get("input")
    if isinstance(items, list):
        for i, item in enumerate(items):
            new = _rewrite_item(item, rewrite)
            if new != item:
                items[i] = new
                changed = True
            yield
    return encoder.encode(body) if changed else raw


def _retext(item: dict[str, Any], text: str) -> None:
    """An output item (as ``output_item.done`` or the response's ``output`` has it) with
    ``text`` as its text: a message's first text part, a reasoning item's first text, a
    function call's arguments."""
    kind = item.get("type")
    if kind == "function_call":
        item["arguments"] = text
        return
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list):
            for part in parts:
                if isinstance(part, dict):
                    for field in ("text", "refusal"):
                        if isinstance(part.get(field), str):
                            part[field] = text
                            return


class NativeResponsesFramer(ResponsesFramer):
    """A native Responses stream (see the module docstring). Deltas without events (a
    reply the gateway made itself) are framed as :class:`ResponsesFramer` frames them."""

    def __init__(self, response_id: str, model: str, created: int, view: object) -> None:
        super().__init__(response_id, model, created, view)
        self._held: list[bytes] = []
        #: Output index -> the text the client got of it so far.
        self._given: dict[int, list[str]] = {}
        #: Output indexes whose text the output policies changed.
        self._changed: set[int] = set()
        #: Output index -> the last text event of it (a template for what is written).
        self._template: dict[int, dict[str, Any]] = {}
        self._native_seen = False

    def role(self) -> bytes:
        self._stream.go("role")
        return b""

    def native(self, events: NativeEvents, released: ChunkDelta | None, *, same: bool) -> bytes:
        self._native_seen = True
        index = events.index
        if released is not None:
            text = (
                (released.content or "")
                + (released.reasoning_content or "")
                + (released.refusal or "")
                + "".join(
                    c.function.arguments or ""
                    for c in released.tool_calls or ()
                    if c.function is not None
                )
            )
            if text:
                self._given.setdefault(index, []).append(text)
            if same:
                return events.raw
            self._changed.add(index)
            if events.raw:
                first = events.raw.split(b"\n\n", 1)[0]
                data = first.split(b"data: ", 1)[1] if b"data: " in first else b"{}"
                self._template[index] = _object.decode(data)
            template = self._template.get(index)
            if not text or template is None:
                return b""
            fields = {**template, "delta": text}
            return b"event: %s\ndata: %s\n\n" % (
                str(fields.get("type", "")).encode(),
                encoder.encode(fields),
            )
        kind = events.kind
        raw = events.raw
        if self._changed and (kind.endswith(".done") or kind in _END):
            raw = self._rewritten(raw)
        if kind in _END:
            self._held.append(raw)
            return b""
        return raw

    def _rewritten(self, raw: bytes) -> bytes:
        """An event that repeats items whole, with the text the client got of each item
        the output policies changed."""
        name, _, rest = raw.partition(b"\ndata: ")
        data = _object.decode(rest.rstrip(b"\n"))
        given = {i: "".join(self._given.get(i, ())) for i in self._changed}
        index = data.get("output_index")
        if index in given:
            text = given[index]
            for field in ("text", "refusal", "arguments"):
                if isinstance(data.get(field), str):
                    data[field] = text
            if isinstance(data.get("part"), dict):
                _retext({"content": [data["part"]]}, text)
            if isinstance(data.get("item"), dict):
                _retext(data["item"], text)
        response = data.get("response")
        if isinstance(response, dict) and isinstance(response.get("output"), list):
            for i, item in enumerate(response["output"]):
                if i in given and isinstance(item, dict):
                    _retext(item, given[i])
        return name + b"\ndata: " + encoder.encode(data) + b"\n\n"

    def delta(self, delta: ChunkDelta, logprobs: msgspec.Raw | None = None) -> bytes:
        if not self._native_seen and self._stream.state is State.OPEN and self._seq == 0:
            # A reply the gateway made itself: the events ResponsesFramer.role would have.
            self._stream.state = State.IDLE
            return super().role() + super().delta(delta, logprobs)
        return super().delta(delta, logprobs)

    def close(self, finish_reason: str, usage: WireUsage) -> bytes:
        if self._held:
            self._stream.go("close")
            return b"".join(self._held)
        return super().close(finish_reason, usage)


def collect(sse: bytes) -> bytes:
    """A Responses event stream as the response object it ends with (a client that did
    not stream gets what the stream said)."""
    last: bytes | None = None
    for chunk in sse.split(b"\n\n"):
        if chunk.startswith(b"event: response.completed") or chunk.startswith(
            b"event: response.incomplete"
        ):
            last = chunk.split(b"data: ", 1)[1]
    if last is None:
        return b"{}"
    return encoder.encode(_object.decode(last).get("response", {}))


NATIVE = NativeSpec(
    headers=NATIVE_HEADERS,
    history=with_history,
    rewrite=rewrite_steps,
    framer=NativeResponsesFramer,
    collect=collect,
)
