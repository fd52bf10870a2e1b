"""OpenAI's Responses API (``POST /v1/responses``) as a codec at the pipeline's edge (sans-IO).

:func:`decode` turns a Responses request into the pipeline's Chat Completions
body: ``instructions`` becomes a system message, ``input`` items become messages
(consecutive ``function_call`` items one assistant message with parallel tool
calls, ``function_call_output`` a ``tool`` message, a ``reasoning`` item the next
assistant message's ``reasoning_content``), ``tools`` become function tools (the
functions of a ``namespace`` tool -- Codex CLI offers each MCP server's tools so --
each one under a flat name, ``<namespace>__<function>``, which a call in the reply is
turned back from: its own ``name`` and the ``namespace``, see :func:`namespaced`),
``text.format`` becomes ``response_format``, ``reasoning.effort`` becomes
``reasoning_effort``, ``max_output_tokens`` becomes ``max_completion_tokens``.
A field or item with no Chat Completions equivalent is refused with a 400
naming it. ``store``, ``truncation`` and ``previous_response_id`` are the
gateway's own business and go no further.

:class:`ResponsesFramer` turns what the response assembler releases into the
typed events, each numbered with ``sequence_number``::

    response.created, response.in_progress,
    per output item:  response.output_item.added,
        message:      response.content_part.added, response.output_text.delta...,
                      response.output_text.done, response.content_part.done
                      (a refusal: response.refusal.delta / .done in its own part)
        reasoning:    response.content_part.added, response.reasoning_text.delta...,
                      response.reasoning_text.done, response.content_part.done
        function_call: response.function_call_arguments.delta... / .done
        response.output_item.done
    response.completed (response.incomplete at max_output_tokens) or response.failed

Its states are tables: the stream's (``_STREAM``) and which output item a piece
of the reply belongs to (``_ITEM``: a piece of another item closes the open ones).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Generator
from typing import Any, Literal

import msgspec

from ..core.api import ChatCompletion, ChunkDelta, error_json
from ..core.api import Usage as WireUsage
from ..core.errors import BadRequest, GatewayError, UpstreamProtocolError
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
    json_schema,
    refuse,
    rewrite_strings,
    string,
    tool_name,
    web_url,
)

__all__ = ["CODEC", "ResponsesFramer", "ResponsesRequest", "decode"]


# --- the request --------------------------------------------------------------


class _Format(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema: msgspec.Raw = msgspec.Raw(b"null")
    strict: bool | None = None
    description: str | None = None


class _Text(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    format: _Format | None = None
    verbosity: str | None = None


class _Reasoning(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True, dict=True):
    """The fields of a Responses request this gateway understands. What has no Chat
    Completions equivalent (another field, item, part or tool key) is noted by
    :func:`decode` (:func:`notes`): carried untouched on a native route, refused by
    :func:`translated` on a translated one."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: _Text | None = None
    reasoning: _Reasoning | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    stream: bool = False
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    background: bool | None = None
    client_metadata: dict[str, Any] | None = None

    @functools.cached_property
    def dropped(self) -> tuple[str, ...]:
        """What the translation leaves out, by name (``X-Aiserve-Dropped``): see :data:`DROPPED`."""
        out = [name for name in DROPPED if _present(self, name)]
        for i, t in _tools(self):
            if _namespace(t):
                if t.get("description") is not None:
                    out.append(f"tools[{i}].description")
                out.extend(
                    f"tools[{i}].tools[{j}]:{f.get('type') if isinstance(f, dict) else None}"
                    for j, f in enumerate(t["tools"])
                    if not (isinstance(f, dict) and _function(f))
                )
            elif not _function(t):
                out.append(f"tools[{i}]:{t.get('type')}")
        if isinstance(self.input, list):
            out.extend(
                f"input[{i}].encrypted_content"
                for i, item in enumerate(self.input)
                if item.get("type") == "reasoning" and item.get("encrypted_content") is not None
            )
        return tuple(out)


#: Fields a Chat Completions upstream cannot honour and the answer means the same without:
#: dropped and named in ``X-Aiserve-Dropped`` (a reasoning item's ``encrypted_content``,
#: and tools other than ``function`` and ``namespace`` -- built-in, ``custom``, ... -- too,
#: as are a namespace's ``description`` and its tools other than ``function``: a tool
#: offered is the model's option, not part of what is asked; a ``tool_choice`` that
#: forces one is refused). What changes the answer's meaning is refused with a 400.
DROPPED = ("include", "reasoning.summary", "client_metadata")


