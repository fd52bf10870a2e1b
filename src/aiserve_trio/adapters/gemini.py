"""The ``gemini`` adapter: Google's Gemini API (``generateContent``), streamed.

``POST {base_url}/v1beta/models/{model}:streamGenerateContent?alt=sse`` with
``x-goog-api-key: $<api_key_env>``; the stream is decoded by ``gemini_stream.py``.
The chat request is translated (pure: :func:`gemini_body`):

======================================  ===============================================
chat request                            Gemini
======================================  ===============================================
``system`` / ``developer`` messages     ``systemInstruction.parts[].text``
``user`` text, ``text`` parts           ``contents[]`` ``role: user``, ``parts[].text``
``image_url`` parts (``data:`` URLs)    ``parts[].inlineData`` (``mimeType``, ``data``)
``assistant`` content, ``tool_calls``   ``role: model``, ``text`` and ``functionCall``
                                        (``name``, ``args``) parts
``tool`` messages                       ``role: user``, ``functionResponse`` (the call's
                                        name, ``response: {"result": content}``)
``tools`` (functions)                   ``tools[].functionDeclarations[]``
``tool_choice`` auto/required/none/fn   ``toolConfig.functionCallingConfig.mode``
                                        ``AUTO``/``ANY``/``NONE``/``ANY`` + allowed name
``max_tokens``, ``temperature``,        ``generationConfig.maxOutputTokens``,
``top_p``, ``stop``                     ``temperature``, ``topP``, ``stopSequences``
======================================  ===============================================

An image by ``http(s)`` URL is refused (Gemini takes inline data or its own file
URIs, with a MIME type the URL does not give). Errors: 429 and 5xx are retried
before the first token; a 400 ``INVALID_ARGUMENT`` is the client's, and one about
the token count is ``context_length_exceeded``.
"""

from __future__ import annotations

import random
from typing import Any
from urllib.parse import quote

import msgspec

from ..core.errors import BadRequest, GatewayError, UpstreamStatusError
from ..core.messages import Message
from ..observability.events import NULL_HOOK, UpstreamHook
from .base import InferenceRequest
from .gemini_stream import GeminiStreamDecoder
from .native import (
    TRANSLATED,
    Headers,
    Image,
    NativeAdapter,
    StreamDecoder,
    content_parts,
    error_fields,
    one_choice,
    parse_arguments,
    read_tools,
)
from .settings import GeminiAdapterConfig

__all__ = ["GeminiAdapter", "gemini_body"]

_enc = msgspec.json.Encoder()


def _inline(image: Image, where: str) -> dict[str, Any]:
    if not image.data:
        raise BadRequest(f"`{where}`: Gemini takes images as base64 data: URLs", param=where)
    return {"inlineData": {"mimeType": image.media, "data": image.data}}


def _text(text: str) -> dict[str, Any]:
    return {"text": text}


def _contents(messages: list[Message]) -> tuple[list[str], list[dict[str, Any]]]:
    system: list[str] = []
    contents: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool call id -> function name, for the responses
    for i, m in enumerate(messages):
        if m.role in ("system", "developer"):
            system.append(m.text())
            continue
        if m.role == "tool":
            name = names.get(m.tool_call_id or "", m.name or "")
            role = "user"
            parts = [{"functionResponse": {"name": name, "response": {"result": m.text()}}}]
        elif m.role in ("user", "assistant"):
            role = "user" if m.role == "user" else "model"
            parts = content_parts(m, i, "Gemini", _text, _inline)
            for k, call in enumerate(m.tool_calls or []):
                names[call.id] = call.function.name
                where = f"messages[{i}].tool_calls[{k}].function.arguments"
                args = parse_arguments(call.function.arguments, where)
                parts.append({"functionCall": {"name": call.function.name, "args": args}})
        else:
            raise BadRequest(
                f"`messages[{i}].role`: {m.role!r} cannot be sent to Gemini",
                param=f"messages[{i}].role",
            )
        if contents and contents[-1]["role"] == role:
            contents[-1]["parts"].extend(parts)
        else:
            contents.append({"role": role, "parts": parts})
    return system, contents


def _tool_config(request: InferenceRequest) -> dict[str, Any] | None:
    choice = request.tool_choice
    if choice is None or choice == "auto":
        return None
    if choice in ("required", "none"):
        return {"functionCallingConfig": {"mode": "ANY" if choice == "required" else "NONE"}}
    return {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": [choice]}}


def gemini_body(request: InferenceRequest) -> bytes:
    """The ``generateContent`` body for ``request`` (see the module docstring's table).

    Raises:
        BadRequest: what Gemini cannot be told (a non-JSON tool call's arguments, an
            image by URL, a role it does not have).
    """
    system, contents = _contents(request.messages)
    body: dict[str, Any] = {"contents": contents}
    if any(system):
        body["systemInstruction"] = {"parts": [{"text": s} for s in system if s]}
    tools = read_tools(request)
    if tools is not None:
        declarations = []
        for name, description, params in tools:
            fn: dict[str, Any] = {"name": name}
            if description:
                fn["description"] = description
            if params is not None:
                fn["parameters"] = params
            declarations.append(fn)
        body["tools"] = [{"functionDeclarations": declarations}]
    config = _tool_config(request)
    if config is not None:
        body["toolConfig"] = config
    generation: dict[str, Any] = {}
    if request.max_tokens is not None:
        generation["maxOutputTokens"] = request.max_tokens
    if request.temperature is not None:
        generation["temperature"] = request.temperature
    if request.top_p is not None:
        generation["topP"] = request.top_p
    if request.stop:
        generation["stopSequences"] = request.stop
    if generation:
        body["generationConfig"] = generation
    return _enc.encode(body)


class GeminiAdapter(NativeAdapter):
    """Streams Gemini replies as chat deltas."""

    capabilities = TRANSLATED

    def __init__(
        self,
        name: str,
        config: GeminiAdapterConfig,
        *,
        hook: UpstreamHook = NULL_HOOK,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(name, config, hook=hook, rng=rng)

    def default_base_url(self) -> str:
        return "https://generativelanguage.googleapis.com"

    def auth_headers(self) -> Headers:
        out = [(b"accept", b"text/event-stream")]
        if self.config.api_key_env:
            key = self.env(self.config.api_key_env, "api_key_env")
            out.append((b"x-goog-api-key", key.encode()))
        return out

    def exchange(self, request: InferenceRequest, model: str) -> tuple[str, Headers, bytes]:
        one_choice(request)
        path = f"/v1beta/models/{quote(model, safe='')}:streamGenerateContent?alt=sse"
        return path, [], gemini_body(request)

    def decoder(self) -> StreamDecoder:
        # Made per try, without I/O: the ids only need to differ between requests.
        return GeminiStreamDecoder(self.name, f"call_{random.getrandbits(48):012x}_")

    def status_error(self, status: int, raw: bytes, retry_after: float | None) -> GatewayError:
        kind, message = error_fields(raw)
        said = f"{self.name}: Gemini answered {status} {kind}: {message[:300]}"
        if status == 400:
            if "token count" in message or "too long" in message:
                return BadRequest(said, param="messages", code="context_length_exceeded")
            return BadRequest(said, code="invalid_request_error")
        return UpstreamStatusError(said, upstream_status=status, retry_after=retry_after)
