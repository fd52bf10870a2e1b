"""The ``anthropic`` adapter: Anthropic's Messages API, streamed.

``POST {base_url}/v1/messages`` with ``x-api-key: $<api_key_env>`` and
``anthropic-version``; the reply is Anthropic's event stream, decoded by
``anthropic_stream.py``. The gateway's chat request is translated (pure:
:func:`messages_body`):

======================================  ===============================================
chat request                            Messages API
======================================  ===============================================
``system`` / ``developer`` messages     ``system`` (joined with a blank line)
``user`` text, ``text`` parts           ``user`` ``text`` blocks
``image_url`` parts (``data:`` / URL)   ``image`` blocks (``base64`` / ``url`` source)
``assistant`` content, ``tool_calls``   ``assistant`` ``text`` and ``tool_use`` blocks
``tool`` messages                       ``user`` ``tool_result`` blocks (one message)
``tools`` (functions)                   ``tools`` (``name``, ``description``,
                                        ``input_schema``)
``tool_choice`` auto/required/none/fn   ``{"type": auto/any/none/tool}``
``parallel_tool_calls: false``          ``tool_choice.disable_parallel_tool_use``
``stop`` / ``temperature`` / ``top_p``  ``stop_sequences`` / same / same
``max_tokens`` (client or route)        ``max_tokens`` (else the adapter's default)
``user``                                ``metadata.user_id``
``reasoning_effort``                    ``thinking`` (``budget_tokens``: 1,024 minimal,
                                        2,048 low, 8,192 medium, 24,576 high, within
                                        ``max_tokens``); its text comes back as reasoning
======================================  ===============================================

Messages of one role in a row become one message (Anthropic alternates roles).
Anything else is refused before the call (``capabilities``), never dropped.
Errors: ``overloaded_error`` (529) and ``rate_limit_error`` (429) are retried
before the first token; a prompt too long is ``context_length_exceeded``; other
``invalid_request_error`` s are the client's 400 with Anthropic's message.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec

from ..core.errors import BadRequest, GatewayError, PayloadTooLarge, UpstreamStatusError
from ..core.messages import Message
from ..observability.events import NULL_HOOK, UpstreamHook
from .anthropic_native import AnthropicNativeDecoder
from .anthropic_stream import AnthropicStreamDecoder
from .base import Capabilities, InferenceRequest
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
from .passthrough import native_body
from .settings import AnthropicAdapterConfig

__all__ = ["AnthropicAdapter", "messages_body"]

_enc = msgspec.json.Encoder()


def _image_block(image: Image, where: str) -> dict[str, Any]:
    if image.data:
        source = {"type": "base64", "media_type": image.media, "data": image.data}
        return {"type": "image", "source": source}
    if image.url.startswith("data:"):
        raise BadRequest(f"`{where}`: a data URL must be base64", param=where)
    return {"type": "image", "source": {"type": "url", "url": image.url}}


def _text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _turns(messages: list[Message]) -> tuple[str, list[dict[str, Any]]]:
    """(the system prompt, the alternating user/assistant turns)."""
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.role in ("system", "developer"):
            system.append(m.text())
            continue
        if m.role == "tool":
            role = "user"
            blocks: list[dict[str, Any]] = [
                {"type": "tool_result", "tool_use_id": m.tool_call_id or "", "content": m.text()}
            ]
        elif m.role in ("user", "assistant"):
            role = m.role
            blocks = content_parts(m, i, "Anthropic", _text_block, _image_block)
            for k, call in enumerate(m.tool_calls or []):
                where = f"messages[{i}].tool_calls[{k}].function.arguments"
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": call.id,
                        "name": call.function.name,
                        "input": parse_arguments(call.function.arguments, where),
                    }
                )
        else:
            raise BadRequest(
                f"`messages[{i}].role`: {m.role!r} cannot be sent to Anthropic",
                param=f"messages[{i}].role",
            )
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    return "\n\n".join(s for s in system if s), turns


def _tool_choice(request: InferenceRequest) -> dict[str, Any] | None:
    choice = request.tool_choice
    out: dict[str, Any] | None
    if choice is None or choice == "auto":
        out = {"type": "auto"} if "tools" in request.extra else None
    elif choice == "required":
        out = {"type": "any"}
    elif choice == "none":
        out = {"type": "none"}
    else:
        out = {"type": "tool", "name": choice}
    parallel = request.extra.get("parallel_tool_calls")
    if parallel is not None and bytes(parallel).strip() == b"false" and out is not None:
        out["disable_parallel_tool_use"] = True
    return out


def messages_body(request: InferenceRequest, model: str, max_tokens: int) -> bytes:
    """The Messages API body for ``request`` (see the module docstring's table).

    Args:
        model: the provider's model name.
        max_tokens: used when the request carries no limit (Anthropic requires one).

    Raises:
        BadRequest: the request cannot be said in the Messages API (a tool call's
            arguments that are not JSON, a role it does not have, an image it cannot take).
    """
    system, turns = _turns(request.messages)
    body: dict[str, Any] = {"model": model, "messages": turns}
    if system:
        body["system"] = system
    body["max_tokens"] = request.max_tokens if request.max_tokens is not None else max_tokens
    if request.stop:
        body["stop_sequences"] = request.stop
    if request.temperature is not None:
        body["temperature"] = request.temperature
    if request.top_p is not None:
        body["top_p"] = request.top_p
    tools = read_tools(request)
    if tools is not None:
        body["tools"] = [
            {
                "name": name,
                **({"description": description} if description else {}),
                "input_schema": params or {"type": "object", "properties": {}},
            }
            for name, description, params in tools
        ]
    choice = _tool_choice(request)
    if choice is not None:
        body["tool_choice"] = choice
    user = request.extra.get("user")
    if user is not None:
        body["metadata"] = {"user_id": user}
    thinking = _thinking(request.extra.get("reasoning_effort"), body["max_tokens"])
    if thinking is not None:
        body["thinking"] = thinking
    body["stream"] = True
    return _enc.encode(body)


#: ``reasoning_effort`` -> ``thinking.budget_tokens`` (the Messages codec reads a
#: budget back the other way: below 4,096 ``low``, below 16,384 ``medium``).
THINKING_BUDGET = {"minimal": 1024, "low": 2048, "medium": 8192, "high": 24576}
#: Anthropic's least thinking budget.
MIN_BUDGET = 1024


def _thinking(raw: msgspec.Raw | None, max_tokens: int) -> dict[str, Any] | None:
    """A chat request's ``reasoning_effort`` as Anthropic's ``thinking`` (within
    ``max_tokens``, which must leave room for the answer); None for ``none``.

    Raises:
        BadRequest: an effort Anthropic has no budget for, or ``max_tokens`` too
            small for its least budget.
    """
    if raw is None:
        return None
    effort = msgspec.json.decode(raw)
    if effort is None or effort == "none":
        return None
    budget = THINKING_BUDGET.get(effort) if isinstance(effort, str) else None
    if budget is None:
        raise BadRequest(
            f"`reasoning_effort` must be one of none, {', '.join(THINKING_BUDGET)}",
            param="reasoning_effort",
            code="invalid_value",
        )
    budget = min(budget, max_tokens - 1)
    if budget < MIN_BUDGET:
        raise BadRequest(
            f"`reasoning_effort` needs `max_tokens` above {MIN_BUDGET} on an Anthropic "
            "backend (its thinking budget comes out of them)",
            param="max_tokens",
            code="invalid_value",
        )
    return {"type": "enabled", "budget_tokens": budget}


class AnthropicAdapter(NativeAdapter):
    """Streams Anthropic Messages replies as chat deltas; takes a Messages client's
    own request natively (the body as sent, the events back as sent)."""

    capabilities = Capabilities(
        fields=(TRANSLATED.fields or frozenset()) | {"reasoning_effort"}, parts=TRANSLATED.parts
    )
    speaks = frozenset({"messages"})
    native_decoder = AnthropicNativeDecoder

    def __init__(
        self,
        name: str,
        config: AnthropicAdapterConfig,
        *,
        hook: UpstreamHook = NULL_HOOK,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(name, config, hook=hook, rng=rng)
        self.anthropic = config

    def default_base_url(self) -> str:
        return "https://api.anthropic.com"

    def auth_headers(self) -> Headers:
        out = [
            (b"anthropic-version", self.anthropic.anthropic_version.encode()),
            (b"accept", b"text/event-stream"),
        ]
        if self.config.api_key_env:
            key = self.env(self.config.api_key_env, "api_key_env")
            out.append((b"x-api-key", key.encode()))
        return out

    def exchange(self, request: InferenceRequest, model: str) -> tuple[str, Headers, bytes]:
        if request.native is not None:
            return "/v1/messages", [], native_body(request.native, model)
        one_choice(request)
        return "/v1/messages", [], messages_body(request, model, self.anthropic.max_tokens)

    def decoder(self) -> StreamDecoder:
        return AnthropicStreamDecoder(self.name)

    def status_error(self, status: int, raw: bytes, retry_after: float | None) -> GatewayError:
        kind, message = error_fields(raw)
        said = f"{self.name}: Anthropic answered {status} {kind}: {message[:300]}"
        if status == 413 or kind == "request_too_large":
            return PayloadTooLarge(said)
        if status == 400 and kind == "invalid_request_error":
            if "prompt is too long" in message or "too many tokens" in message:
                return BadRequest(said, param="messages", code="context_length_exceeded")
            return BadRequest(said, code="invalid_request_error")
        return UpstreamStatusError(said, upstream_status=status, retry_after=retry_after)