def _present(req: ResponsesRequest, name: str) -> bool:
    if name == "reasoning.summary":
        return req.reasoning is not None and req.reasoning.summary is not None
    value = getattr(req, name)
    return value is not None and value != []


def _tools(req: ResponsesRequest) -> list[tuple[int, dict[str, Any]]]:
    return list(enumerate(req.tools or ()))


def _function(tool: dict[str, Any]) -> bool:
    return tool.get("type") == "function"


def _namespace(tool: dict[str, Any]) -> bool:
    """A ``namespace`` tool with its list of tools (:func:`decode` refuses one without)."""
    return tool.get("type") == "namespace" and isinstance(tool.get("tools"), list)


#: A tool name a Chat Completions backend takes (OpenAI's pattern): a flat name must be one.
_CHAT_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
#: What joins a namespace's name and its function's into the flat name.
SEPARATOR = "__"


def flat_name(namespace: str, name: str) -> str:
    """The name a Chat Completions backend knows a namespace's function by."""
    return f"{namespace}{SEPARATOR}{name}"


def namespaced(view: object) -> dict[str, tuple[str, str]]:
    """The flat names :func:`decode` gave the request's namespaced functions:
    flat name -> (namespace, the function's own name). A call of one in the reply goes
    back to the client under the function's own name, with its ``namespace``."""
    flat: dict[str, tuple[str, str]] = getattr(view, "_flat", _NONE)
    return flat


_NONE: dict[str, tuple[str, str]] = {}


#: ``reasoning.effort``'s values (OpenAI's).
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")

_request = msgspec.json.Decoder(ResponsesRequest)
_object = msgspec.json.Decoder(dict[str, Any])
_KNOWN = frozenset(ResponsesRequest.__struct_fields__)
Notes = list[BadRequest]


def notes(view: object) -> tuple[BadRequest, ...]:
    """What :func:`decode` found without a Chat Completions equivalent in ``view``."""
    return tuple(getattr(view, "_notes", ()))


def translated(view: object) -> object:
    """On a route whose backend speaks Chat Completions (or another provider's API):
    the view, or the first 400 for what it cannot carry.

    Raises:
        BadRequest: ``unsupported_field``, naming it.
    """
    for refusal in notes(view):
        raise refusal
    return view


def _note(found: Notes, param: str, why: str) -> None:
    found.append(refuse(param, why))


def _only(obj: dict[str, Any], where: str, allowed: tuple[str, ...], found: Notes) -> None:
    for key, value in obj.items():
        if key not in allowed and value is not None:
            _note(found, f"{where}.{key}", "has no equivalent; it is not sent anywhere")


#: Relayed under the same name.
_SAME = (
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "user",
    "metadata",
    "safety_identifier",
    "prompt_cache_key",
    "service_tier",
)


def decode(body: bytes) -> tuple[bytes, ResponsesRequest]:
    """A Responses request body as the pipeline's Chat Completions body, and the request.

    Raises:
        BadRequest: not JSON, a wrong type, or a field, item, part or tool with no
            equivalent (``unsupported_field``, ``param`` naming it).
    """
    try:
        req = _request.decode(body)
        top = _object.decode(body)
    except msgspec.MsgspecError as exc:
        raise decode_error(exc) from None
    found: Notes = []
    for key, value in top.items():
        if key not in _KNOWN and value is not None:
            _note(found, key, "has no equivalent on this gateway; it is not sent anywhere")
    if req.background:
        _note(found, "background", "has no equivalent: responses are served while the client waits")
    chat: dict[str, Any] = {"messages": _messages(req, found)}
    if req.model is not None:
        chat["model"] = req.model
    if req.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    for key in _SAME:
        value = getattr(req, key)
        if value is not None:
            chat[key] = value
    if req.max_output_tokens is not None:
        chat["max_completion_tokens"] = req.max_output_tokens
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= 20:
            raise invalid("top_logprobs", "must be between 0 and 20")
        chat["logprobs"] = True
        chat["top_logprobs"] = req.top_logprobs
    tools, flat = _chat_tools(req, found)
    if tools:
        chat["tools"] = tools
    if req.tool_choice is not None:
        choice = _tool_choice(req.tool_choice, found)
        if tools or not req.tools:
            chat["tool_choice"] = choice
        elif choice not in ("auto", "none"):  # every tool offered was dropped
            _note(found, "tool_choice", "asks for a tool call, and no `function` tool is offered")
    if req.text is not None:
        if req.text.format is not None and req.text.format.type != "text":
            chat["response_format"] = _format(req.text.format)
        if req.text.verbosity is not None:
            chat["verbosity"] = req.text.verbosity
    if req.reasoning is not None and req.reasoning.effort is not None:
        if req.reasoning.effort not in EFFORTS:
            raise invalid("reasoning.effort", f"must be one of {', '.join(EFFORTS)}")
        chat["reasoning_effort"] = req.reasoning.effort
    req._notes = found  # type: ignore[attr-defined]  # a dict=True Struct: not a field
    if flat:
        req._flat = flat  # type: ignore[attr-defined]  # as _notes
    return encoder.encode(chat), req


