"""The Bedrock dialect: ``POST /model/{modelId}/converse`` and ``/converse-stream`` as
Amazon Bedrock's Converse API answers them.

Requests need a SigV4 ``Authorization`` (``AWS4-HMAC-SHA256 Credential=.../bedrock/
aws4_request, SignedHeaders=..., Signature=...``) with ``x-amz-date``, or a Bedrock
API key as a bearer token (403 ``AccessDeniedException`` otherwise). The sim checks
the signature's shape, not its value: it does not know the secret (the gateway's
tests recompute it). ``messages`` (``text``, ``image``, ``toolUse``, ``toolResult``
blocks), ``system``, ``toolConfig`` (``tools[].toolSpec.inputSchema.json``,
``toolChoice`` ``auto`` / ``any`` / ``tool``), ``inferenceConfig.maxTokens`` and
``additionalModelRequestFields.thinking`` (enabled: reasoning first) are read.

The stream is the binary AWS event stream (:func:`encode_message`: prelude, string
headers ``:event-type``, ``:content-type``, ``:message-type``, JSON payload, both
CRC-32s): ``messageStart``; per block ``contentBlockStart`` (``start.toolUse`` for a
tool call), ``contentBlockDelta`` per token (``delta.text``,
``delta.reasoningContent.text``, ``delta.toolUse.input``), ``contentBlockStop``;
``messageStop`` (``stopReason`` ``end_turn`` / ``max_tokens`` / ``tool_use``);
``metadata`` (``usage``, ``metrics``). Errors are JSON with ``__type`` and
``message`` and the ``x-amzn-errortype`` name in ``__type``.
"""

from __future__ import annotations

import re
import struct
import zlib
from typing import Any

import msgspec

from .core import Prepared
from .dialect import DialectError, SimAsk
from .request import ContentPart, FunctionCall, FunctionDef, SimMessage, Tool, ToolCallIn

