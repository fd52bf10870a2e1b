"""The Anthropic dialect: ``POST /v1/messages`` as Anthropic's Messages API answers it.

Requests need ``x-api-key`` (or ``Authorization: Bearer``, as the 2.x SDK sends a
key) and ``anthropic-version`` (401 / 400 otherwise) and
``max_tokens``. ``system`` (a string or text blocks), ``user`` / ``assistant``
messages of ``text``, ``image``, ``tool_use`` and ``tool_result`` blocks,
``tools`` (``input_schema``), ``tool_choice`` (``auto`` / ``any`` / ``tool`` /
``none``) and ``thinking`` (``enabled`` or ``adaptive``: reasoning first, a
``thinking`` block that ends with its ``signature``) are read. A ``system``
message inside ``messages`` (Claude Code's mid-conversation system beta) is
read as more system text. Other fields -- ``cache_control`` on any block,
``context_management``, ``metadata``, the rest of ``output_config``, ``temperature`` -- and
the ``anthropic-beta`` header are accepted and ignored;
``output_config.format`` (structured outputs: ``{"type": "json_schema", "schema": ...}``, or
the beta's top-level ``output_format``) makes a text reply a JSON instance of the schema;
the query string (``?beta=true``) too. A ``sim-call: NAME {args}`` line in the
last user message calls that tool with those arguments (:mod:`.reply`), which
is how a test makes Claude Code run its ``Read`` tool.

``stop_sequences``: a text reply ends where the first of them would begin (the text
before it is sent, the sequence is not), with ``stop_reason: "stop_sequence"`` and
``stop_sequence`` naming it; ``usage.output_tokens`` counts the pieces sent. (The
stream still ends when the whole reply would have.) A tool call's input does not stop.

``POST /v1/messages/count_tokens`` (same auth; the body of a message request
without ``max_tokens``) answers ``{"input_tokens": N}``, counted as a message
request's ``usage.input_tokens`` is.

``stream: true`` gives the event stream (``event:`` and ``data:`` lines)::

    message_start        {"message": {"id", "model", "usage": {"input_tokens", ...}, ...}}
    content_block_start  {"index": 0, "content_block": {"type": "thinking", ...}}  (thinking)
    content_block_delta  {"index": 0, "delta": {"type": "thinking_delta", ...}}     per piece
    content_block_delta  {"index": 0, "delta": {"type": "signature_delta", "signature"}}
    content_block_stop   {"index": 0}
    content_block_start  {"index": i, "content_block": {"type": "text", "text": ""}}
                         or {"type": "tool_use", "id": "toolu_...", "name", "input": {}}
    content_block_delta  {"index": i, "delta": {"type": "text_delta", "text"}}
                         or {"type": "input_json_delta", "partial_json"}          per piece
    content_block_stop   {"index": i}
    message_delta        {"delta": {"stop_reason", "stop_sequence": null},
                          "usage": {"output_tokens"}}
    message_stop

``stop_reason``: ``end_turn``, ``max_tokens`` or ``tool_use``. Otherwise one
``message`` body with the same blocks whole. Errors are
``{"type": "error", "error": {"type", "message"}}``; a 529 is ``overloaded_error``.

``usage`` reports the sim's prompt cache (:mod:`.prompt_cache`: a cacheable prefix of
1,024 tokens or more, written the first time, read when seen again) as Anthropic
does: ``cache_creation_input_tokens`` and ``cache_read_input_tokens``, with
``input_tokens`` the rest of the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from .core import Prepared
from .dialect import DialectError, SimAsk
from .reply import Script
from .request import (
    ContentPart,
    FunctionCall,
    FunctionDef,
    JsonSchemaFormat,
    ResponseFormat,
    SimMessage,
    Tool,
    ToolCallIn,
)

_enc = msgspec.json.Encoder()

#: Anthropic's error ``type`` per status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
#: ``thinking.type`` values that make the reply think first (``disabled`` does not).
THINKING = ("enabled", "adaptive")
#: The ``signature`` every thinking block ends with (Claude Code sends it back unread).
SIGNATURE = "sim-signature"
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class _Block(msgspec.Struct):
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None


class _Message(msgspec.Struct):
    role: str
    content: str | list[_Block]


class _ToolDef(msgspec.Struct):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class _ToolChoice(msgspec.Struct):
    type: str
    name: str | None = None


class _Request(msgspec.Struct):
    model: str
    messages: list[_Message]
    max_tokens: int | None = None
    system: str | list[_Block] | None = None
    tools: list[_ToolDef] | None = None
    tool_choice: _ToolChoice | None = None
    stream: bool = False
    thinking: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None


_request = msgspec.json.Decoder(_Request)


def _format(req: _Request) -> ResponseFormat | None:
    """Structured outputs: the JSON schema a text reply must be an instance of."""
    fmt = (req.output_config or {}).get("format") or req.output_format
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return None
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise DialectError("output_config.format.schema: a JSON schema object is required")
    return ResponseFormat(
        type="json_schema", json_schema=JsonSchemaFormat(schema=schema, strict=True)
    )


def _result_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(str(b.get("text", "")) for b in content if b.get("type") == "text")


def _messages(req: _Request) -> list[SimMessage]:
    out: list[SimMessage] = []
    systems = [_text(req.system)]
    # Mid-conversation system messages (a beta Claude Code uses) join the system text.
    systems += [_text(m.content) for m in req.messages if m.role == "system"]
    system = "\n".join(t for t in systems if t)
    if system:
        out.append(SimMessage(role="system", content=system))
    for i, m in enumerate(req.messages):
        if m.role == "system":
            continue
        if m.role not in ("user", "assistant"):
            raise DialectError(
                f"messages.{i}.role: must be user, assistant or system, got {m.role!r}"
            )
        if isinstance(m.content, str):
            out.append(SimMessage(role=m.role, content=m.content))
            continue
        parts: list[ContentPart] = []
        calls: list[ToolCallIn] = []
        results: list[SimMessage] = []
        for b in m.content:
            if b.type == "tool_result":
                text = _result_text(b.content)
                results.append(SimMessage(role="tool", content=text, tool_call_id=b.tool_use_id))
            elif b.type == "text":
                parts.append(ContentPart(type="text", text=b.text or ""))
            elif b.type == "image":
                parts.append(ContentPart(type="image_url"))
            elif b.type == "tool_use":
                args = _enc.encode(b.input if b.input is not None else {}).decode()
                calls.append(
                    ToolCallIn(
                        id=b.id or "", function=FunctionCall(name=b.name or "", arguments=args)
                    )
                )
        if parts or calls:
            out.append(SimMessage(role=m.role, content=parts or None, tool_calls=calls or None))
        # A user turn's text beside its tool results (Claude Code's reminders) is read
        # before them: the turn answers the calls, so the reply reads the results.
        out.extend(results)
    return out


def _text(content: str | list[_Block] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(b.text or "" for b in content if b.type == "text")


def _choice(choice: _ToolChoice | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name or ""}}
    return {"auto": "auto", "any": "required", "none": "none"}.get(choice.type, "auto")


def tool_id(script: Script) -> str:
    """Anthropic's ``toolu_`` id for the script's call (the sim's own id, renamed)."""
    assert script.tool is not None
    return "toolu_" + script.tool.call_id.removeprefix("call_")


def _usage(ready: Prepared, output: int) -> dict[str, int]:
    """Anthropic's ``usage``: the prompt cache's reads and writes apart from ``input_tokens``."""
    return {
        "input_tokens": ready.prompt_tokens - ready.cache_read - ready.cache_write,
        "cache_creation_input_tokens": ready.cache_write,
        "cache_read_input_tokens": ready.cache_read,
        "output_tokens": output,
    }


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _enc.encode({"type": name, **data}) + b"\n\n"


@dataclass(frozen=True, slots=True)
class _Cut:
    """A stop sequence met in the visible text: at offset ``at``; ``starts[i]`` is where
    visible piece ``i`` starts (and the last entry where the text ends)."""

    at: int
    sequence: str
    starts: tuple[int, ...]

    def part(self, i: int, piece: str) -> str:
        """What of visible piece ``i`` is sent: the text before the sequence."""
        return piece[: max(0, self.at - self.starts[i])]

    def sent(self) -> int:
        """How many visible pieces carry any text before the sequence."""
        return sum(1 for a in self.starts[:-1] if a < self.at)


def _signed_stop() -> bytes:
    """The end of the thinking block: its signature, then its stop, as Anthropic sends them."""
    sig = {"type": "signature_delta", "signature": SIGNATURE}
    out = _event("content_block_delta", {"index": 0, "delta": sig})
    return out + _event("content_block_stop", {"index": 0})


class AnthropicDialect:
    """Anthropic's Messages API (see the module docstring)."""

    name = "anthropic"
    stream_type = b"text/event-stream"

    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        #: The request's ``stop_sequences`` (a dialect made for one request).
        self.stop = stop
        self._cuts: dict[int, _Cut | None] = {}

    def _cut(self, ready: Prepared) -> _Cut | None:
        """Where the reply's visible text meets a stop sequence, if it does."""
        if not self.stop or ready.script.tool is not None:
            return None
        if ready.serial not in self._cuts:
            script = ready.script
            shown = max(0, ready.plan.tokens - len(script.reasoning))
            pieces = [script.piece(i) for i in range(shown)]
            text = "".join(pieces)
            found = min(((text.find(s), s) for s in self.stop if s in text), default=None)
            cut = None
            if found is not None:
                starts = [0]
                for p in pieces:
                    starts.append(starts[-1] + len(p))
                cut = _Cut(found[0], found[1], tuple(starts))
            self._cuts[ready.serial] = cut
        return self._cuts[ready.serial]

    def matches(self, method: str, path: str) -> bool:
        return method == "POST" and path == "/v1/messages"

    def auth_error(self, headers: dict[str, str]) -> tuple[int, bytes] | None:
        # The SDK (2.x) sends its API key as a bearer token; the API takes either.
        bearer = headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not headers.get("x-api-key") and not bearer:
            return 401, self.error(401, "x-api-key header is required")
        if not headers.get("anthropic-version"):
            return 400, self.error(400, "anthropic-version header is required")
        return None

    def read(self, path: str, query: str, body: bytes) -> SimAsk:
        req = _request.decode(body)
        if req.max_tokens is None:
            raise DialectError("max_tokens: Field required")
        if req.max_tokens < 1:
            raise DialectError("max_tokens: must be at least 1")
        return self._ask(req, req.max_tokens)

    def read_count(self, body: bytes) -> SimAsk:
        """A ``count_tokens`` request (a message request; ``max_tokens`` not needed).

        Raises:
            DialectError, msgspec.DecodeError: Anthropic would refuse it.
        """
        return self._ask(_request.decode(body), None)

    def _ask(self, req: _Request, max_tokens: int | None) -> SimAsk:
        tools = None
        if req.tools:
            tools = [
                Tool(
                    function=FunctionDef(
                        name=t.name, description=t.description, parameters=t.input_schema
                    )
                )
                for t in req.tools
            ]
        thinking = req.thinking is not None and req.thinking.get("type") in THINKING
        return SimAsk(
            model=req.model,
            messages=_messages(req),
            stream=req.stream,
            max_tokens=max_tokens,
            tools=tools,
            tool_choice=_choice(req.tool_choice),
            reasoning_effort="medium" if thinking else None,
            response_format=_format(req),
            # This request's own dialect renders its reply: it knows where it stops.
            render=AnthropicDialect(tuple(s for s in req.stop_sequences if s))
            if req.stop_sequences
            else None,
        )

    def error(self, status: int, message: str) -> bytes:
        kind = ERROR_TYPES.get(status, "api_error")
        return _enc.encode({"type": "error", "error": {"type": kind, "message": message}})

    def opening(self, ready: Prepared, model: str) -> bytes:
        message: dict[str, Any] = {
            "id": f"msg_sim_{ready.serial}",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(ready, 1),
        }
        return _event("message_start", {"message": message})

    def _visible_block(self, ready: Prepared) -> tuple[int, dict[str, Any]]:
        script = ready.script
        index = 1 if script.reasoning else 0
        if script.tool is not None:
            block = {
                "type": "tool_use",
                "id": tool_id(script),
                "name": script.tool.name,
                "input": {},
            }
        else:
            block = {"type": "text", "text": ""}
        return index, block

    def token(self, ready: Prepared, k: int) -> bytes:
        script = ready.script
        r = len(script.reasoning)
        out = b""
        if k < r:
            if k == 0:
                block = {"type": "thinking", "thinking": "", "signature": ""}
                out += _event("content_block_start", {"index": 0, "content_block": block})
            delta = {"type": "thinking_delta", "thinking": script.reasoning[k]}
            return out + _event("content_block_delta", {"index": 0, "delta": delta})
        index, block = self._visible_block(ready)
        if k == r:
            if r:
                out += _signed_stop()
            out += _event("content_block_start", {"index": index, "content_block": block})
        piece = script.piece(k - r)
        cut = self._cut(ready)
        if cut is not None:
            piece = cut.part(k - r, piece)
            if not piece:
                return out  # at or past the stop sequence: nothing more is said
        if script.tool is not None:
            delta = {"type": "input_json_delta", "partial_json": piece}
        else:
            delta = {"type": "text_delta", "text": piece}
        return out + _event("content_block_delta", {"index": index, "delta": delta})

    def closing(self, ready: Prepared, model: str) -> bytes:
        plan, script = ready.plan, ready.script
        r = len(script.reasoning)
        if plan.tokens <= r:  # cut short while thinking: the block still ends signed
            out = _signed_stop()
        else:
            out = _event("content_block_stop", {"index": self._visible_block(ready)[0]})
        reason, sequence, tokens = self._end(ready)
        out += _event(
            "message_delta",
            {
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"output_tokens": tokens},
            },
        )
        return out + _event("message_stop", {})

    def _end(self, ready: Prepared) -> tuple[str, str | None, int]:
        """The reply's ``stop_reason``, ``stop_sequence`` and output tokens."""
        plan = ready.plan
        cut = self._cut(ready)
        if cut is not None:
            return "stop_sequence", cut.sequence, len(ready.script.reasoning) + cut.sent()
        return STOP_REASONS.get(ready.script.finish_reason(plan), "end_turn"), None, plan.tokens

    def whole(self, ready: Prepared, model: str) -> bytes:
        plan, script = ready.plan, ready.script
        r = len(script.reasoning)
        content: list[dict[str, Any]] = []
        shown = min(plan.tokens, r)
        if shown:
            thought = "".join(script.reasoning[:shown])
            content.append({"type": "thinking", "thinking": thought, "signature": SIGNATURE})
        visible = max(0, plan.tokens - r)
        if script.tool is not None:
            try:
                args = msgspec.json.decode(script.visible_text(visible) or "{}")
            except msgspec.DecodeError:  # cut short by max_tokens
                args = {}
            content.append(
                {"type": "tool_use", "id": tool_id(script), "name": script.tool.name, "input": args}
            )
        else:
            text = script.visible_text(visible)
            cut = self._cut(ready)
            content.append({"type": "text", "text": text if cut is None else text[: cut.at]})
        reason, sequence, tokens = self._end(ready)
        body = {
            "id": f"msg_sim_{ready.serial}",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": _usage(ready, tokens),
        }
        return _enc.encode(body)
