"""Anthropic's Messages API (``POST /v1/messages``) as a codec at the pipeline's edge (sans-IO).

:func:`decode` turns a Messages request into the pipeline's Chat Completions
body: ``system`` becomes a system message; a user message's ``tool_result``
blocks become ``tool`` messages (before the rest of its content), its ``text``,
``image`` and ``document`` blocks content parts; an assistant message's ``text``
becomes its content, ``tool_use`` blocks its tool calls (parallel ones
included), ``thinking`` its ``reasoning_content``; ``tools`` become function
tools, ``tool_choice`` (``auto`` / ``any`` / ``tool`` / ``none``,
``disable_parallel_tool_use``) the Chat Completions choice, ``stop_sequences``
``stop``, ``metadata.user_id`` ``user``, ``thinking`` a ``reasoning_effort``
(by its ``budget_tokens``). ``max_tokens`` is required, as Anthropic requires it.
A field or block with no equivalent is refused with a 400 naming it.

:class:`MessagesFramer` turns what the response assembler releases into
Anthropic's events::

    message_start
    per content block: content_block_start,
        content_block_delta (text_delta | thinking_delta | input_json_delta)...,
        content_block_stop
    message_delta (stop_reason, usage), message_stop    -- or: error

with ``ping`` as the keep-alive. Errors, before the head and in a stream, are
Anthropic's ``{"type": "error", "error": {"type", "message"}}`` with its statuses.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from ..api import ChatCompletion, ChunkDelta
from ..api import Usage as WireUsage
from ..errors import GatewayError, UpstreamProtocolError
from .common import (
    Codec,
    Stream,
    counts,
    decode_error,
    described,
    detail,
    encoder,
    event,
    image_url,
    invalid,
    only,
    refuse,
    string,
)

__all__ = ["CODEC", "MessagesFramer", "MessagesRequest", "decode", "error_body"]


class MessagesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The fields of a Messages request this gateway carries; any other is refused."""

    model: str
    max_tokens: int
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    stream: bool = False


_request = msgspec.json.Decoder(MessagesRequest)
#: ``thinking.budget_tokens`` below each bound: that ``reasoning_effort``.
_EFFORT = ((4096, "low"), (16384, "medium"))


def decode(body: bytes) -> tuple[bytes, MessagesRequest]:
    """A Messages request body as the pipeline's Chat Completions body, and the request.

    Raises:
        BadRequest: not JSON, a wrong type, ``max_tokens`` missing, or a field,
            block or tool with no equivalent (``param`` naming it).
    """
    try:
        req = _request.decode(body)
    except msgspec.MsgspecError as exc:
        raise decode_error(exc) from None
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _system(req.system)})
    for i, m in enumerate(req.messages):
        messages.extend(_message(m, f"messages[{i}]"))
    chat: dict[str, Any] = {"model": req.model, "messages": messages, "max_tokens": req.max_tokens}
    if req.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    for key in ("temperature", "top_p", "top_k"):
        value = getattr(req, key)
        if value is not None:
            chat[key] = value
    if req.stop_sequences:
        chat["stop"] = req.stop_sequences
    if req.metadata:
        only(req.metadata, "metadata", ("user_id",))
        if req.metadata.get("user_id") is not None:
            chat["user"] = string(req.metadata, "user_id", "metadata")
    if req.tools:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        chat.update(_tool_choice(req.tool_choice))
    if req.thinking is not None:
        effort = _thinking(req.thinking)
        if effort is not None:
            chat["reasoning_effort"] = effort
    return encoder.encode(chat), req


def _system(system: str | list[dict[str, Any]]) -> str:
    if isinstance(system, str):
        return system
    texts = []
    for j, block in enumerate(system):
        only(block, f"system[{j}]", ("type", "text"))
        if block.get("type") != "text":
            raise refuse(f"system[{j}].type", "must be `text`")
        texts.append(string(block, "text", f"system[{j}]"))
    return "".join(texts)


