"""OpenAI Chat Completions wire types and their reused codecs.

Requests are decoded by one typed ``msgspec`` Decoder built at import, for the
fields the gateway itself reads; the rest of the body is kept raw and relayed
(see ``stages/parse.py``). Wrong types in the fields it reads are errors whose
``param`` names the field. Responses are Structs encoded by one reused
Encoder; ``omit_defaults`` keeps absent optional fields off the wire.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from .errors import GatewayError

# --- requests -----------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class FunctionSpec(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    #: The function's JSON Schema, as sent (the mock fills it in; others relay it).
    parameters: msgspec.Raw = msgspec.Raw(b"null")


class ToolSpec(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: FunctionSpec | None = None


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: NamedFunction


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str


class ChatCompletionRequest(msgspec.Struct, kw_only=True):
    """The fields of a chat request the gateway itself reads.

    Everything else in the body (and these too, as sent) reaches the backend
    unchanged: the decoder skips what it does not name, and the parse stage
    keeps the body's top-level fields as raw JSON (see ``stages/parse.py``).
    ``messages`` stay raw here and are decoded one by one, keeping each
    message's original JSON (``messages.py``).
    """

    messages: list[msgspec.Raw]
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    seed: int | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None
    logprobs: bool | None = None


request_decoder = msgspec.json.Decoder(ChatCompletionRequest)

# --- responses ----------------------------------------------------------------


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # UNSET fields are left out of the JSON; a value is the backend's, relayed as is.
    prompt_tokens_details: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    completion_tokens_details: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    #: What the request cost in ``[pricing] currency``, when prices are set.
    cost: float | msgspec.UnsetType = msgspec.UNSET


class FunctionDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class ChunkDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCallChunk] | None = None


class ChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChunkDelta
    finish_reason: str | None = None
    logprobs: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


class ChatCompletionChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    #: Always "chat.completion.chunk"; no default so that omit_defaults keeps it.
    object: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class FunctionCallOut(msgspec.Struct, kw_only=True):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct, kw_only=True):
    id: str
    type: str
    function: FunctionCallOut


class ResponseMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | None
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET
    refusal: str | msgspec.UnsetType = msgspec.UNSET
    tool_calls: list[ToolCallOut] | msgspec.UnsetType = msgspec.UNSET


class LogprobsOut(msgspec.Struct, kw_only=True):
    content: list[msgspec.Raw]


class Choice(msgspec.Struct, kw_only=True):
    index: int
    message: ResponseMessage
    finish_reason: str | None
    logprobs: LogprobsOut | msgspec.UnsetType = msgspec.UNSET


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    object: str = "chat.completion"


class Model(msgspec.Struct, kw_only=True):
    id: str
    created: int
    owned_by: str
    object: str = "model"


class ModelList(msgspec.Struct, kw_only=True):
    data: list[Model]
    object: str = "list"


class ErrorBody(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorEnvelope(msgspec.Struct, kw_only=True):
    error: ErrorBody


encoder = msgspec.json.Encoder()


def error_json(err: GatewayError) -> bytes:
    """The OpenAI error envelope for ``err`` as JSON bytes."""
    body = ErrorBody(message=err.message, type=err.type, param=err.param, code=err.code)
    return encoder.encode(ErrorEnvelope(error=body))


class NativeEvents(msgspec.Struct, frozen=True, kw_only=True):
    """Events of a provider's stream as it sent them, carried on a delta of a native
    route (the client speaks the provider's API: ``apis/``, ``adapters/``)."""

    #: The events' bytes, ``event:`` and ``data:`` lines and the blank line each.
    raw: bytes
    #: The provider's name of the (last) event: ``content_block_delta``, ...
    kind: str
    #: The content block the events are about (Anthropic's ``index``).
    index: int = 0
    #: True: the events end what came before them (a block's end, a signature, the
    #: message's end): the text the output policies held back goes out first.
    boundary: bool = False