def redacted_steps(
    view: ResponsesRequest, rewrite: Callable[[str], str], metadata: dict[str, str] | None
) -> Generator[None, None, ResponsesRequest]:
    """The request as the reply echoes it on a route whose input policies take something
    out of text (issue 51, item 2): ``instructions``, ``user``, the tools' and
    ``text.format``'s strings through ``rewrite``, ``metadata`` as the route stored it --
    what was sent, not what the client wrote. One field (one tool) a step."""
    changes: dict[str, Any] = {"metadata": metadata}
    if view.instructions is not None:
        changes["instructions"] = rewrite(view.instructions)
        yield
    if view.user is not None:
        changes["user"] = rewrite(view.user)
    if view.tools:
        tools = []
        for tool in view.tools:
            tools.append(rewrite_strings(tool, rewrite))
            yield
        changes["tools"] = tools
    fmt = view.text.format if view.text is not None else None
    if view.text is not None and fmt is not None:
        schema = fmt.schema
        if schema != msgspec.Raw(b"null"):
            schema = msgspec.Raw(encoder.encode(rewrite_strings(_any.decode(schema), rewrite)))
        fmt = msgspec.structs.replace(
            fmt,
            name=rewrite(fmt.name) if fmt.name is not None else None,
            description=rewrite(fmt.description) if fmt.description is not None else None,
            schema=schema,
        )
        changes["text"] = msgspec.structs.replace(view.text, format=fmt)
        yield
    out = msgspec.structs.replace(view, **changes)
    out._notes = notes(view)  # type: ignore[attr-defined]  # see decode
    if namespaced(view):
        out._flat = namespaced(view)  # type: ignore[attr-defined]  # see decode
    return out


_any = msgspec.json.Decoder()


def _format(f: _Format) -> dict[str, Any]:
    if f.type == "json_object":
        return {"type": "json_object"}
    if f.name is None or f.schema == msgspec.Raw(b"null"):
        raise invalid("text.format", "of type `json_schema` needs `name` and `schema`")
    spec: dict[str, Any] = {"name": f.name, "schema": f.schema}
    if f.strict is not None:
        spec["strict"] = f.strict
    if f.description is not None:
        spec["description"] = f.description
    return {"type": "json_schema", "json_schema": spec}