def _message(m: dict[str, Any], where: str) -> list[dict[str, Any]]:
    only(m, where, ("role", "content"))
    role = m.get("role")
    if role not in ("user", "assistant"):
        raise invalid(f"{where}.role", "must be `user` or `assistant`")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content", "must be a string or a list of content blocks")
    if role == "assistant":
        return [_assistant(content, where)]
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            only(block, at, ("type", "text"))
            parts.append({"type": "text", "text": string(block, "text", at)})
        elif kind == "image":
            only(block, at, ("type", "source"))
            parts.append(image_url(_source(block.get("source"), at)))
        elif kind == "document":
            only(block, at, ("type", "source", "title"))
            url = _source(block.get("source"), at)
            name = block.get("title") or "document.pdf"
            parts.append({"type": "file", "file": {"file_data": url, "filename": name}})
        elif kind == "tool_result":
            results.append(_result(block, at))
        else:
            raise refuse(f"{at}.type", f"`{kind}` blocks have no equivalent here")
    out = results
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def _source(source: Any, at: str) -> str:
    """An image's or document's source as a URL (a data URL for base64 data)."""
    if not isinstance(source, dict):
        raise invalid(f"{at}.source", "must be an object")
    if source.get("type") == "base64":
        only(source, f"{at}.source", ("type", "media_type", "data"))
        return f"data:{source.get('media_type', '')};base64,{source.get('data', '')}"
    if source.get("type") == "url":
        only(source, f"{at}.source", ("type", "url"))
        return string(source, "url", f"{at}.source")
    raise refuse(f"{at}.source.type", "must be `base64` or `url`")


def _result(block: dict[str, Any], at: str) -> dict[str, Any]:
    only(block, at, ("type", "tool_use_id", "content", "is_error"))
    if block.get("is_error"):
        raise refuse(f"{at}.is_error", "has no equivalent in a Chat Completions tool message")
    if not isinstance(block.get("tool_use_id"), str):
        raise invalid(f"{at}.tool_use_id", "must be a string")
    content = block.get("content", "")
    if isinstance(content, list):
        texts = []
        for k, inner in enumerate(content):
            if not isinstance(inner, dict) or inner.get("type") != "text":
                raise refuse(f"{at}.content[{k}]", "a tool result may hold text only")
            only(inner, f"{at}.content[{k}]", ("type", "text"))
            texts.append(string(inner, "text", f"{at}.content[{k}]"))
        content = "".join(texts)
    if not isinstance(content, str):
        raise invalid(f"{at}.content", "must be a string or a list of text blocks")
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _assistant(content: list[Any], where: str) -> dict[str, Any]:
    texts: list[str] = []
    thought: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            only(block, at, ("type", "text"))
            texts.append(string(block, "text", at))
        elif kind == "thinking":
            # The signature vouches for Anthropic's own thinking to Anthropic; a
            # Chat Completions backend has no use for it.
            only(block, at, ("type", "thinking", "signature"))
            thought.append(string(block, "thinking", at))
        elif kind == "tool_use":
            only(block, at, ("type", "id", "name", "input"))
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise invalid(at, "a tool_use block needs `id` and `name`")
            args = json.dumps(block.get("input") or {}, separators=(",", ":"), ensure_ascii=False)
            fn = {"name": block["name"], "arguments": args}
            calls.append({"id": block["id"], "type": "function", "function": fn})
        else:
            raise refuse(f"{at}.type", f"`{kind}` blocks have no equivalent here")
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        out["tool_calls"] = calls
    if thought:
        out["reasoning_content"] = "".join(thought)
    return out


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    only(tool, f"tools[{i}]", ("type", "name", "description", "input_schema"))
    if tool.get("type") not in (None, "custom"):
        raise refuse(f"tools[{i}].type", "server tools have no equivalent")
    if not isinstance(tool.get("name"), str):
        raise invalid(f"tools[{i}].name", "is required")
    fn: dict[str, Any] = {"name": tool["name"], "parameters": tool.get("input_schema") or {}}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    only(choice, "tool_choice", ("type", "name", "disable_parallel_tool_use"))
    kind = choice.get("type")
    out: dict[str, Any] = {}
    if kind == "auto":
        out["tool_choice"] = "auto"
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "none":
        out["tool_choice"] = "none"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise invalid("tool_choice.type", "must be `auto`, `any`, `tool` (with `name`) or `none`")
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def _thinking(thinking: dict[str, Any]) -> str | None:
    only(thinking, "thinking", ("type", "budget_tokens"))
    kind = thinking.get("type")
    if kind == "disabled":
        return None
    budget = thinking.get("budget_tokens")
    if kind != "enabled" or not isinstance(budget, int) or budget < 1:
        raise invalid(
            "thinking", "must be `{type: enabled, budget_tokens: N}` or `{type: disabled}`"
        )
    return next((effort for bound, effort in _EFFORT if budget < bound), "high")