_enc = msgspec.json.Encoder()
_PATH = re.compile(r"^/model/(.+)/(converse|converse-stream)$")
_SIGV4 = re.compile(
    r"^AWS4-HMAC-SHA256 Credential=[^/]+/\d{8}/[a-z0-9-]+/bedrock/aws4_request, "
    r"SignedHeaders=[a-z0-9;-]+, Signature=[0-9a-f]{64}$"
)
EXCEPTIONS = {
    400: "ValidationException",
    403: "AccessDeniedException",
    404: "ResourceNotFoundException",
    429: "ThrottlingException",
    500: "InternalServerException",
    503: "ServiceUnavailableException",
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def encode_message(headers: dict[str, str], payload: bytes) -> bytes:
    """One AWS event-stream message with string headers (the format is in
    ``adapters/eventstream.py``, which reads it)."""
    head = b""
    for name, value in headers.items():
        n, v = name.encode(), value.encode()
        head += bytes([len(n)]) + n + b"\x07" + struct.pack(">H", len(v)) + v
    prelude = struct.pack(">II", 12 + len(head) + len(payload) + 4, len(head))
    prelude += struct.pack(">I", zlib.crc32(prelude))
    message = prelude + head + payload
    return message + struct.pack(">I", zlib.crc32(message))


def event(kind: str, payload: dict[str, Any]) -> bytes:
    headers = {":event-type": kind, ":content-type": "application/json", ":message-type": "event"}
    return encode_message(headers, _enc.encode(payload))


class _ToolUse(msgspec.Struct):
    toolUseId: str = ""
    name: str = ""
    input: Any = None


class _ToolResult(msgspec.Struct):
    toolUseId: str = ""
    content: list[dict[str, Any]] = msgspec.field(default_factory=list)


class _Block(msgspec.Struct):
    text: str | None = None
    image: dict[str, Any] | None = None
    toolUse: _ToolUse | None = None
    toolResult: _ToolResult | None = None


class _Message(msgspec.Struct):
    role: str
    content: list[_Block]


class _Spec(msgspec.Struct):
    name: str
    description: str | None = None
    inputSchema: dict[str, Any] | None = None


class _ToolDef(msgspec.Struct):
    toolSpec: _Spec | None = None


class _ToolConfig(msgspec.Struct):
    tools: list[_ToolDef] = msgspec.field(default_factory=list)
    toolChoice: dict[str, Any] | None = None


class _Inference(msgspec.Struct):
    maxTokens: int | None = None


class _Request(msgspec.Struct):
    messages: list[_Message]
    system: list[dict[str, Any]] | None = None
    toolConfig: _ToolConfig | None = None
    inferenceConfig: _Inference | None = None
    additionalModelRequestFields: dict[str, Any] | None = None


_request = msgspec.json.Decoder(_Request)


def _messages(req: _Request) -> list[SimMessage]:
    out: list[SimMessage] = []
    system = "".join(str(b.get("text", "")) for b in req.system or ())
    if system:
        out.append(SimMessage(role="system", content=system))
    for i, m in enumerate(req.messages):
        if m.role not in ("user", "assistant"):
            raise DialectError(f"messages.{i}.role: must be user or assistant")
        parts: list[ContentPart] = []
        calls: list[ToolCallIn] = []
        for b in m.content:
            if b.toolResult is not None:
                text = "".join(str(c.get("text", "")) for c in b.toolResult.content)
                out.append(
                    SimMessage(role="tool", content=text, tool_call_id=b.toolResult.toolUseId)
                )
            elif b.toolUse is not None:
                args = _enc.encode(b.toolUse.input if b.toolUse.input is not None else {}).decode()
                call = FunctionCall(name=b.toolUse.name, arguments=args)
                calls.append(ToolCallIn(id=b.toolUse.toolUseId, function=call))
            elif b.image is not None:
                parts.append(ContentPart(type="image_url"))
            elif b.text is not None:
                parts.append(ContentPart(type="text", text=b.text))
        if parts or calls:
            out.append(SimMessage(role=m.role, content=parts or None, tool_calls=calls or None))
    return out


def _tools(req: _Request) -> tuple[list[Tool] | None, str | dict[str, Any] | None]:
    cfg = req.toolConfig
    if cfg is None:
        return None, None
    tools = [
        Tool(
            function=FunctionDef(
                t.toolSpec.name,
                t.toolSpec.description,
                (t.toolSpec.inputSchema or {}).get("json"),
            )
        )
        for t in cfg.tools
        if t.toolSpec is not None
    ]
    choice = cfg.toolChoice or {}
    picked: str | dict[str, Any] | None = "auto"
    if "any" in choice:
        picked = "required"
    elif "tool" in choice:
        picked = {"type": "function", "function": {"name": choice["tool"].get("name", "")}}
    return tools or None, picked


def tool_id(ready: Prepared) -> str:
    assert ready.script.tool is not None
    return "tooluse_" + ready.script.tool.call_id.removeprefix("call_")


class BedrockDialect:
    """Bedrock's Converse API (see the module docstring)."""

    name = "bedrock"
    stream_type = b"application/vnd.amazon.eventstream"

    def matches(self, method: str, path: str) -> bool:
        return method == "POST" and _PATH.match(path) is not None

    def auth_error(self, headers: dict[str, str]) -> tuple[int, bytes] | None:
        auth = headers.get("authorization", "")
        if auth.startswith("Bearer ") and auth[7:].strip():
            return None
        if _SIGV4.match(auth) and headers.get("x-amz-date"):
            return None
        return 403, self.error(403, "Missing or malformed SigV4 signature")

    def read(self, path: str, query: str, body: bytes) -> SimAsk:
        m = _PATH.match(path)
        assert m is not None
        model, method = m.groups()
        req = _request.decode(body)
        tools, choice = _tools(req)
        extra = req.additionalModelRequestFields or {}
        thinking = extra.get("thinking") or extra.get("reasoning_config") or {}
        inference = req.inferenceConfig or _Inference()
        return SimAsk(
            model=model,
            messages=_messages(req),
            stream=method == "converse-stream",
            max_tokens=inference.maxTokens,
            tools=tools,
            tool_choice=choice,
            reasoning_effort="medium" if thinking.get("type") == "enabled" else None,
        )

    def error(self, status: int, message: str) -> bytes:
        return _enc.encode(
            {"__type": EXCEPTIONS.get(status, "InternalServerException"), "message": message}
        )

    def opening(self, ready: Prepared, model: str) -> bytes:
        return event("messageStart", {"role": "assistant"})

    def _visible(self, ready: Prepared) -> int:
        return 1 if ready.script.reasoning else 0

    def token(self, ready: Prepared, k: int) -> bytes:
        script = ready.script
        r = len(script.reasoning)
        if k < r:
            delta = {"reasoningContent": {"text": script.reasoning[k]}}
            return event("contentBlockDelta", {"contentBlockIndex": 0, "delta": delta})
        index = self._visible(ready)
        out = b""
        if k == r:
            if r:
                out += event("contentBlockStop", {"contentBlockIndex": 0})
            if script.tool is not None:
                start = {"toolUse": {"toolUseId": tool_id(ready), "name": script.tool.name}}
                out += event("contentBlockStart", {"contentBlockIndex": index, "start": start})
        piece = script.piece(k - r)
        visible: dict[str, Any] = (
            {"toolUse": {"input": piece}} if script.tool is not None else {"text": piece}
        )
        return out + event("contentBlockDelta", {"contentBlockIndex": index, "delta": visible})

    def closing(self, ready: Prepared, model: str) -> bytes:
        plan, script = ready.plan, ready.script
        index = 0 if plan.tokens <= len(script.reasoning) else self._visible(ready)
        out = event("contentBlockStop", {"contentBlockIndex": index})
        reason = STOP_REASONS.get(script.finish_reason(plan), "end_turn")
        out += event("messageStop", {"stopReason": reason})
        usage = {
            "inputTokens": ready.prompt_tokens,
            "outputTokens": plan.tokens,
            "totalTokens": ready.prompt_tokens + plan.tokens,
        }
        return out + event("metadata", {"usage": usage, "metrics": {"latencyMs": 1}})

    def whole(self, ready: Prepared, model: str) -> bytes:
        plan, script = ready.plan, ready.script
        r = len(script.reasoning)
        content: list[dict[str, Any]] = []
        if r and plan.tokens:
            text = "".join(script.reasoning[: min(r, plan.tokens)])
            content.append({"reasoningContent": {"reasoningText": {"text": text}}})
        visible = max(0, plan.tokens - r)
        if script.tool is not None:
            try:
                args = msgspec.json.decode(script.visible_text(visible) or "{}")
            except msgspec.DecodeError:  # cut short by maxTokens
                args = {}
            use = {"toolUseId": tool_id(ready), "name": script.tool.name, "input": args}
            content.append({"toolUse": use})
        else:
            content.append({"text": script.visible_text(visible)})
        body = {
            "output": {"message": {"role": "assistant", "content": content}},
            "stopReason": STOP_REASONS.get(script.finish_reason(plan), "end_turn"),
            "usage": {
                "inputTokens": ready.prompt_tokens,
                "outputTokens": plan.tokens,
                "totalTokens": ready.prompt_tokens + plan.tokens,
            },
            "metrics": {"latencyMs": 1},
        }
        return _enc.encode(body)