def _chat_tools(
    req: ResponsesRequest, found: Notes
) -> tuple[list[dict[str, Any]], dict[str, tuple[str, str]]]:
    """The Chat Completions tools of the request's ``function`` tools and of the functions
    of its ``namespace`` tools, in order, and the flat names given the latter.

    Raises:
        BadRequest: a tool with a bad name or schema, a namespace without a name or a
            list of tools. A flat name a Chat backend cannot take (over 64 characters,
            other characters than ``[a-zA-Z0-9_-]``) or that another tool has already is
            noted: refused on a translated route only (a native one sends the namespace).
    """
    tools: list[dict[str, Any]] = []
    flat: dict[str, tuple[str, str]] = {}
    # Who has each name the backend sees: the plain functions first, whatever their place.
    taken = {
        t["name"]: f"tools[{i}]"
        for i, t in _tools(req)
        if _function(t) and isinstance(t.get("name"), str)
    }
    for i, t in _tools(req):
        if _function(t):
            tools.append(_tool(t, f"tools[{i}]", found))
            continue
        if t.get("type") != "namespace":
            continue
        where = f"tools[{i}]"
        _only(t, where, ("type", "name", "description", "tools"), found)
        space = t.get("name")
        if not isinstance(space, str) or not space:
            raise invalid(f"{where}.name", "must be a non-empty string")
        if not isinstance(t.get("tools"), list):
            raise invalid(f"{where}.tools", "must be a list of tools")
        for j, f in enumerate(t["tools"]):
            at = f"{where}.tools[{j}]"
            if not isinstance(f, dict):
                raise invalid(at, "must be a tool object")
            if not _function(f):
                continue  # named in ``dropped``
            tool = _tool(f, at, found)
            name = tool["function"]["name"]
            known_as = flat_name(space, name)
            if not _CHAT_NAME.fullmatch(known_as):
                found.append(
                    invalid(
                        f"{at}.name",
                        f"`{name}` of namespace `{space}` would reach the model as "
                        f"`{known_as}`, and a Chat Completions backend takes a tool name "
                        "of 1 to 64 letters, digits, `_` or `-` only",
                    )
                )
                continue
            if known_as in taken:
                found.append(
                    invalid(
                        f"{at}.name",
                        f"`{name}` of namespace `{space}` would reach the model as "
                        f"`{known_as}`, the name `{taken[known_as]}` has already",
                    )
                )
                continue
            taken[known_as] = at
            flat[known_as] = (space, name)
            tool["function"]["name"] = known_as
            tools.append(tool)
    return tools, flat


def _tool(tool: dict[str, Any], where: str, found: Notes) -> dict[str, Any]:
    fn: dict[str, Any] = {}
    for key in tool:
        if key not in ("type", "name", "description", "parameters", "strict"):
            _note(found, f"{where}.{key}", "has no equivalent; it is not sent anywhere")
            continue
        if key != "type" and tool[key] is not None:
            fn[key] = tool[key]
    if fn.get("name") is None:
        raise invalid(f"{where}.name", "is required")
    tool_name(fn["name"], f"{where}.name")
    if fn.get("parameters") is not None:
        json_schema(fn["parameters"], f"{where}.parameters")
    return {"type": "function", "function": fn}


def _tool_choice(choice: str | dict[str, Any], found: Notes) -> str | dict[str, Any]:
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise invalid("tool_choice", "must be `none`, `auto`, `required` or a function")
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        _note(found, "tool_choice", "may name a function only (`{type: function, name}`)")
        return "auto"
    name = choice["name"]
    space = choice.get("namespace")
    if space is not None:
        if not isinstance(space, str):
            raise invalid("tool_choice.namespace", "must be a string")
        name = flat_name(space, name)  # as the namespace's function was offered
    return {"type": "function", "function": {"name": name}}


def _messages(req: ResponsesRequest, found: Notes) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        out.append({"role": "user", "content": req.input})
        return out
    # The assistant turn being built: reasoning, text and function calls of one
    # model reply arrive as separate items.
    turn: dict[str, Any] | None = None
    thought: list[str] = []
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "reasoning":
            thought.append(_reasoning_text(item, where, found))
            continue
        if kind == "function_call":
            if turn is None:
                turn = {"role": "assistant", "content": None}
                out.append(turn)
            turn.setdefault("tool_calls", []).append(_call(item, where, found))
        elif kind == "message" and item.get("role") == "assistant":
            turn = {"role": "assistant", **_content(item, where, found, assistant=True)}
            out.append(turn)
        elif kind == "message":
            turn = None
            role = item.get("role")
            if role not in ("user", "system", "developer"):
                raise invalid(
                    f"{where}.role", "must be `user`, `assistant`, `system` or `developer`"
                )
            out.append({"role": role, **_content(item, where, found, assistant=False)})
        elif kind == "function_call_output":
            turn = None
            out.append(_output(item, where, found))
        else:
            _note(found, f"{where}.type", f"`{kind}` items have no equivalent")
            continue
        if thought and turn is not None:
            turn["reasoning_content"] = "".join(thought)
            thought = []
    if thought:
        raise invalid(
            f"input[{len(req.input) - 1}]", "a reasoning item must precede the reply it led to"
        )
    return out


def _reasoning_text(item: dict[str, Any], where: str, found: Notes) -> str:
    _only(item, where, ("type", "id", "summary", "content", "status", "encrypted_content"), found)
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise invalid(f"{where}.content", "must be a list")
    return "".join(
        string(p, "text", f"{where}.content[{j}]") if isinstance(p, dict) else ""
        for j, p in enumerate(parts)
    )


