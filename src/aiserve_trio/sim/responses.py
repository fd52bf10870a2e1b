"""The OpenAI Responses dialect: ``POST /v1/responses`` as OpenAI's Responses API answers it.

Requests need ``Authorization: Bearer`` (401 otherwise). Read: ``instructions`` (a
system message), ``input`` -- a string, or items: ``message`` (``user``,
``developer``, ``system``, ``assistant``; content a string or ``input_text`` /
``output_text`` / ``input_image`` parts), ``function_call`` and
``custom_tool_call`` (assistant tool calls; consecutive ones are one turn),
``function_call_output`` and ``custom_tool_call_output`` (tool messages),
``reasoning`` (skipped: its ``encrypted_content``, if any, must be one the sim
wrote, else a 400 ``invalid_encrypted_content``, as OpenAI refuses another
deployment's) -- ``tools`` of type ``function`` and the functions of a ``namespace``
tool, known as ``<namespace>__<function>`` (a ``sim-call:`` line names them so, and the
call comes back with its own ``name`` and the ``namespace``, as OpenAI's does and Codex
CLI routes its MCP tools by; other tools, e.g. ``web_search``, are offered to nobody),
``tool_choice`` (``none`` / ``auto`` / ``required`` / ``{"type": "function",
"name"}``), ``text.format`` (``json_schema`` / ``json_object``),
``reasoning.effort``, ``max_output_tokens``, ``include``, ``stream``. Any other
field (``store``, ``prompt_cache_key``, ``client_metadata``, ``parallel_tool_calls``,
``temperature``, ...) is accepted and echoed where the response object has it. The
reply is decided as chat's is (:mod:`.reply`, the ``sim-call:`` directive included).

``stream: true`` gives the typed events, each with its ``sequence_number``::

    response.created, response.in_progress          {"response": {... "status": "in_progress"}}
    reasoning (reasoning.effort):
        response.output_item.added                  {"item": {"type": "reasoning", ...}}
        response.reasoning_text.delta               per piece
        response.reasoning_text.done, response.output_item.done
                                                    (with ``encrypted_content`` when ``include``
                                                    has ``reasoning.encrypted_content``)
    a message:
        response.output_item.added                  {"item": {"type": "message", ...}}
        response.content_part.added                 {"part": {"type": "output_text", ...}}
        response.output_text.delta                  per piece
        response.output_text.done, response.content_part.done, response.output_item.done
    or a function call:
        response.output_item.added                  {"item": {"type": "function_call",
                                                     "call_id", "name", "arguments": ""}}
        response.function_call_arguments.delta      per piece
        response.function_call_arguments.done, response.output_item.done
    response.completed                              {"response": {... "usage"}}
    (response.incomplete, ``incomplete_details.reason: max_output_tokens``, when cut)

Otherwise one ``response`` object with the same items whole. ``usage`` is
``{"input_tokens", "input_tokens_details": {"cached_tokens"}, "output_tokens",
"output_tokens_details": {"reasoning_tokens"}, "total_tokens"}``. Errors are
OpenAI's envelope, ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import base64
from typing import Any

import msgspec

from .core import Prepared
from .dialect import DialectError, SimAsk
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
PATH = "/v1/responses"
#: What an ``encrypted_content`` the sim wrote starts with, before base64.
_SEAL = b"aiserve-sim reasoning\n"
#: ``include`` entry that puts ``encrypted_content`` on reasoning items.
ENCRYPTED = "reasoning.encrypted_content"


class _Text(msgspec.Struct):
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class _Reasoning(msgspec.Struct):
    effort: str | None = None
    summary: str | None = None


class _Request(msgspec.Struct):
    model: str = "sim-model"
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: _Text | None = None
    reasoning: _Reasoning | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    include: list[str] | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = False


_request = msgspec.json.Decoder(_Request)


def seal(text: str) -> str:
    """The ``encrypted_content`` of a reasoning item whose text is ``text`` (opaque to
    clients; the sim reads it back)."""
    return base64.b64encode(_SEAL + text.encode()).decode()


def _check_sealed(value: object, where: str) -> None:
    try:
        ok = isinstance(value, str) and base64.b64decode(value, validate=True).startswith(_SEAL)
    except ValueError:
        ok = False
    if not ok:
        raise DialectError(
            f"{where}.encrypted_content: the encrypted content could not be verified"
        )


def _parts(content: Any, where: str) -> str | list[ContentPart] | None:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise DialectError(f"{where}.content: must be a string or a list of parts")
    parts: list[ContentPart] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text"):
            parts.append(ContentPart(type="text", text=str(part.get("text", ""))))
        elif kind == "input_image":
            parts.append(ContentPart(type="image_url", image_url=str(part.get("image_url", ""))))
    return parts


def _output_text(output: Any) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "".join(str(p.get("text", "")) for p in output if isinstance(p, dict))
    return ""


def messages(req: _Request) -> list[SimMessage]:
    """The request's conversation as the sim's chat messages.

    Raises:
        DialectError: a message with another role, or a reasoning item's
            ``encrypted_content`` the sim did not write.
    """
    out: list[SimMessage] = []
    if req.instructions:
        out.append(SimMessage(role="system", content=req.instructions))
    if isinstance(req.input, str):
        out.append(SimMessage(role="user", content=req.input))
        return out
    calls: list[ToolCallIn] | None = None  # the assistant turn being built
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind in ("function_call", "custom_tool_call"):
            args = item.get("arguments") if kind == "function_call" else item.get("input")
            call = ToolCallIn(
                id=str(item.get("call_id", "")),
                function=FunctionCall(
                    name=qualified(item.get("namespace"), str(item.get("name", ""))),
                    arguments=str(args or ""),
                ),
            )
            if calls is None:
                calls = []
                out.append(SimMessage(role="assistant", tool_calls=calls))
            calls.append(call)
            continue
        calls = None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "developer", "system", "assistant"):
                raise DialectError(f"{where}.role: must be user, developer, system or assistant")
            out.append(SimMessage(role=str(role), content=_parts(item.get("content"), where)))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            out.append(
                SimMessage(
                    role="tool",
                    content=_output_text(item.get("output")),
                    tool_call_id=str(item.get("call_id", "")),
                )
            )
        elif kind == "reasoning" and item.get("encrypted_content") is not None:
            _check_sealed(item["encrypted_content"], where)
    return out


def _functions(req: _Request) -> list[tuple[str | None, str, dict[str, Any]]]:
    """The request's functions in order: (namespace, name, definition), the namespace
    ``None`` for a ``function`` tool, else the ``namespace`` tool's name it is in."""
    out: list[tuple[str | None, str, dict[str, Any]]] = []
    for t in req.tools or ():
        if t.get("type") == "function":
            out.append((None, str(t.get("name", "")), t))
        elif t.get("type") == "namespace" and isinstance(t.get("tools"), list):
            ns = str(t.get("name", ""))
            out.extend(
                (ns, str(f.get("name", "")), f)
                for f in t["tools"]
                if isinstance(f, dict) and f.get("type") == "function"
            )
    return out


