"""The parse stage: read the body with a size cap, decode and validate it.

Pure parts (:func:`decode_request`, :func:`check_content_type`) take bytes and
headers and return a :class:`~.types.ParsedRequest` or raise a 4xx
``GatewayError`` whose ``param`` names the field; :func:`read_body` refuses an
oversized body while reading it, not after buffering it all; :class:`ParseStage`
is the stage around them.
"""

from __future__ import annotations

import re
import sys
from contextlib import ExitStack
from dataclasses import replace
from typing import TYPE_CHECKING

import msgspec
import trio

from ..apis.common import json_schema, tool_name
from ..apis.responses import EFFORTS
from ..apis.shape import check_shape
from ..core.api import ChatCompletionRequest, request_decoder
from ..core.errors import (
    BadRequest,
    Forbidden,
    NotFound,
    PayloadTooLarge,
    StageDeadlineExceeded,
    UnsupportedMediaType,
)
from ..core.messages import Message, decode_message, invalid_field
from ..core.slices import Steps, finish, run_sliced
from ..http.turns import take_turn
from ..security.settings import LimitsConfig
from .channel import Inbox, Outbox
from .handoff import hand_on
from .report import ParseReport
from .types import ParsedRequest, RequestInfo

if TYPE_CHECKING:
    from ..adapters.base import Adapter
    from ..security.admission import Admission

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


async def read_body(chunks: Inbox[bytes], max_bytes: int) -> bytes:
    """Gather the body from ``chunks``, refusing it once it passes ``max_bytes``."""
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLarge(f"request body exceeds the limit of {max_bytes} bytes")
        parts.append(chunk)
    return b"".join(parts)


#: Top-level fields the gateway rebuilds on the way up (model mapping, session
#: context and policies, the upstream always streams); every other field of the
#: body travels in ``ParsedRequest.extra`` exactly as the client sent it.
REWRITTEN = frozenset({"model", "messages", "stream"})
_raw_body = msgspec.json.Decoder(dict[str, msgspec.Raw])
#: What the depth and value bounds look at outside strings: a bracket, a comma, or the
#: quote that opens a string (skipped to its end with ``bytes.find``, at memchr speed).
_TOKEN = re.compile(rb'[\[\]{},"]')
#: Tokens (or escapes inside a string) of the scan between two yields (~0.3 us each).
SCAN_STEP = 4096
#: Bytes one search looks through at most: a long run without a token is a step too.
SCAN_WINDOW = 262_144
_OPEN = frozenset(b"[{")
_CLOSE = frozenset(b"]}")
_COMMA, _QUOTE = ord(","), ord('"')


def scan_steps(body: bytes, max_depth: int, max_values: int | None = None) -> Steps[None]:
    """Refuse JSON nested deeper than ``max_depth``, or holding more than ``max_values``
    values, before any decoder recurses into it or builds them -- in steps.

    The value bound is what keeps every one-call decode of the body short: msgspec
    builds ~3-10 million values a second and cannot be interrupted, so a body of
    8 MB of ``[1],`` held the event loop ~0.4 s in one call (issue 51). A value is
    counted by the comma or the bracket before it, outside strings: an upper bound
    for values in containers. Each step is bounded in tokens and in bytes: a string
    is skipped by ``bytes.find`` (an escape is a token), a long run without a token
    is searched a window at a time.

    Raises:
        BadRequest: ``invalid_json``, nested too deeply; ``too_many_json_values``.
    """
    # Counting brackets and commas is C-speed (~1 ms a MB each: a step apiece); only
    # a body with many is scanned.
    opens = body.count(b"[")
    yield
    opens += body.count(b"{")
    bound = max_values if max_values is not None else sys.maxsize
    if opens <= max_depth and opens <= bound:
        yield
        if opens + body.count(b",") <= bound:
            return
    search = _TOKEN.search
    find = body.find
    size = len(body)
    depth = values = n = pos = 0
    while pos < size:
        n += 1
        if n % SCAN_STEP == 0:
            yield
        m = search(body, pos, pos + SCAN_WINDOW)
        if m is None:
            pos += SCAN_WINDOW
            continue
        c = body[m.start()]
        pos = m.end()
        if c == _QUOTE:
            # To the string's closing quote: each escape is a token, and the next
            # quote is looked for once per stretch, not once per escape.
            quote = find(b'"', pos)
            while quote >= 0:
                escape = find(b"\\", pos, quote)
                if escape < 0:
                    break
                pos = escape + 2  # the escaped byte, a quote or not, is skipped
                if pos > quote:
                    quote = find(b'"', pos)
                n += 1
                if n % SCAN_STEP == 0:
                    yield
            pos = quote + 1 if quote >= 0 else size  # not closed: the decoder says so
        elif c in _OPEN:
            depth += 1
            values += 1
            if depth > max_depth:
                raise BadRequest(
                    f"the request body is nested more than {max_depth} levels deep",
                    code="invalid_json",
                )
        elif c in _CLOSE:
            depth -= 1
        elif c == _COMMA:
            values += 1
        if values > bound:
            raise BadRequest(
                f"the request body holds more than {bound} JSON values, the limit",
                code="too_many_json_values",
            )


