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
from collections.abc import Callable, Generator
from dataclasses import dataclass, replace
from typing import Any

import msgspec

from ..core.api import ChatCompletion, ChunkDelta, NativeEvents
from ..core.api import Usage as WireUsage
from ..core.errors import BadRequest, GatewayError, UpstreamProtocolError
from .common import (
    IMAGE_TYPES,
    Codec,
    NativeSpec,
    Stream,
    base64_data,
    counts,
    decode_error,
    described,
    detail,
    encoder,
    event,
    image_url,
    invalid,
    json_schema,
    refuse,
    rewrite_strings,
    string,
    tool_name,
    web_url,
)

#: (the name of what has no equivalent, the 400 that refuses it) -- see :data:`HINTS`.
Notes = list[tuple[str, BadRequest]]


def _only(obj: dict[str, Any], where: str, allowed: tuple[str, ...], notes: Notes) -> None:
    """Note each field of ``obj`` that is set and not ``allowed`` (Chat has no place for it)."""
    for key, value in obj.items():
        if key not in allowed and value is not None:
            notes.append(
                (key, refuse(f"{where}.{key}", "has no equivalent; it is not sent anywhere"))
            )


__all__ = ["CODEC", "MessagesFramer", "MessagesRequest", "decode", "error_body"]


class MessagesRequest(msgspec.Struct, kw_only=True):
    """The fields of a Messages request this gateway understands.

    Any other field travels untouched on a native route (in :attr:`raw`) and is
    judged by :func:`translated` on a translated one.
    """

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
    output_config: dict[str, Any] | None = None
    stream: bool = False


@dataclass(frozen=True, slots=True)
class MessagesView:
    """A Messages request as the pipeline keeps it for the reply (the codec's view)."""

    request: MessagesRequest
    #: What has no Chat Completions equivalent: carried untouched on a native
    #: route, refused or dropped (:data:`HINTS`) by :func:`translated`.
    notes: tuple[tuple[str, BadRequest], ...] = ()
    #: On a translated route, the hints left out (``X-Aiserve-Dropped``).
    dropped: tuple[str, ...] = ()


_request = msgspec.json.Decoder(MessagesRequest)
_object = msgspec.json.Decoder(dict[str, Any])
_KNOWN = frozenset(MessagesRequest.__struct_fields__)
#: What a backend of another API may go without: hints about caching, context
#: editing, the service tier, the model's private reasoning and how a tool's input is
#: streamed (a tool's ``eager_input_streaming``, which the Vercel AI SDK's Anthropic
#: provider sets on every tool), dropped on a translated route and named in
#: ``X-Aiserve-Dropped``. Anything else is refused.
HINTS = frozenset(
    {
        "cache_control",
        "context_management",
        "service_tier",
        "signature",
        "redacted_thinking",
        "eager_input_streaming",
    }
)
#: ``thinking.budget_tokens`` below each bound: that ``reasoning_effort``.
_EFFORT = ((4096, "low"), (16384, "medium"))


def decode(body: bytes) -> tuple[bytes, MessagesView]:
    """A Messages request body as the pipeline's Chat Completions body, and its view.

    Nothing is refused for having no Chat Completions equivalent here: it is
    noted in the view (a native route carries it; :func:`translated` judges it).

    Raises:
        BadRequest: not JSON, a wrong type, or ``max_tokens`` missing.
    """
    try:
        req = _request.decode(body)
        top = _object.decode(body)
    except msgspec.MsgspecError as exc:
        raise decode_error(exc) from None
    notes: Notes = []
    for key, value in top.items():
        if key not in _KNOWN and value is not None:
            notes.append(
                (key, refuse(key, "has no equivalent on this gateway; it is not sent anywhere"))
            )
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _system(req.system, notes)})
    for i, m in enumerate(req.messages):
        messages.extend(_message(m, f"messages[{i}]", notes))
    chat: dict[str, Any] = {"model": req.model, "messages": messages, "max_tokens": req.max_tokens}
    if req.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    if req.top_k is not None and req.top_k < 0:
        raise invalid("top_k", "must be 0 or more")
    for key in ("temperature", "top_p", "top_k"):
        value = getattr(req, key)
        if value is not None:
            chat[key] = value
    if req.stop_sequences:
        chat["stop"] = req.stop_sequences
    if req.metadata:
        _only(req.metadata, "metadata", ("user_id",), notes)
        if req.metadata.get("user_id") is not None:
            chat["user"] = string(req.metadata, "user_id", "metadata")
    if req.tools:
        chat["tools"] = [
            t for i, raw in enumerate(req.tools) if (t := _tool(raw, i, notes)) is not None
        ]
    if req.tool_choice is not None:
        chat.update(_tool_choice(req.tool_choice, notes))
    if req.thinking is not None:
        effort = _thinking(req.thinking, notes)
        if effort is not None:
            chat["reasoning_effort"] = effort
    if req.output_config is not None:
        chat.update(_output_config(req.output_config, notes))
    return encoder.encode(chat), MessagesView(req, tuple(notes))


