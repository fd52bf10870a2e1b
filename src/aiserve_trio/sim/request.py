"""What the sim decodes from a request: OpenAI chat and embeddings bodies, the WS ``generate``.

The shapes follow OpenAI's Chat Completions API so that a faithful client (the
official SDK, or the gateway relaying one) is accepted as sent: ``content`` as
a string or a list of parts, assistant ``tool_calls``, ``tool`` messages, and
any field the sim does not use (msgspec skips unknown fields; nothing here
forbids them). Every field is optional where OpenAI's is, and parts are one
lenient struct rather than a tagged union, so a part type the sim does not
know (``refusal``, a future one) is decoded and ignored rather than refused.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..util.vectors import embedding_inputs as embedding_inputs

#: What one image part costs in prompt tokens (OpenAI's low-detail base cost).
IMAGE_TOKENS = 85


class ImageURL(msgspec.Struct):
    url: str = ""
    detail: str | None = None


class InputAudio(msgspec.Struct):
    data: str = ""
    format: str | None = None


class ContentPart(msgspec.Struct):
    """One part of a list ``content``: ``text``, ``image_url``, ``input_audio``, ``file``, ..."""

    type: str = "text"
    text: str | None = None
    #: An object as OpenAI documents it; a bare URL string as some clients send it.
    image_url: ImageURL | str | None = None
    input_audio: InputAudio | None = None
    file: dict[str, Any] | None = None


class FunctionCall(msgspec.Struct):
    name: str = ""
    arguments: str = ""


class ToolCallIn(msgspec.Struct):
    """A tool call in an assistant message of the history."""

    id: str = ""
    type: str = "function"
    function: FunctionCall | None = None


class SimMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The message's text: the string content, or its text parts joined."""
        c = self.content
        if c is None:
            return ""
        if isinstance(c, str):
            return c
        return "".join(p.text for p in c if p.text)

    def images(self) -> int:
        c = self.content
        if not isinstance(c, list):
            return 0
        return sum(1 for p in c if p.type == "image_url" or p.image_url is not None)


class FunctionDef(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct):
    type: str = "function"
    function: FunctionDef | None = None


class JsonSchemaFormat(msgspec.Struct):
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct):
    type: str = "text"
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


#: ``tool_choice``: ``"none"`` / ``"auto"`` / ``"required"``, or
#: ``{"type": "function", "function": {"name": N}}`` (other objects are read loosely).
ToolChoice = str | dict[str, Any] | None


class SimChatRequest(msgspec.Struct):
    """``POST /v1/chat/completions``: the fields the sim uses; the rest are skipped."""

    messages: list[SimMessage]
    model: str = "sim-model"
    stream: bool = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream_options: StreamOptions | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class WsGenerate(msgspec.Struct):
    """The client's request message on the WebSocket protocol.

    ``stop``, ``temperature``, ``top_p`` and ``seed`` are accepted for the
    gateway to relay; the sim's output does not depend on them.
    """

    id: str
    messages: list[SimMessage]
    type: str = "generate"
    model: str = "sim-model"
    max_tokens: int | None = None
    timeout_ms: int | None = None
    fault: str | None = None
    fault_times: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice = None
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None


class EmbeddingsRequest(msgspec.Struct):
    """``POST /v1/embeddings``; ``input`` is checked by :func:`embedding_inputs`."""

    input: str | list[Any]
    model: str = "sim-model"
    dimensions: int | None = None
    encoding_format: str = "float"


chat_decoder = msgspec.json.Decoder(SimChatRequest)
ws_decoder = msgspec.json.Decoder(WsGenerate)
embeddings_decoder = msgspec.json.Decoder(EmbeddingsRequest)


def prompt_texts(messages: list[SimMessage]) -> tuple[list[str], int]:
    """The text the model reads per message (content and tool calls), and the image count."""
    texts = []
    images = 0
    for m in messages:
        text = m.text()
        for call in m.tool_calls or ():
            if call.function is not None:
                text += call.function.name + call.function.arguments
        texts.append(text)
        images += m.images()
    return texts, images
