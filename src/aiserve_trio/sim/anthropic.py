"""The Anthropic dialect: ``POST /v1/messages`` as Anthropic's Messages API answers it.

Requests need ``x-api-key`` (or ``Authorization: Bearer``, as the 2.x SDK sends a
key) and ``anthropic-version`` (401 / 400 otherwise) and
``max_tokens``. ``system`` (a string or text blocks), ``user`` / ``assistant``
messages of ``text``, ``image``, ``tool_use`` and ``tool_result`` blocks,
``tools`` (``input_schema``), ``tool_choice`` (``auto`` / ``any`` / ``tool`` /
``none``) and ``thinking`` (enabled: reasoning first) are read; other fields are
accepted and ignored.

``stream: true`` gives the event stream (``event:`` and ``data:`` lines)::

    message_start        {"message": {"id", "model", "usage": {"input_tokens", ...}, ...}}
    content_block_start  {"index": 0, "content_block": {"type": "thinking", ...}}  (thinking)
    content_block_delta  {"index": 0, "delta": {"type": "thinking_delta", ...}}     per piece
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
"""

from __future__ import annotations

from typing import Any

import msgspec

from .core import Prepared
from .dialect import DialectError, SimAsk
from .reply import Script
from .request import ContentPart, FunctionCall, FunctionDef, SimMessage, Tool, ToolCallIn

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
    max_tokens: int
    system: str | list[_Block] | None = None
    tools: list[_ToolDef] | None = None
    tool_choice: _ToolChoice | None = None
    stream: bool = False
    thinking: dict[str, Any] | None = None


_request = msgspec.json.Decoder(_Request)


def _result_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(str(b.get("text", "")) for b in content if b.get("type") == "text")


def _messages(req: _Request) -> list[SimMessage]:
    out: list[SimMessage] = []
    system = req.system
    if isinstance(system, list):
        system = "".join(b.text or "" for b in system if b.type == "text")
    if system:
        out.append(SimMessage(role="system", content=system))
    for i, m in enumerate(req.messages):
        if m.role not in ("user", "assistant"):
            raise DialectError(f"messages.{i}.role: must be user or assistant, got {m.role!r}")
        if isinstance(m.content, str):
            out.append(SimMessage(role=m.role, content=m.content))
            continue
        parts: list[ContentPart] = []
        calls: list[ToolCallIn] = []
        for b in m.content:
            if b.type == "tool_result":
                text = _result_text(b.content)
                out.append(SimMessage(role="tool", content=text, tool_call_id=b.tool_use_id))
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
    return out


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


def _tool_block(script: Script, args: Any) -> dict[str, Any]:
    assert script.tool is not None
    return {"type": "tool_use", "id": tool_id(script), "name": script.tool.name, "input": args}


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _enc.encode({"type": name, **data}) + b"\n\n"


class AnthropicDialect:
    """Anthropic's Messages API (see the module docstring)."""

    name = "anthropic"
    stream_type = b"text/event-stream"

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
        if req.max_tokens < 1:
            raise DialectError("max_tokens: must be at least 1")
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
        thinking = req.thinking is not None and req.thinking.get("type") == "enabled"
        return SimAsk(
            model=req.model,
            messages=_messages(req),
            stream=req.stream,
            max_tokens=req.max_tokens,
            tools=tools,
            tool_choice=_choice(req.tool_choice),
            reasoning_effort="medium" if thinking else None,
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
            "usage": {"input_tokens": ready.prompt_tokens, "output_tokens": 1},
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
                sig = {"type": "signature_delta", "signature": "sim"}
                out += _event("content_block_delta", {"index": 0, "delta": sig})
                out += _event("content_block_stop", {"index": 0})
            out += _event("content_block_start", {"index": index, "content_block": block})
        piece = script.piece(k - r)
        if script.tool is not None:
            delta = {"type": "input_json_delta", "partial_json": piece}
        else:
            delta = {"type": "text_delta", "text": piece}
        return out + _event("content_block_delta", {"index": index, "delta": delta})

    def closing(self, ready: Prepared, model: str) -> bytes:
        plan, script = ready.plan, ready.script
        r = len(script.reasoning)
        index = 0 if plan.tokens <= r else self._visible_block(ready)[0]
        out = _event("content_block_stop", {"index": index})
        reason = STOP_REASONS.get(script.finish_reason(plan), "end_turn")
        out += _event(
            "message_delta",
            {
                "delta": {"stop_reason": reason, "stop_sequence": None},
                "usage": {"output_tokens": plan.tokens},
            },
        )
        return out + _event("message_stop", {})

    def whole(self, ready: Prepared, model: str) -> bytes:
        plan, script = ready.plan, ready.script
        r = len(script.reasoning)
        content: list[dict[str, Any]] = []
        shown = min(plan.tokens, r)
        if shown:
            thought = "".join(script.reasoning[:shown])
            content.append({"type": "thinking", "thinking": thought, "signature": "sim"})
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
            content.append({"type": "text", "text": script.visible_text(visible)})
        body = {
            "id": f"msg_sim_{ready.serial}",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": STOP_REASONS.get(script.finish_reason(plan), "end_turn"),
            "stop_sequence": None,
            "usage": {"input_tokens": ready.prompt_tokens, "output_tokens": plan.tokens},
        }
        return _enc.encode(body)