#: A body over ``max_json_values`` is scanned on up to this many times that many, so that
#: a request over a limit on pieces is told which one (counting them is then one call of
#: ~15 ms at most): "100,000 content parts in `messages[0].content`", not "too many values".
NAMING_FACTOR = 8


def check_body_steps(body: bytes, limits: LimitsConfig, kind: str) -> Steps[None]:
    """The checks before any decode or translation, in steps: :func:`scan_steps` (depth,
    values), then the pieces of a ``kind`` request (``apis/shape.py``).

    Raises:
        BadRequest: as :func:`scan_steps` and :func:`~aiserve_trio.apis.shape.check_shape`;
            a body over both the value limit and a limit on pieces names the latter.
    """
    try:
        yield from scan_steps(body, limits.max_json_depth, limits.max_json_values)
    except BadRequest as exc:
        if exc.code != "too_many_json_values":
            raise
        try:
            bound = limits.max_json_values * NAMING_FACTOR
            yield from scan_steps(body, limits.max_json_depth, bound)
        except BadRequest:
            raise exc from None
        yield
        check_shape(body, kind, limits)  # raises the limit on pieces it passes, if any
        raise
    yield
    check_shape(body, kind, limits)


def check_depth(body: bytes, max_depth: int) -> None:
    """Refuse JSON nested deeper than ``max_depth`` (:func:`scan_steps` at once).

    Raises:
        BadRequest: ``invalid_json``, nested too deeply.
    """
    finish(scan_steps(body, max_depth))


def decode_request(
    body: bytes, limits: LimitsConfig, default_model: str | None, *, scanned: bool = False
) -> ParsedRequest:
    """Decode and validate a Chat Completions request body.

    The fields the gateway reads are decoded and checked; the messages keep
    their original JSON; every other top-level field is kept raw for the backend.
    ``scanned``: the caller has run :func:`check_body_steps` on ``body`` (in slices).

    Raises:
        BadRequest: not JSON, not UTF-8, nested too deeply, wrong types, missing
            or empty ``messages``, a tool message without ``tool_call_id``, a value
            out of its range or the gateway's limits -- each with the ``param`` it is
            about and a ``code``, as OpenAI's API answers.
        PayloadTooLarge: a content part (an image, audio, a file) over ``max_part_bytes``.
    """
    if not body:
        raise BadRequest("request body is empty; expected a JSON object", code="invalid_json")
    if not scanned:
        finish(check_body_steps(body, limits, "chat"))
    try:
        req = request_decoder.decode(body)
        top = _raw_body.decode(body)
    except msgspec.ValidationError as exc:
        msg, param, code = invalid_field(exc)
        raise BadRequest(f"invalid request: {msg}", param=param, code=code) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None

    messages = _messages(req, limits)
    max_tokens = _check_sampling(req, limits)
    model = req.model or default_model
    if not model:
        raise BadRequest("`model` is required", param="model", code="missing_required_parameter")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4:
        raise BadRequest(
            "`stop` may hold at most 4 sequences", param="stop", code="array_above_max_length"
        )
    _check_values(req, top)
    return ParsedRequest(
        body=req,
        messages=messages,
        extra={k: v for k, v in top.items() if k not in REWRITTEN},
        model=model,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        max_tokens=max_tokens,
        stop=stop,
    )


def _messages(req: ChatCompletionRequest, limits: LimitsConfig) -> list[Message]:
    """The request's messages decoded, each checked, the last not the assistant's.

    Raises:
        BadRequest: none, more than ``max_messages``, one invalid, or the last the
            assistant's.
    """
    if not req.messages:
        raise BadRequest(
            "`messages` must contain at least one message", param="messages", code="empty_array"
        )
    if len(req.messages) > limits.max_messages:
        raise BadRequest(
            f"`messages` has {len(req.messages)} entries; the limit is {limits.max_messages}",
            param="messages",
            code="too_many_messages",
        )
    messages = [decode_message(raw, i) for i, raw in enumerate(req.messages)]
    for i, m in enumerate(messages):
        _check_message(m, i, limits)
    if messages[-1].role not in _ALLOWED_ROLES_LAST:
        raise BadRequest(
            "the last message must not be from the assistant",
            param=f"messages[{len(messages) - 1}].role",
            code="invalid_last_role",
        )
    return messages