def qualified(namespace: str | None, name: str) -> str:
    """The name the sim knows a function by (``sim-call:`` names it so): its own, or for
    one in a namespace the namespace's name, ``__`` and its own."""
    return f"{namespace}__{name}" if namespace else name


def _tools(req: _Request) -> list[Tool] | None:
    funcs = [
        Tool(
            function=FunctionDef(
                name=qualified(ns, name),
                description=t.get("description"),
                parameters=t.get("parameters"),
                strict=t.get("strict"),
            )
        )
        for ns, name, t in _functions(req)
    ]
    return funcs or None


def _split(req: _Request, known_as: str) -> tuple[str | None, str]:
    """(namespace, name) of the function the sim knows as ``known_as``; one the request
    does not offer keeps its name, with no namespace."""
    for ns, name, _ in _functions(req):
        if ns is not None and qualified(ns, name) == known_as:
            return ns, name
    return None, known_as


def _choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        if choice.get("type") == "function":
            return {"type": "function", "function": {"name": str(choice.get("name", ""))}}
        return "auto"
    return choice


def _format(text: _Text | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.get("type") not in ("json_schema", "json_object"):
        return None
    if fmt["type"] == "json_object":
        return ResponseFormat(type="json_object")
    return ResponseFormat(
        type="json_schema",
        json_schema=JsonSchemaFormat(
            name=str(fmt.get("name", "response")),
            schema=fmt.get("schema"),
            strict=fmt.get("strict"),
        ),
    )


def _event(name: str, seq: int, data: dict[str, Any]) -> bytes:
    body = _enc.encode({"type": name, "sequence_number": seq, **data})
    return b"event: " + name.encode() + b"\ndata: " + body + b"\n\n"


class ResponsesDialect:
    """OpenAI's Responses API (see the module docstring).

    The instance in the dialect table reads requests; each request is answered by an
    instance of its own (:attr:`SimAsk.render`), which numbers the stream's events and
    echoes the request in the ``response`` objects.
    """

    name = "responses"
    stream_type = b"text/event-stream"

    def __init__(self, req: _Request | None = None) -> None:
        self._req = req if req is not None else _Request()
        self._seq = 0

    def matches(self, method: str, path: str) -> bool:
        return method == "POST" and path == PATH

    def auth_error(self, headers: dict[str, str]) -> tuple[int, bytes] | None:
        if not headers.get("authorization", "").removeprefix("Bearer ").strip():
            why = "You didn't provide an API key (Authorization: Bearer)."
            return 401, self._error_body(why, "invalid_request_error", None)
        return None

    def read(self, path: str, query: str, body: bytes) -> SimAsk:
        req = _request.decode(body)
        if req.max_output_tokens is not None and req.max_output_tokens < 1:
            raise DialectError("max_output_tokens: must be at least 1")
        return SimAsk(
            model=req.model,
            messages=messages(req),
            stream=req.stream,
            max_tokens=req.max_output_tokens,
            tools=_tools(req),
            tool_choice=_choice(req.tool_choice),
            reasoning_effort=req.reasoning.effort if req.reasoning is not None else None,
            response_format=_format(req.text),
            render=ResponsesDialect(req),
        )

    def error(self, status: int, message: str) -> bytes:
        if "encrypted content" in message:
            return self._error_body(message, "invalid_request_error", "invalid_encrypted_content")
        kind = {401: "invalid_request_error", 429: "rate_limit_error"}.get(status)
        if kind is None:
            kind = "invalid_request_error" if status < 500 else "server_error"
        return self._error_body(message, kind, None)

    @staticmethod
    def _error_body(message: str, kind: str, code: str | None) -> bytes:
        return _enc.encode(
            {"error": {"message": message, "type": kind, "param": None, "code": code}}
        )

    # --- the reply ------------------------------------------------------------------

    def _next(self, name: str, data: dict[str, Any]) -> bytes:
        seq = self._seq
        self._seq += 1
        return _event(name, seq, data)

    def _response(self, ready: Prepared, model: str, status: str, **kw: Any) -> dict[str, Any]:
        req = self._req
        reasoning = req.reasoning or _Reasoning()
        text = req.text.format if req.text is not None and req.text.format else None
        out: dict[str, Any] = {
            "id": f"resp_sim_{ready.serial}",
            "object": "response",
            "created_at": 0,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": model,
            "output": [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": reasoning.effort, "summary": reasoning.summary},
            "store": req.store is not False,
            "temperature": req.temperature,
            "text": {"format": text or {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": None,
            "metadata": req.metadata or {},
        }
        return out | kw

    def _ids(self, ready: Prepared) -> tuple[str, str]:
        """(the reasoning item's id, the visible item's id)."""
        kind = "fc" if ready.script.tool is not None else "msg"
        return f"rs_sim_{ready.serial}", f"{kind}_sim_{ready.serial}"

    def _reasoning_item(self, ready: Prepared, shown: int, status: str) -> dict[str, Any]:
        text = "".join(ready.script.reasoning[:shown])
        item: dict[str, Any] = {
            "id": self._ids(ready)[0],
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
            "status": status,
        }
        if ENCRYPTED in (self._req.include or ()):
            item["encrypted_content"] = seal(text)
        return item

    def _visible_item(self, ready: Prepared, shown: int, status: str) -> dict[str, Any]:
        script = ready.script
        item_id = self._ids(ready)[1]
        text = script.visible_text(shown)
        if script.tool is not None:
            namespace, name = _split(self._req, script.tool.name)
            call = {
                "id": item_id,
                "type": "function_call",
                "call_id": script.tool.call_id,
                "name": name,
                "arguments": text,
                "status": status,
            }
            return call if namespace is None else call | {"namespace": namespace}
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {
            "id": item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [part] if shown or status != "in_progress" else [],
        }

    def _usage(self, ready: Prepared) -> dict[str, Any]:
        plan = ready.plan
        return {
            "input_tokens": ready.prompt_tokens,
            "input_tokens_details": {"cached_tokens": ready.cache_read},
            "output_tokens": plan.tokens,
            "output_tokens_details": {"reasoning_tokens": plan.reasoning},
            "total_tokens": ready.prompt_tokens + plan.tokens,
        }

    def _output(self, ready: Prepared, status: str) -> list[dict[str, Any]]:
        plan, script = ready.plan, ready.script
        r = len(script.reasoning)
        out = []
        if min(plan.tokens, r):
            shown = min(plan.tokens, r)
            # A reasoning item cut short is incomplete; one the answer followed is done.
            out.append(
                self._reasoning_item(ready, shown, status if plan.tokens <= r else "completed")
            )
        if plan.tokens > r or not r:
            out.append(self._visible_item(ready, max(0, plan.tokens - r), status))
        return out

    def _final(self, ready: Prepared, model: str) -> dict[str, Any]:
        cut = ready.script.finish_reason(ready.plan) == "length"
        status = "incomplete" if cut else "completed"
        return self._response(
            ready,
            model,
            status,
            output=self._output(ready, status),
            usage=self._usage(ready),
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
        )

    def opening(self, ready: Prepared, model: str) -> bytes:
        snapshot = self._response(ready, model, "in_progress")
        return self._next("response.created", {"response": snapshot}) + self._next(
            "response.in_progress", {"response": snapshot}
        )

    def _open_visible(self, ready: Prepared, index: int) -> bytes:
        item = self._visible_item(ready, 0, "in_progress")
        out = self._next("response.output_item.added", {"output_index": index, "item": item})
        if ready.script.tool is None:
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            at = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out += self._next("response.content_part.added", {**at, "part": part})
        return out

    def _close_reasoning(self, ready: Prepared, shown: int, status: str) -> bytes:
        item = self._reasoning_item(ready, shown, status)
        at = {"item_id": item["id"], "output_index": 0, "content_index": 0}
        text = item["content"][0]["text"]
        out = self._next("response.reasoning_text.done", {**at, "text": text})
        return out + self._next("response.output_item.done", {"output_index": 0, "item": item})

    def token(self, ready: Prepared, k: int) -> bytes:
        script = ready.script
        r = len(script.reasoning)
        rs_id, item_id = self._ids(ready)
        out = b""
        if k < r:
            if k == 0:
                item = self._reasoning_item(ready, 0, "in_progress")
                item.pop("encrypted_content", None)  # written when the reasoning is whole
                item["content"] = []
                out += self._next("response.output_item.added", {"output_index": 0, "item": item})
            at = {"item_id": rs_id, "output_index": 0, "content_index": 0}
            delta = {**at, "delta": script.reasoning[k]}
            return out + self._next("response.reasoning_text.delta", delta)
        index = 1 if r else 0
        if k == r:
            if r:
                out += self._close_reasoning(ready, r, "completed")
            out += self._open_visible(ready, index)
        piece = script.piece(k - r)
        if script.tool is not None:
            at = {"item_id": item_id, "output_index": index}
            return out + self._next(
                "response.function_call_arguments.delta", {**at, "delta": piece}
            )
        at = {"item_id": item_id, "output_index": index, "content_index": 0}
        return out + self._next(
            "response.output_text.delta", {**at, "delta": piece, "logprobs": []}
        )

    def closing(self, ready: Prepared, model: str) -> bytes:
        final = self._final(ready, model)
        plan, script = ready.plan, ready.script
        r = len(script.reasoning)
        out = b""
        if plan.tokens <= r and r:  # cut short while reasoning
            out += self._close_reasoning(ready, plan.tokens, final["status"])
        else:
            index = 1 if r else 0
            if plan.tokens == r:  # nothing visible was sent: the item still opens
                out += self._open_visible(ready, index)
            item = final["output"][-1]
            if script.tool is not None:
                at = {"item_id": item["id"], "output_index": index}
                done = {**at, "name": item["name"], "arguments": item["arguments"]}
                out += self._next("response.function_call_arguments.done", done)
            else:
                at = {"item_id": item["id"], "output_index": index, "content_index": 0}
                part = item["content"][0]
                out += self._next(
                    "response.output_text.done", {**at, "text": part["text"], "logprobs": []}
                )
                out += self._next("response.content_part.done", {**at, "part": part})
            out += self._next("response.output_item.done", {"output_index": index, "item": item})
        name = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return out + self._next(name, {"response": final})

    def whole(self, ready: Prepared, model: str) -> bytes:
        return _enc.encode(self._final(ready, model))