def translated(view: object) -> MessagesView:
    """On a route whose backend speaks another API: the view with the hints it
    drops named.

    Raises:
        BadRequest: a field or block that changes what the answer means has no
            equivalent (``unsupported_field``, naming it).
    """
    assert isinstance(view, MessagesView)
    dropped: dict[str, None] = {}
    for name, refusal in view.notes:
        if name not in HINTS:
            raise refusal
        dropped[name] = None
    return replace(view, dropped=tuple(dropped))


def _system(system: str | list[dict[str, Any]], notes: Notes) -> str:
    if isinstance(system, str):
        return system
    texts = []
    for j, block in enumerate(system):
        _only(block, f"system[{j}]", ("type", "text"), notes)
        if block.get("type") != "text":
            notes.append((str(block.get("type")), refuse(f"system[{j}].type", "must be `text`")))
            continue
        texts.append(string(block, "text", f"system[{j}]"))
    return "".join(texts)


def _unknown_block(at: str, kind: object) -> tuple[str, BadRequest]:
    return str(kind), refuse(f"{at}.type", f"`{kind}` blocks have no equivalent here")


def _message(m: dict[str, Any], where: str, notes: Notes) -> list[dict[str, Any]]:
    _only(m, where, ("role", "content"), notes)
    role = m.get("role")
    if role not in ("user", "assistant"):
        raise invalid(f"{where}.role", "must be `user` or `assistant`")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content", "must be a string or a list of content blocks")
    if role == "assistant":
        return [_assistant(content, where, notes)]
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            _only(block, at, ("type", "text"), notes)
            parts.append({"type": "text", "text": string(block, "text", at)})
        elif kind == "image":
            _only(block, at, ("type", "source"), notes)
            parts.append(image_url(_source(block.get("source"), at, notes, IMAGE_TYPES)))
        elif kind == "document":
            _only(block, at, ("type", "source", "title"), notes)
            url = _source(block.get("source"), at, notes, _DOCUMENT_TYPES)
            name = block.get("title") or "document.pdf"
            parts.append({"type": "file", "file": {"file_data": url, "filename": name}})
        elif kind == "tool_result":
            results.append(_result(block, at, notes))
        else:
            notes.append(_unknown_block(at, kind))
    out = results
    if parts:
        out.append({"role": "user", "content": parts})
    return out


#: A base64 document's media types (Anthropic's PDF support).
_DOCUMENT_TYPES = frozenset({"application/pdf"})


def _source(source: Any, at: str, notes: Notes, types: frozenset[str]) -> str:
    """An image's or document's source as a URL (a data URL for base64 data).

    Raises:
        BadRequest: a ``media_type`` not of ``types`` (an object, ``text/html``), data
            that is not base64, a URL that is not ``http(s)://`` (``javascript:``).
    """
    if not isinstance(source, dict):
        raise invalid(f"{at}.source", "must be an object")
    if source.get("type") == "base64":
        _only(source, f"{at}.source", ("type", "media_type", "data"), notes)
        media = source.get("media_type")
        if not isinstance(media, str) or media not in types:
            raise invalid(f"{at}.source.media_type", f"must be one of {', '.join(sorted(types))}")
        data = base64_data(source.get("data"), f"{at}.source.data")
        return f"data:{media};base64,{data}"
    if source.get("type") == "url":
        _only(source, f"{at}.source", ("type", "url"), notes)
        return web_url(source.get("url"), f"{at}.source.url")
    notes.append(
        (f"{source.get('type')} source", refuse(f"{at}.source.type", "must be `base64` or `url`"))
    )
    return ""