def _check_sampling(req: ChatCompletionRequest, limits: LimitsConfig) -> int | None:
    """The reply's token cap (``max_completion_tokens`` or ``max_tokens``), after
    checking it, ``n``, ``temperature`` and ``top_p`` are in their ranges.

    Raises:
        BadRequest: naming the parameter out of its range.
    """
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    if max_tokens is not None and not 1 <= max_tokens <= limits.max_tokens:
        key = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        raise BadRequest(
            f"`{key}` must be between 1 and {limits.max_tokens}",
            param=key,
            code="integer_below_min_value" if max_tokens < 1 else "integer_above_max_value",
        )
    if req.n not in (None, 1):
        raise BadRequest("only `n` = 1 is supported", param="n", code="unsupported_value")
    for key, value, hi in (("temperature", req.temperature, 2.0), ("top_p", req.top_p, 1.0)):
        if value is not None and not 0.0 <= value <= hi:
            raise BadRequest(
                f"`{key}` must be between 0 and {hi}",
                param=key,
                code="decimal_below_min_value" if value < 0 else "decimal_above_max_value",
            )
    return max_tokens


def _check_values(req: ChatCompletionRequest, top: dict[str, msgspec.Raw]) -> None:
    """What every provider refuses with a 400 (issue 51, item 4): refused here, before
    the round trip, on every route (a native one's provider would refuse it too).

    Raises:
        BadRequest: a tool's name with a space or a control character or over 128
            characters, its ``parameters`` not an object, ``top_logprobs`` outside
            0-20, an unknown ``reasoning_effort``.
    """
    for i, tool in enumerate(req.tools or ()):
        if tool.function is not None:
            at = f"tools[{i}].function"
            tool_name(tool.function.name, f"{at}.name")
            schema = bytes(tool.function.parameters).lstrip()[:1]
            if schema not in (b"{", b"n"):  # an object, or null (none)
                json_schema(schema, f"{at}.parameters")
    if "top_logprobs" in top:
        value = _any.decode(top["top_logprobs"])
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 20
        ):
            raise BadRequest(
                "`top_logprobs` must be an integer between 0 and 20",
                param="top_logprobs",
                code="invalid_value",
            )
    if req.reasoning_effort is not None and req.reasoning_effort not in EFFORTS:
        raise BadRequest(
            f"`reasoning_effort` must be one of {', '.join(EFFORTS)}",
            param="reasoning_effort",
            code="invalid_value",
        )


_any = msgspec.json.Decoder()


def _check_message(m: Message, i: int, limits: LimitsConfig) -> None:
    if len(m.text()) > limits.max_content_chars:
        raise BadRequest(
            f"`messages[{i}].content` is longer than {limits.max_content_chars} characters",
            param=f"messages[{i}].content",
            code="content_too_long",
        )
    if m.role == "tool" and not m.tool_call_id:
        raise BadRequest(
            f"`messages[{i}]` has role `tool` but no `tool_call_id`",
            param=f"messages[{i}].tool_call_id",
            code="missing_required_parameter",
        )
    if isinstance(m.content, list):
        for j, part in enumerate(m.content):
            if part.raw is not None and len(part.raw) > limits.max_part_bytes:
                raise PayloadTooLarge(
                    f"`messages[{i}].content[{j}]` ({part.type}) is larger than "
                    f"{limits.max_part_bytes} bytes",
                    param=f"messages[{i}].content[{j}]",
                    code="content_part_too_large",
                )


def check_capabilities(
    req: ParsedRequest, adapter: Adapter, consumed: frozenset[str] = frozenset()
) -> None:
    """Refuse what the route's backend cannot carry, naming the field: never a silent drop.

    Args:
        consumed: content part types the route's chain turns into text before the
            backend sees them (``input_audio`` with a transcribe step).

    Raises:
        BadRequest: ``unsupported_field`` / ``unsupported_content`` naming the field.
    """
    caps = adapter.capabilities
    what = f"the backend of this route ({adapter.name})"
    if caps.fields is not None:
        for key in req.extra:
            if not caps.carries(key):
                raise BadRequest(
                    f"`{key}` cannot be carried by {what}; it is not sent anywhere",
                    param=key,
                    code="unsupported_field",
                )
        tools = "tools" in caps.fields
        for i, m in enumerate(req.messages):
            if not tools and (m.tool_calls or m.role == "tool"):
                field = "tool_calls" if m.tool_calls else "role"
                raise BadRequest(
                    f"`messages[{i}].{field}`: tool calls cannot be carried by {what}",
                    param=f"messages[{i}].{field}",
                    code="unsupported_field",
                )
    if caps.parts is not None:
        for i, m in enumerate(req.messages):
            if not isinstance(m.content, list):
                continue
            for j, part in enumerate(m.content):
                if part.type not in caps.parts and part.type not in consumed:
                    raise BadRequest(
                        f"`messages[{i}].content[{j}]`: `{part.type}` parts cannot be "
                        f"carried by {what}",
                        param=f"messages[{i}].content[{j}]",
                        code="unsupported_content",
                    )


