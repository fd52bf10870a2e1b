"""The Gemini dialect: ``POST /v1beta/models/{model}:generateContent`` and
``:streamGenerateContent?alt=sse`` as Google's Gemini API answers them.

Requests need ``x-goog-api-key`` (or ``?key=``; 403 otherwise). ``contents``
(``role`` ``user`` / ``model``; ``text``, ``inlineData``, ``functionCall``,
``functionResponse`` parts), ``systemInstruction``, ``tools[].functionDeclarations``
(``parameters`` or ``parametersJsonSchema``), ``toolConfig.functionCallingConfig``
(``AUTO`` / ``ANY`` / ``NONE``, ``allowedFunctionNames``), ``generationConfig``
(``maxOutputTokens``; ``thinkingConfig.includeThoughts``: reasoning first) are read.

The stream is ``data:`` events, each a whole ``GenerateContentResponse``: a text
piece per token (``thought: true`` for reasoning); a function call comes whole, in
one part (``functionCall``: ``name``, ``args``), as Gemini sends it; the last event
has ``finishReason`` (``STOP`` or ``MAX_TOKENS``) and ``usageMetadata``. No end
marker: the body ends. Errors are ``{"error": {"code", "message", "status"}}``.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qs

import msgspec

from .core import Prepared
from .dialect import DialectError, SimAsk
from .request import ContentPart, FunctionCall, FunctionDef, SimMessage, Tool, ToolCallIn

_enc = msgspec.json.Encoder()
_PATH = re.compile(r"^/v1beta/models/([^/:]+):(generateContent|streamGenerateContent)$")
STATUSES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


class _Call(msgspec.Struct):
    name: str = ""
    args: dict[str, Any] | None = None
    id: str | None = None


class _Answer(msgspec.Struct):
    name: str = ""
    response: dict[str, Any] | None = None
    id: str | None = None


class _Part(msgspec.Struct):
    text: str | None = None
    inlineData: dict[str, Any] | None = None
    functionCall: _Call | None = None
    functionResponse: _Answer | None = None
    thought: bool | None = None


class _Content(msgspec.Struct):
    parts: list[_Part] = msgspec.field(default_factory=list)
    role: str | None = None


class _Declaration(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    parametersJsonSchema: dict[str, Any] | None = None


class _Tool(msgspec.Struct):
    functionDeclarations: list[_Declaration] | None = None


class _CallingConfig(msgspec.Struct):
    mode: str = "AUTO"
    allowedFunctionNames: list[str] | None = None


class _ToolConfig(msgspec.Struct):
    functionCallingConfig: _CallingConfig | None = None


class _Generation(msgspec.Struct):
    maxOutputTokens: int | None = None
    thinkingConfig: dict[str, Any] | None = None


class _Request(msgspec.Struct):
    contents: list[_Content]
    systemInstruction: _Content | None = None
    tools: list[_Tool] | None = None
    toolConfig: _ToolConfig | None = None
    generationConfig: _Generation | None = None


_request = msgspec.json.Decoder(_Request)


def _answer_text(response: dict[str, Any] | None) -> str:
    if response is None:
        return ""
    for key in ("result", "content", "output"):
        if isinstance(response.get(key), str):
            return str(response[key])
    return _enc.encode(response).decode()


def _messages(req: _Request) -> list[SimMessage]:
    out: list[SimMessage] = []
    if req.systemInstruction is not None:
        text = "".join(p.text or "" for p in req.systemInstruction.parts)
        if text:
            out.append(SimMessage(role="system", content=text))
    for i, c in enumerate(req.contents):
        role = c.role or "user"
        if role not in ("user", "model"):
            raise DialectError(f"contents[{i}].role: must be user or model, got {role!r}")
        parts: list[ContentPart] = []
        calls: list[ToolCallIn] = []
        for p in c.parts:
            if p.functionResponse is not None:
                text = _answer_text(p.functionResponse.response)
                out.append(SimMessage(role="tool", content=text, name=p.functionResponse.name))
            elif p.functionCall is not None:
                args = _enc.encode(p.functionCall.args or {}).decode()
                call = FunctionCall(name=p.functionCall.name, arguments=args)
                calls.append(ToolCallIn(id=p.functionCall.id or "", function=call))
            elif p.inlineData is not None:
                parts.append(ContentPart(type="image_url"))
            elif p.text is not None:
                parts.append(ContentPart(type="text", text=p.text))
        if parts or calls:
            who = "assistant" if role == "model" else "user"
            out.append(SimMessage(role=who, content=parts or None, tool_calls=calls or None))
    return out


def _json_schema(schema: Any) -> Any:
    """Gemini's OpenAPI-style schema (``type: "OBJECT"``) as JSON Schema (lower case)."""
    if isinstance(schema, dict):
        return {
            k: v.lower() if k == "type" and isinstance(v, str) else _json_schema(v)
            for k, v in schema.items()
        }
    if isinstance(schema, list):
        return [_json_schema(v) for v in schema]
    return schema


