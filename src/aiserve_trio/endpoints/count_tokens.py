"""``POST {route}/count_tokens`` on a Messages route: Anthropic's token counting, which
Claude Code and the Anthropic SDK's ``messages.count_tokens`` call.

Where the route's adapter is ``anthropic`` (no chain in front), the client's body goes
to the provider's ``POST /v1/messages/count_tokens`` as sent -- only the model is
renamed, when the adapter maps it to another name -- with the adapter's auth and the
client's ``anthropic-beta``, and the provider's answer (its status and body) comes back
as it sent it. For any other backend the gateway counts: ``{"input_tokens": N}``
with the real tokenizer the gateway budgets prompts with (``adapters/tokens.py``;
text, tool calls and results, thinking, the system prompt and the tools' JSON, a
fixed cost per image), which is an estimate of what that model would count, and says
so: ``X-Aiserve-Token-Count: estimated`` (``native`` on a relayed answer).

Auth is the route's (``Auth.CHAT`` with the route's path: a key allowed on the route,
``x-api-key`` taken, one request of the key's rate limit). Errors are in Anthropic's
shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import trio

from ..adapters.anthropic import AnthropicAdapter
from ..adapters.tokens import PART_TOKENS, count_prompt
from ..adapters.transport import translate_errors
from ..config import Config
from ..core.errors import BadRequest, StageDeadlineExceeded, UpstreamConnectError
from ..core.messages import Message
from ..core.slices import run_sliced
from ..http.body import read_body
from ..http.endpoints import Request
from ..http.types import JSON_HEADERS
from ..stages.parse import check_content_type, scan_steps
from ..stages.types import Route

#: The response header that says where a count came from.
SOURCE_HEADER = b"x-aiserve-token-count"
#: Below a Messages route's path.
SUFFIX = "/count_tokens"
#: The provider's path (``anthropic`` adapter).
UPSTREAM_PATH = "/v1/messages/count_tokens"
#: An answer larger than this from the provider is cut (a count is a few bytes).
MAX_ANSWER = 1 << 20
#: Client headers that go to the provider with the body.
FORWARDED = (b"anthropic-beta",)

_object = msgspec.json.Decoder(dict[str, Any])
_enc = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class CountTokens:
    """The handler of one Messages route's ``count_tokens`` endpoint."""

    route: Route
    config: Config

    async def __call__(self, request: Request) -> None:
        cfg = self.config
        deadline = request.arrival + cfg.deadline.default_ms / 1000.0
        check_content_type(request.headers.get("content-type"))
        body: bytes | None = None
        with trio.move_on_at(deadline):
            body = await read_body(request.receive, cfg.limits.max_body_bytes)
        if body is None:
            raise StageDeadlineExceeded("parse", "the request body did not arrive in time")
        # Every decode below is one call: the body's size in values is bounded first.
        await run_sliced(scan_steps(body, cfg.limits.max_json_depth, cfg.limits.max_json_values))
        fields = _decode(body)
        model = fields.get("model")
        if model is None:
            model = self.route.config.default_model
        if not isinstance(model, str) or not model:
            raise BadRequest("`model`: required, a string", param="model")
        adapter = self.route.adapter
        if isinstance(adapter, AnthropicAdapter) and self.route.chain is None:
            await self._relay(request, adapter, body, fields, model, deadline)
            return
        n = await estimate(fields, model)
        headers = [*JSON_HEADERS, (SOURCE_HEADER, b"estimated")]
        await request.responder.complete(200, headers, _enc.encode({"input_tokens": n}))

    async def _relay(
        self,
        request: Request,
        adapter: AnthropicAdapter,
        body: bytes,
        fields: dict[str, Any],
        model: str,
        deadline: float,
    ) -> None:
        transport = adapter.transport
        if transport is None:
            raise UpstreamConnectError(f"adapter {adapter.name} is not open")
        upstream = adapter.upstream_model(model)
        if upstream != fields.get("model"):  # renamed, or the route's default filled in
            body = _enc.encode({**fields, "model": upstream})
        headers = [(b"accept", b"application/json")]
        for name in FORWARDED:
            value = request.headers.get(name.decode())
            if value is not None:
                headers.append((name, value.encode("latin-1")))
        with translate_errors(adapter.name):
            async with transport.stream("POST", UPSTREAM_PATH, headers, body, deadline) as reply:
                answer = await reply.read(MAX_ANSWER)
                kind = reply.header(b"content-type") or b"application/json"
        out = [(b"content-type", kind), (SOURCE_HEADER, b"native")]
        await request.responder.complete(reply.status, out, answer)


def _text(value: Any) -> str:
    """The text of a block's ``content`` / ``text`` (a string, or blocks)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_block_text(b) for b in value if isinstance(b, dict))
    return ""


def _block_text(block: dict[str, Any]) -> str:
    kind = block.get("type")
    if kind == "text":
        return str(block.get("text", ""))
    if kind == "thinking":
        return str(block.get("thinking", ""))
    if kind == "tool_use":
        return str(block.get("name", "")) + _enc.encode(block.get("input", {})).decode()
    if kind == "tool_result":
        return _text(block.get("content"))
    return ""


def _images(content: Any) -> int:
    if not isinstance(content, list):
        return 0
    n = 0
    for b in content:
        if isinstance(b, dict):
            if b.get("type") in ("image", "document"):
                n += 1
            elif b.get("type") == "tool_result":
                n += _images(b.get("content"))
    return n


def count_messages(fields: dict[str, Any]) -> tuple[list[Message], int]:
    """A count request's prompt as the messages the gateway counts, and its images.

    Raises:
        BadRequest: ``messages`` is not a list of objects with a role.
    """
    messages = fields.get("messages")
    if not isinstance(messages, list):
        raise BadRequest("`messages`: required, a list", param="messages")
    out: list[Message] = []
    system = _text(fields.get("system"))
    tools = fields.get("tools")
    if tools:
        system += _enc.encode(tools).decode()
    if system:
        out.append(Message(role="system", content=system))
    images = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"`messages[{i}]`: an object with a `role`", param=f"messages[{i}]")
        out.append(Message(role=m["role"], content=_text(m.get("content"))))
        images += _images(m.get("content"))
    return out, images


async def estimate(fields: dict[str, Any], model: str) -> int:
    """The gateway's count of a Messages request's input tokens (see the module docstring).

    Raises:
        BadRequest: the body is not a Messages request.
    """
    messages, images = count_messages(fields)
    return await count_prompt(messages, model, None) + images * PART_TOKENS


def _decode(body: bytes) -> dict[str, Any]:
    """The body as a JSON object.

    Raises:
        BadRequest: ``invalid_json``: it is not one.
    """
    try:
        return _object.decode(body)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