def _result(block: dict[str, Any], at: str, notes: Notes) -> dict[str, Any]:
    _only(block, at, ("type", "tool_use_id", "content", "is_error"), notes)
    if block.get("is_error"):
        why = "has no equivalent in a Chat Completions tool message"
        notes.append(("is_error", refuse(f"{at}.is_error", why)))
    if not isinstance(block.get("tool_use_id"), str):
        raise invalid(f"{at}.tool_use_id", "must be a string")
    content = block.get("content", "")
    if isinstance(content, list):
        texts = []
        for k, inner in enumerate(content):
            if not isinstance(inner, dict) or inner.get("type") != "text":
                kind = inner.get("type") if isinstance(inner, dict) else None
                notes.append(
                    (str(kind), refuse(f"{at}.content[{k}]", "a tool result may hold text only"))
                )
                continue
            _only(inner, f"{at}.content[{k}]", ("type", "text"), notes)
            texts.append(string(inner, "text", f"{at}.content[{k}]"))
        content = "".join(texts)
    if not isinstance(content, str):
        raise invalid(f"{at}.content", "must be a string or a list of text blocks")
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _assistant(content: list[Any], where: str, notes: Notes) -> dict[str, Any]:
    texts: list[str] = []
    thought: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            _only(block, at, ("type", "text"), notes)
            texts.append(string(block, "text", at))
        elif kind == "thinking":
            # The signature vouches for Anthropic's own thinking to Anthropic; a
            # Chat Completions backend has no use for it.
            _only(block, at, ("type", "thinking", "signature"), notes)
            thought.append(string(block, "thinking", at))
        elif kind == "tool_use":
            _only(block, at, ("type", "id", "name", "input"), notes)
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise invalid(at, "a tool_use block needs `id` and `name`")
            tool_input = block.get("input")
            if tool_input is None:
                tool_input = {}
            if not isinstance(tool_input, dict):
                raise invalid(f"{at}.input", "must be an object (the tool's arguments)")
            args = json.dumps(tool_input, separators=(",", ":"), ensure_ascii=False)
            fn = {"name": block["name"], "arguments": args}
            calls.append({"id": block["id"], "type": "function", "function": fn})
        else:
            notes.append(_unknown_block(at, kind))
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        out["tool_calls"] = calls
    if thought:
        out["reasoning_content"] = "".join(thought)
    return out


def _tool(tool: dict[str, Any], i: int, notes: Notes) -> dict[str, Any] | None:
    _only(tool, f"tools[{i}]", ("type", "name", "description", "input_schema"), notes)
    if tool.get("type") not in (None, "custom"):
        notes.append(
            (str(tool.get("type")), refuse(f"tools[{i}].type", "server tools have no equivalent"))
        )
        return None
    if tool.get("name") is None:
        raise invalid(f"tools[{i}].name", "is required")
    name = tool_name(tool["name"], f"tools[{i}].name")
    schema = tool.get("input_schema")
    schema = {} if schema is None else json_schema(schema, f"tools[{i}].input_schema")
    fn: dict[str, Any] = {"name": name, "parameters": schema}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: dict[str, Any], notes: Notes) -> dict[str, Any]:
    _only(choice, "tool_choice", ("type", "name", "disable_parallel_tool_use"), notes)
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


def _thinking(thinking: dict[str, Any], notes: Notes) -> str | None:
    _only(thinking, "thinking", ("type", "budget_tokens"), notes)
    kind = thinking.get("type")
    if kind == "disabled":
        return None
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and (isinstance(budget, bool) or not isinstance(budget, int)):
        # ``true`` is no number of tokens (Python's bool is an int: asked apart).
        raise invalid("thinking.budget_tokens", "must be an integer")
    if kind != "enabled" or not isinstance(budget, int) or budget < 1:
        why = "must be `{type: enabled, budget_tokens: N}` or `{type: disabled}` here"
        notes.append(("thinking", refuse("thinking", why)))
        return None
    return next((effort for bound, effort in _EFFORT if budget < bound), "high")