def _call(item: dict[str, Any], where: str, found: Notes) -> dict[str, Any]:
    _only(item, where, ("type", "id", "call_id", "name", "namespace", "arguments", "status"), found)
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise invalid(f"{where}.{key}", "must be a string")
    name = item["name"]
    space = item.get("namespace")
    if space is not None:
        if not isinstance(space, str):
            raise invalid(f"{where}.namespace", "must be a string")
        name = flat_name(space, name)  # the call as the backend made it
    fn = {"name": name, "arguments": item["arguments"]}
    return {"id": item["call_id"], "type": "function", "function": fn}


def _output(item: dict[str, Any], where: str, found: Notes) -> dict[str, Any]:
    _only(item, where, ("type", "id", "call_id", "output", "status"), found)
    if not isinstance(item.get("call_id"), str):
        raise invalid(f"{where}.call_id", "must be a string")
    output = item.get("output")
    if isinstance(output, list):
        texts = []
        for j, part in enumerate(output):
            if not isinstance(part, dict) or part.get("type") != "input_text":
                _note(found, f"{where}.output[{j}]", "a tool's output may hold text only")
                continue
            texts.append(string(part, "text", f"{where}.output[{j}]"))
        output = "".join(texts)
    if not isinstance(output, str):
        raise invalid(f"{where}.output", "must be a string or a list of input_text parts")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def _content(item: dict[str, Any], where: str, found: Notes, *, assistant: bool) -> dict[str, Any]:
    _only(item, where, ("type", "id", "role", "content", "status"), found)
    content = item.get("content")
    if isinstance(content, str):
        return {"content": content}
    if not isinstance(content, list):
        raise invalid(f"{where}.content", "must be a string or a list of parts")
    parts: list[dict[str, Any]] = []
    refusal: list[str] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text"):
            _only(part, at, ("type", "text", "annotations", "logprobs"), found)
            if part.get("annotations"):
                _note(found, f"{at}.annotations", "have no equivalent")
            parts.append({"type": "text", "text": string(part, "text", at)})
        elif kind == "refusal" and assistant:
            refusal.append(string(part, "refusal", at))
        elif kind == "input_image" and not assistant:
            _only(part, at, ("type", "image_url", "detail"), found)
            url = web_url(part.get("image_url"), f"{at}.image_url", data=True)
            parts.append(image_url(url, part.get("detail")))
        elif kind == "input_file" and not assistant:
            _only(part, at, ("type", "file_data", "filename", "file_id"), found)
            file = {k: part[k] for k in ("file_data", "filename", "file_id") if part.get(k)}
            parts.append({"type": "file", "file": file})
        else:
            _note(found, f"{at}.type", f"`{kind}` parts have no equivalent here")
    out: dict[str, Any] = {}
    if assistant:
        # An assistant's text is one string: every backend reads that.
        out["content"] = "".join(p["text"] for p in parts) if parts or not refusal else None
        if refusal:
            out["refusal"] = "".join(refusal)
    else:
        out["content"] = parts
    return out


# --- the reply ------------------------------------------------------------------