#: What a translated request (a Responses or Messages client on a backend that speaks
#: Chat Completions or another provider's API) goes without when the route's backend
#: cannot carry it: a prompt-cache key, a safety identifier, a service tier, a reasoning
#: effort, a verbosity -- the answer means the same. Dropped and named in
#: ``X-Aiserve-Dropped`` (by the pipeline's name); a chat client's are refused as any
#: other field the backend cannot carry.
HINTS = frozenset(
    {"prompt_cache_key", "safety_identifier", "service_tier", "reasoning_effort", "verbosity"}
)


def drop_hints(req: ParsedRequest, adapter: Adapter) -> ParsedRequest:
    """``req`` (translated) without the :data:`HINTS` its backend cannot carry, named in
    ``req.dropped``."""
    caps = adapter.capabilities
    if caps.fields is None:
        return req
    gone = tuple(k for k in req.extra if k in HINTS and not caps.carries(k))
    if not gone:
        return req
    extra = {k: v for k, v in req.extra.items() if k not in gone}
    return replace(req, extra=extra, dropped=gone)


class ParseStage:
    """Reads and decodes the body; takes a stream slot when the client streams."""

    name = "parse"

    def __init__(
        self,
        info: RequestInfo,
        body: Inbox[bytes],
        out: Outbox[ParsedRequest],
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
        # Its turn among the requests starting (http/turns.py), once the body is in.
        await take_turn(self.info.budget.queue_end, self.info.budget.context_end)
        limits = self.limits
        codec = route.codec
        # In slices (8 MB of brackets take ~0.4 s to scan), and the pieces counted
        # before a loop visits one of them (issue 51).
        await run_sliced(check_body_steps(raw, limits, codec.kind))
        sent = raw  # the body as the client sent it (a native route's)
        # Another API's request becomes the pipeline's own (``apis/``); the pipeline's
        # own comes back as it was.
        raw, view = codec.decode(raw)
        translated = raw is not sent
        if translated:
            # Each of these is one call of up to ~10 ms (bounded by the limits above):
            # a checkpoint between them, so that they are not one step together.
            await trio.lowlevel.checkpoint()
            await run_sliced(scan_steps(raw, limits.max_json_depth, limits.max_json_values))
            await trio.lowlevel.checkpoint()
        default = route.config.default_model or route.adapter.default_model
        req = decode_request(raw, limits, default, scanned=True)
        if req.model not in route.adapter.models:
            raise NotFound(
                f"the model {req.model!r} is not served on this route "
                f"(models: {', '.join(route.adapter.models)})",
                param="model",
                code="model_not_found",
            )
        allowed = self.info.models
        if allowed is not None and req.model not in allowed:
            # A database key's (or its team's) model allow-list (issue 47, item 3).
            raise Forbidden(
                f"this API key may not call the model {req.model!r} "
                f"(its models: {', '.join(sorted(allowed)) or 'none'})",
                param="model",
                code="model_not_allowed",
            )
        served = route.adapter.serving(req.model)
        if (
            codec.native is not None
            and route.config.native
            and route.chain is None
            and codec.kind in served.speaks
        ):
            # The backend speaks the client's API: its body goes as it came.
            req = replace(req, api=view, native=sent)
        elif translated:
            req = drop_hints(replace(req, api=codec.translated(view)), served)
        if req.native is None:
            consumed = route.chain.consumes if route.chain is not None else frozenset()
            check_capabilities(req, served, consumed)
        if req.stream and self.admission is not None:
            # 503 (429 for the tenant's cap) before the head.
            info = self.info
            cap = info.key_max_streams
            key = (info.key_id, cap) if info.key_id is not None and cap else None
            self.slots.enter_context(self.admission.stream(info.tenant, key))
        self.result = req
        await hand_on(self.out, req)

    async def expired(self, _: None) -> None:
        raise StageDeadlineExceeded(
            "parse", "the request body did not arrive within the context budget"
        )

    def report(self) -> ParseReport:
        """What the stage decoded (its shell asks when it ends)."""
        req = self.result
        return _NOTHING_PARSED if req is None else ParseReport(req.model, req.stream)


_NOTHING_PARSED = ParseReport()