# --- the reply ------------------------------------------------------------------

#: Chat Completions ``finish_reason`` -> Anthropic ``stop_reason``.
STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}


def _usage(usage: WireUsage) -> dict[str, Any]:
    """Anthropic's usage: ``input_tokens`` is the prompt's uncached part, the cache's
    reads and writes apart (``usage.prompt_tokens`` counts all three)."""
    prompt, completion, cached, _ = counts(usage)
    written = min(detail(usage.prompt_tokens_details, "cache_write_tokens"), prompt - cached)
    return {
        "input_tokens": prompt - cached - written,
        "output_tokens": completion,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": written,
    }


def _input(call_id: str, args: str) -> Any:
    try:
        value = json.loads(args) if args else {}
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise UpstreamProtocolError(
            f"the model backend's arguments of tool call {call_id!r} are not a JSON object"
        )
    return value


def body(completion: ChatCompletion, view: object) -> bytes:
    """The ``message`` object of a reply the client did not stream."""
    choice = completion.choices[0]
    msg = choice.message
    content: list[dict[str, Any]] = []
    if isinstance(msg.reasoning_content, str) and msg.reasoning_content:
        content.append({"type": "thinking", "thinking": msg.reasoning_content, "signature": ""})
    text = (msg.content or "") + (msg.refusal if isinstance(msg.refusal, str) else "")
    if text:
        content.append({"type": "text", "text": text})
    if not isinstance(msg.tool_calls, msgspec.UnsetType):
        for call in msg.tool_calls:
            content.append(
                {
                    "type": "tool_use",
                    "id": call.id,
                    "name": call.function.name,
                    "input": _input(call.id, call.function.arguments),
                }
            )
    message = {
        "id": completion.id,
        "type": "message",
        "role": "assistant",
        "model": completion.model,
        "content": content,
        "stop_reason": STOP_REASONS.get(choice.finish_reason or "stop", "end_turn"),
        "stop_sequence": None,
        "usage": _usage(completion.usage),
    }
    return encoder.encode(message)


#: The content block each kind of piece belongs to, and its delta's type and field;
#: a piece of another block closes the open ones.
_BLOCK = {
    "reasoning": ("thinking", b"thinking_delta", "thinking"),
    "text": ("text", b"text_delta", "text"),
    "refusal": ("text", b"text_delta", "text"),
}


_DELTA = (
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,'
    b'"delta":{"type":"%s","%s":%s}}\n\n'
)


