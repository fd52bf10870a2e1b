"""The parse stage: read the body with a size cap, decode and validate it.

Pure parts (:func:`decode_request`, :func:`check_content_type`) take bytes and
headers and return a :class:`~.types.ParsedRequest` or raise a 4xx
``GatewayError`` whose ``param`` names the field; :func:`read_body` refuses an
oversized body while reading it, not after buffering it all; :class:`ParseStage`
is the stage around them.
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from typing import TYPE_CHECKING

import msgspec
import trio

from ..api import request_decoder
from ..config import LimitsConfig
from ..errors import (
    BadRequest,
    NotFound,
    PayloadTooLarge,
    StageDeadlineExceeded,
    Unprocessable,
    UnsupportedMediaType,
)
from .types import ParsedRequest, RequestInfo

if TYPE_CHECKING:
    from ..security.admission import Admission

_PATH_RE = re.compile(r"^(?P<msg>.*) - at `\$\.?(?P<path>[^`]*)`$")
_ALLOWED_ROLES_LAST = ("user", "tool", "function", "system", "developer")


def check_content_type(value: str | None) -> None:
    """Accept JSON (or no declared type); refuse anything else with 415."""
    if value is None:
        return
    media = value.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (
        media.startswith("application/") and media.endswith("+json")
    ):
        raise UnsupportedMediaType(
            f"Content-Type must be application/json, got {value[:60]!r}", param="Content-Type"
        )


async def read_body(chunks: trio.MemoryReceiveChannel[bytes], max_bytes: int) -> bytes:
    """Gather the body from ``chunks``, refusing it once it passes ``max_bytes``."""
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLarge(f"request body exceeds the limit of {max_bytes} bytes")
        parts.append(chunk)
    return b"".join(parts)


def decode_request(body: bytes, limits: LimitsConfig, default_model: str | None) -> ParsedRequest:
    """Decode and validate a Chat Completions request body.

    Raises:
        BadRequest: not JSON, not UTF-8, wrong types, missing or empty ``messages``.
        Unprocessable: well-formed but out of the gateway's limits.
    """
    if not body:
        raise BadRequest("request body is empty; expected a JSON object", code="invalid_json")
    try:
        req = request_decoder.decode(body)
    except msgspec.ValidationError as exc:
        msg, param = _split_path(str(exc))
        raise BadRequest(f"invalid request: {msg}", param=param, code="invalid_type") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None

    if not req.messages:
        raise BadRequest("`messages` must contain at least one message", param="messages")
    if len(req.messages) > limits.max_messages:
        raise Unprocessable(
            f"`messages` has {len(req.messages)} entries; the limit is {limits.max_messages}",
            param="messages",
            code="too_many_messages",
        )
    for i, m in enumerate(req.messages):
        if len(m.text()) > limits.max_content_chars:
            raise Unprocessable(
                f"`messages[{i}].content` is longer than {limits.max_content_chars} characters",
                param=f"messages[{i}].content",
                code="content_too_long",
            )
    if req.messages[-1].role not in _ALLOWED_ROLES_LAST:
        raise Unprocessable(
            "the last message must not be from the assistant",
            param=f"messages[{len(req.messages) - 1}].role",
            code="invalid_last_role",
        )
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    if max_tokens is not None and not 1 <= max_tokens <= limits.max_tokens:
        raise Unprocessable(
            f"`max_tokens` must be between 1 and {limits.max_tokens}", param="max_tokens"
        )
    if req.n not in (None, 1):
        raise Unprocessable("only `n` = 1 is supported", param="n")
    for key, value, hi in (("temperature", req.temperature, 2.0), ("top_p", req.top_p, 1.0)):
        if value is not None and not 0.0 <= value <= hi:
            raise Unprocessable(f"`{key}` must be between 0 and {hi}", param=key)
    model = req.model or default_model
    if not model:
        raise BadRequest("`model` is required", param="model")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4:
        raise Unprocessable("`stop` may hold at most 4 sequences", param="stop")
    return ParsedRequest(
        body=req,
        model=model,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        max_tokens=max_tokens,
        stop=stop,
    )


def _split_path(msg: str) -> tuple[str, str | None]:
    m = _PATH_RE.match(msg)
    if not m:
        return msg, None
    return m["msg"], m["path"] or None


class ParseStage:
    """Reads and decodes the body; takes a stream slot when the client streams."""

    name = "parse"

    def __init__(
        self,
        info: RequestInfo,
        body: trio.MemoryReceiveChannel[bytes],
        out: trio.MemorySendChannel[ParsedRequest],
        limits: LimitsConfig,
        admission: Admission | None,
        slots: ExitStack,
    ) -> None:
        self.info = info
        self.body = body
        self.out = out
        self.limits = limits
        self.admission = admission
        #: Holds the stream slot for the request's whole life (the pipeline closes it).
        self.slots = slots
        self.owned = (out, body)
        #: The decoded request, once there is one.
        self.result: ParsedRequest | None = None

    async def run(self, _: None) -> None:
        """Raises: the 4xx errors of :func:`decode_request`, 404 for an unserved
        model, 503 when the worker is at its open-stream cap."""
        route = self.info.route
        check_content_type(self.info.headers.get("content-type"))
        raw = await read_body(self.body, self.limits.max_body_bytes)
        req = decode_request(raw, self.limits, route.config.default_model)
        if req.model not in route.adapter.models:
            raise NotFound(
                f"the model {req.model!r} is not served on this route "
                f"(models: {', '.join(route.adapter.models)})",
                param="model",
                code="model_not_found",
            )
        if req.stream and self.admission is not None:
            self.slots.enter_context(self.admission.stream())  # 503 before the head
        self.result = req
        await self.out.send(req)

    async def expired(self, _: None) -> None:
        raise StageDeadlineExceeded(
            "parse", "the request body did not arrive within the context budget"
        )