def _output_config(config: dict[str, Any], notes: Notes) -> dict[str, Any]:
    """Structured outputs: ``output_config.format``, a JSON schema the answer's text
    follows, is Chat's ``response_format`` ``json_schema``; the rest (``effort``) is noted."""
    _only(config, "output_config", ("format",), notes)
    fmt = config.get("format")
    if fmt is None:
        return {}
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        why = "must be `{type: json_schema, schema: {...}}` here"
        notes.append(("output_config.format", refuse("output_config.format", why)))
        return {}
    spec = {"name": "output", "schema": fmt["schema"]}
    return {"response_format": {"type": "json_schema", "json_schema": spec}}


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
        return self._message_start()

    def _message_start(self) -> bytes:
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


# --- native pass-through: the client and the backend both speak Messages ---------

#: Request headers that reach the provider as the client sent them on a native route.
NATIVE_HEADERS = ("anthropic-beta", "anthropic-version")


def with_history(raw: bytes, history: list[dict[str, Any]]) -> bytes:
    """``raw`` with a session's earlier turns (``{"role", "content"}``: system, user,
    assistant text) before the client's own: system turns lead the ``system`` prompt,
    the rest lead ``messages``. Unchanged when there are none."""
    if not history:
        return raw
    body = _object.decode(raw)
    system = [t["content"] for t in history if t["role"] == "system" and t["content"]]
    turns = [
        {"role": t["role"], "content": t["content"]}
        for t in history
        if t["role"] in ("user", "assistant") and t["content"]
    ]
    if system:
        blocks = [{"type": "text", "text": text} for text in system]
        own = body.get("system")
        if isinstance(own, str) and own:
            blocks.append({"type": "text", "text": own})
        elif isinstance(own, list):
            blocks.extend(own)
        body["system"] = blocks
    if turns:
        body["messages"] = [*turns, *body.get("messages", [])]
    return encoder.encode(body)


def _rewrite_blocks(content: Any, rewrite: Callable[[str], str]) -> Any:
    """A message's content with the text a person or a tool wrote rewritten; thinking
    blocks stay as they are (their signature vouches for them), so do images."""
    if isinstance(content, str):
        return rewrite(content)
    if not isinstance(content, list):
        return content
    out = []
    for block in content:
        if isinstance(block, dict):
            kind = block.get("type")
            if kind == "text" and isinstance(block.get("text"), str):
                block = {**block, "text": rewrite(block["text"])}
            elif kind == "tool_result":
                block = {**block, "content": _rewrite_blocks(block.get("content"), rewrite)}
            elif kind == "tool_use" and "input" in block:
                block = {**block, "input": rewrite_strings(block["input"], rewrite)}
        out.append(block)
    return out


def rewrite_steps(raw: bytes, rewrite: Callable[[str], str]) -> Generator[None, None, bytes]:
    """``raw`` with the input policies' rewrite applied to the text of ``system``, of
    text blocks, tool results and the string values of tool inputs, one message a
    step; the same bytes when nothing changed (so the provider's prompt cache sees
    the client's bytes)."""
    body = _object.decode(raw)
    changed = False
    system = body.get("system")
    if system is not None:
        new = _rewrite_blocks(system, rewrite)
        changed = new != system
        body["system"] = new
        yield
    messages = body.get("messages")
    if isinstance(messages, list):
        for i, m in enumerate(messages):
            if isinstance(m, dict) and "content" in m:
                new = _rewrite_blocks(m["content"], rewrite)
                if new != m["content"]:
                    messages[i] = {**m, "content": new}
                    changed = True
            yield
    return encoder.encode(body) if changed else raw