def _tools(req: _Request) -> list[Tool] | None:
    out = [
        Tool(
            function=FunctionDef(
                d.name, d.description, _json_schema(d.parameters or d.parametersJsonSchema)
            )
        )
        for t in req.tools or ()
        for d in t.functionDeclarations or ()
    ]
    return out or None


def _choice(req: _Request) -> str | dict[str, Any] | None:
    cfg = req.toolConfig.functionCallingConfig if req.toolConfig is not None else None
    if cfg is None:
        return None
    if cfg.mode == "NONE":
        return "none"
    if cfg.mode == "ANY":
        names = cfg.allowedFunctionNames or []
        if len(names) == 1:
            return {"type": "function", "function": {"name": names[0]}}
        return "required"
    return "auto"


def call_id(ready: Prepared) -> str:
    assert ready.script.tool is not None
    return ready.script.tool.call_id


class GeminiDialect:
    """Gemini's generateContent (see the module docstring)."""

    name = "gemini"
    stream_type = b"text/event-stream"

    def matches(self, method: str, path: str) -> bool:
        return method == "POST" and _PATH.match(path) is not None

    def auth_error(self, headers: dict[str, str]) -> tuple[int, bytes] | None:
        if not headers.get("x-goog-api-key"):
            return 403, self.error(403, "Method doesn't allow unregistered callers.")
        return None

    def read(self, path: str, query: str, body: bytes) -> SimAsk:
        m = _PATH.match(path)
        assert m is not None
        model, method = m.groups()
        stream = method == "streamGenerateContent"
        if stream and parse_qs(query).get("alt") != ["sse"]:
            raise DialectError("the sim streams Gemini only as server-sent events (?alt=sse)")
        req = _request.decode(body)
        generation = req.generationConfig or _Generation()
        thinking = generation.thinkingConfig or {}
        return SimAsk(
            model=model,
            messages=_messages(req),
            stream=stream,
            max_tokens=generation.maxOutputTokens,
            tools=_tools(req),
            tool_choice=_choice(req),
            # The SDK sends this one key in snake case.
            reasoning_effort="medium"
            if thinking.get("includeThoughts") or thinking.get("include_thoughts")
            else None,
        )

    def error(self, status: int, message: str) -> bytes:
        err = {"code": status, "message": message, "status": STATUSES.get(status, "UNKNOWN")}
        return _enc.encode({"error": err})

    def _usage(self, ready: Prepared) -> dict[str, Any]:
        plan = ready.plan
        out = plan.tokens - plan.reasoning
        usage = {
            "promptTokenCount": ready.prompt_tokens,
            "candidatesTokenCount": out,
            "totalTokenCount": ready.prompt_tokens + plan.tokens,
        }
        if plan.reasoning:
            usage["thoughtsTokenCount"] = plan.reasoning
        return usage

    def _event(
        self, ready: Prepared, model: str, parts: list[dict[str, Any]], **extra: Any
    ) -> bytes:
        candidate = {"content": {"parts": parts, "role": "model"}, "index": 0, **extra}
        body: dict[str, Any] = {
            "candidates": [candidate],
            "modelVersion": model,
            "responseId": f"sim-{ready.serial}",
        }
        if "finishReason" in extra:
            body["usageMetadata"] = self._usage(ready)
        return b"data: " + _enc.encode(body) + b"\r\n\r\n"

    def _call_part(self, ready: Prepared) -> dict[str, Any]:
        tool = ready.script.tool
        assert tool is not None
        return {"functionCall": {"name": tool.name, "args": msgspec.json.decode(tool.arguments)}}

    def opening(self, ready: Prepared, model: str) -> bytes:
        return b""

    def token(self, ready: Prepared, k: int) -> bytes:
        script = ready.script
        r = len(script.reasoning)
        if k < r:
            return self._event(ready, "", [{"text": script.reasoning[k], "thought": True}])
        if script.tool is not None:  # the whole call at once, when it is due
            return self._event(ready, "", [self._call_part(ready)]) if k == r else b""
        return self._event(ready, "", [{"text": script.piece(k - r)}])

    def closing(self, ready: Prepared, model: str) -> bytes:
        reason = "MAX_TOKENS" if ready.plan.finish_reason == "length" else "STOP"
        return self._event(ready, model, [{"text": ""}], finishReason=reason)

    def whole(self, ready: Prepared, model: str) -> bytes:
        plan, script = ready.plan, ready.script
        r = len(script.reasoning)
        parts: list[dict[str, Any]] = []
        if r and plan.tokens:
            parts.append(
                {"text": "".join(script.reasoning[: min(r, plan.tokens)]), "thought": True}
            )
        if script.tool is not None:
            parts.append(self._call_part(ready))
        else:
            parts.append({"text": script.visible_text(max(0, plan.tokens - r))})
        reason = "MAX_TOKENS" if plan.finish_reason == "length" else "STOP"
        body = {
            "candidates": [
                {"content": {"parts": parts, "role": "model"}, "finishReason": reason, "index": 0}
            ],
            "usageMetadata": self._usage(ready),
            "modelVersion": model,
            "responseId": f"sim-{ready.serial}",
        }
        return _enc.encode(body)
