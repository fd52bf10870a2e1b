"""OpenAI Chat Completions wire types and their reused codecs.

Requests are decoded by one typed ``msgspec`` Decoder built at import; unknown
fields are ignored (clients send many we do not use), wrong types are errors
whose ``param`` names the field. Responses are Structs encoded by one reused
Encoder; ``omit_defaults`` keeps absent optional fields off the wire.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from .errors import GatewayError

# --- requests -----------------------------------------------------------------


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text, with the text parts of a multi-part content joined."""
        c = self.content
        if c is None:
            return ""
        if isinstance(c, str):
            return c
        return "".join(p.text or "" for p in c if p.type == "text")


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class ChatCompletionRequest(msgspec.Struct, kw_only=True):
    messages: list[ChatMessage]
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


request_decoder = msgspec.json.Decoder(ChatCompletionRequest)

# --- responses ----------------------------------------------------------------


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChunkDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChunkDelta
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    #: Always "chat.completion.chunk"; no default so that omit_defaults keeps it.
    object: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ResponseMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str


class Choice(msgspec.Struct, kw_only=True):
    index: int
    message: ResponseMessage
    finish_reason: str | None


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