class NativeMessagesFramer(MessagesFramer):
    """A native stream: the provider's events go out as it sent them; what the output
    policies changed or held back goes out as events of the same block; the end
    (``message_delta``, ``message_stop``) only when the gateway ends the reply.

    Deltas without events (a reply the gateway made itself) are framed as
    :class:`MessagesFramer` frames them.
    """

    def __init__(self, message_id: str, model: str, created: int, view: object) -> None:
        super().__init__(message_id, model, created, view)
        self._started = False
        self._held: list[bytes] = []
        #: The provider's blocks open now.
        self._native_open: set[int] = set()

    def role(self) -> bytes:
        self._stream.go("role")
        return b""  # the provider's message_start, or the first delta's own

    def _begin(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        return self._message_start()

    def native(self, events: NativeEvents, released: ChunkDelta | None, *, same: bool) -> bytes:
        """The provider's events (``same``), or the text the output policies released
        from them, in their block."""
        kind = events.kind
        if kind == "message_start":
            self._started = True
            return events.raw
        if kind in ("message_delta", "message_stop"):
            self._held.append(events.raw)
            return b""
        if kind == "content_block_start":
            self._native_open.add(events.index)
            self._blocks = max(self._blocks, events.index + 1)
        elif kind == "content_block_stop":
            self._native_open.discard(events.index)
        out = self._begin()
        if same or released is None:
            return out + events.raw
        index = events.index
        if released.reasoning_content:
            out += _DELTA % (
                index,
                b"thinking_delta",
                b"thinking",
                encoder.encode(released.reasoning_content),
            )
        text = (released.content or "") + (released.refusal or "")
        if text:
            out += _DELTA % (index, b"text_delta", b"text", encoder.encode(text))
        for chunk in released.tool_calls or ():
            if chunk.function is not None and chunk.function.arguments:
                delta = {"type": "input_json_delta", "partial_json": chunk.function.arguments}
                out += self._event(b"content_block_delta", {"index": index, "delta": delta})
        return out

    def delta(self, delta: ChunkDelta, logprobs: msgspec.Raw | None = None) -> bytes:
        return self._begin() + super().delta(delta, logprobs)

    def close(self, finish_reason: str, usage: WireUsage) -> bytes:
        if self._held:
            self._stream.go("close")
            return b"".join(self._held)
        out = self._begin()
        out += b"".join(
            self._event(b"content_block_stop", {"index": i}) for i in sorted(self._native_open)
        )
        self._native_open.clear()
        return out + super().close(finish_reason, usage)


def collect(sse: bytes) -> bytes:
    """A Messages event stream as the one ``message`` object it adds up to (a client
    that did not stream gets what the stream said, signatures included)."""
    message: dict[str, Any] = {}
    blocks: dict[int, dict[str, Any]] = {}
    inputs: dict[int, list[str]] = {}
    for chunk in sse.split(b"\n\n"):
        data = next((ln[6:] for ln in chunk.split(b"\n") if ln.startswith(b"data: ")), None)
        if data is None:
            continue
        ev = _object.decode(data)
        kind = ev.get("type")
        if kind == "message_start":
            message = dict(ev.get("message") or {})
        elif kind == "content_block_start":
            blocks[ev["index"]] = dict(ev.get("content_block") or {})
        elif kind == "content_block_delta":
            block = blocks.setdefault(ev["index"], {})
            d = ev.get("delta") or {}
            dkind = d.get("type")
            if dkind == "text_delta":
                block["text"] = block.get("text", "") + d.get("text", "")
            elif dkind == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + d.get("thinking", "")
            elif dkind == "signature_delta":
                block["signature"] = block.get("signature", "") + d.get("signature", "")
            elif dkind == "input_json_delta":
                inputs.setdefault(ev["index"], []).append(d.get("partial_json", ""))
            elif dkind == "citations_delta":
                block.setdefault("citations", []).append(d.get("citation"))
        elif kind == "message_delta":
            message.update(ev.get("delta") or {})
            usage = {**message.get("usage", {}), **(ev.get("usage") or {})}
            message["usage"] = usage
    for index, parts in inputs.items():
        joined = "".join(parts)
        blocks[index]["input"] = _input(blocks[index].get("id", ""), joined) if joined else {}
    message["content"] = [blocks[i] for i in sorted(blocks)]
    return encoder.encode(message)


CODEC = Codec(
    kind="messages",
    ping=b'event: ping\ndata: {"type": "ping"}\n\n',
    decode=decode,
    # Its stream always reports the usage: the client need not ask.
    framer=lambda rid, model, created, view, _usage: MessagesFramer(rid, model, created, view),
    body=body,
    error=error_body,
    translated=translated,
    native=NativeSpec(
        headers=NATIVE_HEADERS,
        history=with_history,
        rewrite=rewrite_steps,
        framer=NativeMessagesFramer,
        collect=collect,
    ),
)