class MessagesFramer:
    """One streamed message's events; see the module docstring."""

    def __init__(self, message_id: str, model: str, created: int, view: object) -> None:
        self._id = message_id
        self.model = model
        self._stream = Stream()
        self._blocks = 0
        #: The open blocks' indices and kinds (several only for parallel tool calls).
        self._open: list[tuple[int, str]] = []
        #: Tool call index -> its block index.
        self._calls: dict[int, int] = {}
        #: Block index -> the call's id and its arguments so far: checked at the
        #: close, since the SDK parses each input as an object only then.
        self._inputs: dict[int, tuple[str, list[str]]] = {}

    @staticmethod
    def _event(name: bytes, fields: dict[str, Any]) -> bytes:
        fields = {"type": name.decode(), **fields}
        return event(name, encoder.encode(fields))

    def role(self) -> bytes:
        """``message_start``: the message with no content yet."""
        self._stream.go("role")
        message: dict[str, Any] = {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return self._event(b"message_start", {"message": message})

    def delta(self, delta: ChunkDelta, logprobs: msgspec.Raw | None = None) -> bytes:
        self._stream.go("delta")
        out = b""
        if delta.reasoning_content:
            out += self._piece("reasoning", delta.reasoning_content)
        if delta.content:
            out += self._piece("text", delta.content)
        if delta.refusal:
            out += self._piece("refusal", delta.refusal)
        for chunk in delta.tool_calls or ():
            fn = chunk.function
            out += self._call(
                chunk.index, chunk.id, fn.name if fn else None, fn.arguments if fn else None
            )
        return out

    def _close_open(self) -> bytes:
        out = b"".join(self._event(b"content_block_stop", {"index": i}) for i, _ in self._open)
        self._open = []
        return out

    def _start(self, kind: str, block: dict[str, Any]) -> tuple[bytes, int]:
        index = self._blocks
        self._blocks += 1
        self._open.append((index, kind))
        return self._event(b"content_block_start", {"index": index, "content_block": block}), index

    def _piece(self, kind: str, text: str) -> bytes:
        block, delta_type, key = _BLOCK[kind]
        out = b""
        if self._open and self._open[0][1] == block:
            index = self._open[0][0]
        else:
            out = self._close_open()
            blank: dict[str, Any] = {"type": block, key: ""}
            if block == "thinking":
                blank["signature"] = ""
            started, index = self._start(block, blank)
            out += started
        # The event of nearly every token, made from a template.
        return out + _DELTA % (index, delta_type, key.encode(), encoder.encode(text))

    def _call(self, call: int, call_id: str | None, name: str | None, args: str | None) -> bytes:
        out = b""
        index = self._calls.get(call)
        if index is None:
            if not (self._open and self._open[0][1] == "tool_use"):
                out = self._close_open()
            block = {"type": "tool_use", "id": call_id or "", "name": name or "", "input": {}}
            started, index = self._start("tool_use", block)
            out += started
            self._calls[call] = index
            self._inputs[index] = (call_id or "", [])
        elif (index, "tool_use") not in self._open:
            raise UpstreamProtocolError(
                f"the model backend interleaved tool call {call} with other output"
            )
        if args:
            self._inputs[index][1].append(args)
            delta = {"type": "input_json_delta", "partial_json": args}
            out += self._event(b"content_block_delta", {"index": index, "delta": delta})
        return out

    def close(self, finish_reason: str, usage: WireUsage) -> bytes:
        """Close the open blocks; ``message_delta`` (stop reason, usage), ``message_stop``.

        Raises:
            UpstreamProtocolError: a tool call's input is not a JSON object. The
                official SDK would fail on it after a clean ``message_stop``, so
                the stream is not closed: it stays open for :meth:`fail`'s
                ``error`` event, as the unstreamed reply is an error (issue 51).
        """
        for call_id, parts in self._inputs.values():
            _input(call_id, "".join(parts))
        self._stream.go("close")
        out = self._close_open()
        delta = {"stop_reason": STOP_REASONS.get(finish_reason, "end_turn"), "stop_sequence": None}
        out += self._event(b"message_delta", {"delta": delta, "usage": _usage(usage)})
        return out + self._event(b"message_stop", {})

    def fail(self, err: GatewayError) -> bytes:
        """Anthropic's ``error`` event."""
        self._stream.go("fail")
        return event(b"error", error_body(err)[1])


#: Our status -> Anthropic's status and error type.
_ERRORS: dict[int, tuple[int, str]] = {
    400: (400, "invalid_request_error"),
    401: (401, "authentication_error"),
    402: (402, "billing_error"),
    403: (403, "permission_error"),
    404: (404, "not_found_error"),
    405: (405, "invalid_request_error"),
    408: (408, "timeout_error"),
    409: (409, "invalid_request_error"),
    413: (413, "request_too_large"),
    415: (415, "invalid_request_error"),
    422: (400, "invalid_request_error"),
    429: (429, "rate_limit_error"),
    500: (500, "api_error"),
    502: (502, "api_error"),
    503: (529, "overloaded_error"),
    504: (504, "timeout_error"),
}


def error_body(err: GatewayError) -> tuple[int, bytes]:
    """Any gateway error as Anthropic's status and ``{"type": "error", "error": {...}}``.

    The message keeps what Anthropic's shape has no field for: the code, and
    the field or stage the error is about.
    """
    status, kind = _ERRORS.get(
        err.status, (err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    )
    message = described(err)
    if err.code:
        message = f"{message} [{err.code}]"
    return status, encoder.encode({"type": "error", "error": {"type": kind, "message": message}})


CODEC = Codec(
    kind="messages",
    ping=b'event: ping\ndata: {"type": "ping"}\n\n',
    decode=decode,
    framer=MessagesFramer,
    body=body,
    error=error_body,
)