def _status(finish_reason: str) -> tuple[str, dict[str, str] | None]:
    """The response's status and ``incomplete_details`` for a Chat Completions finish."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def _usage(usage: WireUsage) -> dict[str, Any]:
    prompt, completion, cached, reasoning = counts(usage)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": detail(usage.prompt_tokens_details, "cache_write_tokens"),
        },
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }


def _response(
    response_id: str,
    created: int,
    model: str,
    view: ResponsesRequest,
    status: str,
    output: list[dict[str, Any]],
    *,
    usage: dict[str, Any] | None = None,
    incomplete: dict[str, str] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    fmt: Any = {"type": "text"}
    if view.text is not None and view.text.format is not None:
        fmt = view.text.format
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": error,
        "incomplete_details": incomplete,
        "instructions": view.instructions,
        "max_output_tokens": view.max_output_tokens,
        "model": model,
        "output": output,
        "output_text": "".join(
            c["text"]
            for item in output
            if item["type"] == "message"
            for c in item["content"]
            if c["type"] == "output_text"
        ),
        "parallel_tool_calls": view.parallel_tool_calls is not False,
        "previous_response_id": view.previous_response_id,
        "reasoning": {"effort": view.reasoning.effort if view.reasoning else None, "summary": None},
        "store": view.store is not False,
        "temperature": view.temperature,
        "text": {"format": fmt},
        "tool_choice": view.tool_choice if view.tool_choice is not None else "auto",
        "tools": view.tools or [],
        "top_p": view.top_p,
        "truncation": view.truncation or "disabled",
        "usage": usage,
        "user": view.user,
        "metadata": view.metadata or {},
    }


def _ids(response_id: str) -> str:
    return response_id.removeprefix("resp_")


def body(completion: ChatCompletion, view: object) -> bytes:
    """The ``response`` object of a reply the client did not stream."""
    assert isinstance(view, ResponsesRequest)
    choice = completion.choices[0]
    msg = choice.message
    base = _ids(completion.id)
    output: list[dict[str, Any]] = []
    status, incomplete = _status(choice.finish_reason or "stop")
    if isinstance(msg.reasoning_content, str) and msg.reasoning_content:
        text = msg.reasoning_content
        output.append(_reasoning_item(f"rs_{base}{len(output):02x}", text, "completed"))
    content: list[dict[str, Any]] = []
    if msg.content:
        logprobs = (
            choice.logprobs.content if not isinstance(choice.logprobs, msgspec.UnsetType) else []
        )
        content.append(_text_part(msg.content, logprobs))
    if isinstance(msg.refusal, str):
        content.append({"type": "refusal", "refusal": msg.refusal})
    if content:
        output.append(_message_item(f"msg_{base}{len(output):02x}", content, "completed"))
    if not isinstance(msg.tool_calls, msgspec.UnsetType):
        flat = namespaced(view)
        for call in msg.tool_calls:
            item_id = f"fc_{base}{len(output):02x}"
            output.append(
                _call_item(
                    item_id, call.id, call.function.name, call.function.arguments, "completed", flat
                )
            )
    if incomplete and output:
        # What was still being written when the reply stopped, as a stream closes it.
        last = output[-1]["type"]
        for item in reversed(output):
            if item["type"] != last:
                break
            item["status"] = "incomplete"
    response = _response(
        completion.id,
        completion.created,
        completion.model,
        view,
        status,
        output,
        usage=_usage(completion.usage),
        incomplete=incomplete,
    )
    return encoder.encode(response)


def _text_part(text: str, logprobs: list[Any]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _message_item(item_id: str, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def _call_item(
    item_id: str,
    call_id: str,
    name: str,
    args: str,
    status: str,
    flat: dict[str, tuple[str, str]] = _NONE,
) -> dict[str, Any]:
    """A ``function_call`` item; a call of a namespace's function (``name`` one of the
    request's flat names, ``flat``) under the function's own name, with its ``namespace``."""
    item: dict[str, Any] = {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
    }
    if name in flat:
        item["namespace"], item["name"] = flat[name]
    item["arguments"] = args
    item["status"] = status
    return item


#: The output item each kind of piece belongs to; a piece of another item closes the open ones.
_ITEM = {"reasoning": "reasoning", "text": "message", "refusal": "message", "call": "function_call"}
#: The content part a piece of a message goes into, and the events of that part.
_PART = {
    "text": ("output_text", b"response.output_text.delta", b"response.output_text.done", "text"),
    "refusal": ("refusal", b"response.refusal.delta", b"response.refusal.done", "refusal"),
}


_TEXT_DELTA = (
    b'event: response.output_text.delta\ndata: {"item_id":"%s","output_index":%d,'
    b'"content_index":%d,"delta":%s,"logprobs":[],"type":"response.output_text.delta",'
    b'"sequence_number":%d}\n\n'
)


class _Item:
    __slots__ = ("call", "id", "index", "kind", "name", "part", "parts", "text")

    def __init__(self, kind: str, item_id: str, index: int) -> None:
        self.kind = kind
        self.id = item_id
        self.index = index
        #: The message's finished parts; the open part's kind ("text" / "refusal").
        self.parts: list[dict[str, Any]] = []
        self.part: str | None = None
        #: The open part's (or the reasoning's, or the arguments') text so far.
        self.text: list[str] = []
        self.call = ""
        self.name = ""


class ResponsesFramer:
    """One streamed response's events; see the module docstring."""

    def __init__(self, response_id: str, model: str, created: int, view: object) -> None:
        if not isinstance(view, ResponsesRequest):  # a failure before the request was read
            view = ResponsesRequest(input="")
        self._id = response_id
        self._base = _ids(response_id)
        self.model = model
        self._created = created
        self._view = view
        self._flat = namespaced(view)
        self._stream = Stream()
        self._seq = 0
        self._items: list[_Item] = []
        #: The open items: one, or several function calls (parallel calls).
        self._open: list[_Item] = []
        self._calls: dict[int, _Item] = {}
        #: The closed items by output index.
        self._done: dict[int, dict[str, Any]] = {}
        self._logprobs: list[Any] = []

    def _event(self, name: bytes, fields: dict[str, Any]) -> bytes:
        fields["type"] = name.decode()
        fields["sequence_number"] = self._seq
        self._seq += 1
        return event(name, encoder.encode(fields))

    def _snapshot(self, status: str, **kw: Any) -> dict[str, Any]:
        output = [item for _, item in sorted(self._done.items())]
        return _response(self._id, self._created, self.model, self._view, status, output, **kw)

    def role(self) -> bytes:
        """``response.created`` and ``response.in_progress``."""
        self._stream.go("role")
        snapshot = msgspec.Raw(encoder.encode(self._snapshot("in_progress")))  # once, for both
        return self._event(b"response.created", {"response": snapshot}) + (
            self._event(b"response.in_progress", {"response": snapshot})
        )

    def delta(self, delta: ChunkDelta, logprobs: msgspec.Raw | None = None) -> bytes:
        self._stream.go("delta")
        out = b""
        if delta.reasoning_content:
            out += self._piece("reasoning", delta.reasoning_content)
        if delta.content:
            entries = _logprob_entries(logprobs)
            out += self._piece("text", delta.content, entries)
        if delta.refusal:
            out += self._piece("refusal", delta.refusal)
        for chunk in delta.tool_calls or ():
            out += self._call(
                chunk.index,
                chunk.id,
                chunk.function.name if chunk.function else None,
                chunk.function.arguments if chunk.function else None,
            )
        return out

    def _switch(self, kind: str) -> tuple[bytes, _Item | None]:
        """Close the open items unless ``kind`` belongs to them; the open one it joins."""
        if self._open and self._open[0].kind == _ITEM[kind]:
            return b"", self._open[-1]
        out = b"".join(self._close_item(item) for item in self._open)
        self._open = []
        return out, None

    def _open_item(self, kind: str, prefix: str, item: dict[str, Any]) -> tuple[bytes, _Item]:
        index = len(self._items)
        opened = _Item(kind, f"{prefix}_{self._base}{index:02x}", index)
        self._items.append(opened)
        self._open.append(opened)
        item["id"] = opened.id
        return self._event(
            b"response.output_item.added", {"output_index": index, "item": item}
        ), opened

    def _piece(self, kind: str, text: str, logprobs: list[Any] | None = None) -> bytes:
        out, item = self._switch(kind)
        if item is None:
            if kind == "reasoning":
                added, item = self._open_item(
                    "reasoning", "rs", _reasoning_item("", "", "in_progress")
                )
                part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
                out += added + self._event(
                    b"response.content_part.added", self._at(item, part=part)
                )
                item.part = "reasoning"
            else:
                added, item = self._open_item(
                    "message", "msg", _message_item("", [], "in_progress")
                )
                out += added
        if kind == "reasoning":
            item.text.append(text)
            return out + self._event(b"response.reasoning_text.delta", self._at(item, delta=text))
        if item.part != kind:
            out += self._close_part(item)
            ptype, _, _, key = _PART[kind]
            item.part = kind
            blank: dict[str, Any] = {"type": ptype, key: ""}
            if ptype == "output_text":
                blank |= {"annotations": [], "logprobs": []}
            out += self._event(b"response.content_part.added", self._at(item, part=blank))
        item.text.append(text)
        if kind == "text" and not logprobs:
            return out + self._text_delta(item, text)
        fields = self._at(item, delta=text)
        if kind == "text":
            fields["logprobs"] = logprobs or []
            self._logprobs.extend(logprobs or ())
        return out + self._event(_PART[kind][1], fields)

    def _text_delta(self, item: _Item, text: str) -> bytes:
        """``response.output_text.delta``: the event of nearly every token, made from a template."""
        seq = self._seq
        self._seq += 1
        return _TEXT_DELTA % (
            item.id.encode(),
            item.index,
            len(item.parts),
            encoder.encode(text),
            seq,
        )

    def _at(self, item: _Item, **fields: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"item_id": item.id, "output_index": item.index}
        if item.kind != "function_call":
            out["content_index"] = len(item.parts)
        return out | fields

    def _call(self, index: int, call_id: str | None, name: str | None, args: str | None) -> bytes:
        item = self._calls.get(index)
        out = b""
        if item is None or item not in self._open:
            out, _ = self._switch("call")
            if item is None:
                shell = _call_item("", call_id or "", name or "", "", "in_progress", self._flat)
                added, item = self._open_item("function_call", "fc", shell)
                out += added
                self._calls[index] = item
                item.call, item.name = call_id or "", name or ""
                name = None
            else:  # a fragment of a call already closed: it cannot be reopened
                raise UpstreamProtocolError(
                    f"the model backend interleaved tool call {index} with other output"
                )
        if call_id:
            item.call = call_id
        if name:
            item.name += name
        if args:
            item.text.append(args)
            out += self._event(
                b"response.function_call_arguments.delta", self._at(item, delta=args)
            )
        return out

    def _close_part(self, item: _Item) -> bytes:
        if item.part is None:
            return b""
        text = "".join(item.text)
        item.text = []
        if item.part == "reasoning":
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
            done = self._event(b"response.reasoning_text.done", self._at(item, text=text))
        else:
            ptype, _, done_name, key = _PART[item.part]
            part = {"type": ptype, key: text}
            fields = self._at(item, **{key: text})
            if ptype == "output_text":
                part = _text_part(text, self._logprobs)
                fields["logprobs"] = self._logprobs
                self._logprobs = []
            done = self._event(done_name, fields)
        done += self._event(b"response.content_part.done", self._at(item, part=part))
        item.parts.append(part)
        item.part = None
        return done

    def _close_item(self, item: _Item, status: str = "completed") -> bytes:
        out = b""
        if item.kind == "function_call":
            args = "".join(item.text)
            out = self._event(
                b"response.function_call_arguments.done", self._at(item, arguments=args)
            )
            whole = _call_item(item.id, item.call, item.name, args, status, self._flat)
        else:
            out = self._close_part(item)
            if item.kind == "reasoning":
                whole = _reasoning_item(item.id, item.parts[0]["text"], status)
            else:
                whole = _message_item(item.id, item.parts, status)
        self._done[item.index] = whole
        return out + self._event(
            b"response.output_item.done", {"output_index": item.index, "item": whole}
        )

    def close(self, finish_reason: str, usage: WireUsage) -> bytes:
        """Close the open items; ``response.completed`` (or ``response.incomplete``)."""
        self._stream.go("close")
        status, incomplete = _status(finish_reason)
        item_status = "incomplete" if incomplete else "completed"
        out = b"".join(self._close_item(item, item_status) for item in self._open)
        self._open = []
        final = self._snapshot(status, usage=_usage(usage), incomplete=incomplete)
        name = b"response.completed" if status == "completed" else b"response.incomplete"
        return out + self._event(name, {"response": final})

    def fail(self, err: GatewayError) -> bytes:
        """``response.failed``: the response so far, and the error (naming a stage that expired)."""
        self._stream.go("fail")
        error = {"code": err.code or err.type, "message": described(err)}
        return self._event(b"response.failed", {"response": self._snapshot("failed", error=error)})


class _LogprobsContent(msgspec.Struct):
    content: list[Any] | None = None


_logprobs_decoder = msgspec.json.Decoder(_LogprobsContent)


def _logprob_entries(raw: msgspec.Raw | None) -> list[Any]:
    if raw is None:
        return []
    try:
        return _logprobs_decoder.decode(raw).content or []
    except msgspec.DecodeError:
        return []


def error_body(err: GatewayError) -> tuple[int, bytes]:
    """The OpenAI error envelope, as on chat (the Responses API uses it too)."""
    return err.status, error_json(err)


CODEC = Codec(
    kind="responses",
    ping=b": ping\n\n",
    decode=decode,
    # Its stream always reports the usage: the client need not ask.
    framer=lambda rid, model, created, view, _usage: ResponsesFramer(rid, model, created, view),
    body=body,
    error=error_body,
    translated=translated,
)
