"""The Azure OpenAI dialect: ``POST /openai/deployments/{deployment}/chat/completions
?api-version=...`` as Azure answers it.

The body is OpenAI's Chat Completions request (read as ``/v1/chat/completions``
reads it); the ``model`` a reply names is the deployment. Requests need an
``api-key`` header or ``Authorization: Bearer`` (401 otherwise) and an
``api-version`` query parameter (404 otherwise, as Azure answers).

What Azure adds to OpenAI's stream: a first chunk with ``choices: []`` and
``prompt_filter_results``; ``content_filter_results`` on every choice; the usage
chunk (``choices: []``) always. A prompt containing :data:`FILTER_WORD` is refused
as Azure refuses a filtered prompt: 400, ``code: "content_filter"``,
``innererror.code: "ResponsiblePolicyViolation"``.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qs

import msgspec

from .core import Prepared
from .dialect import DialectError, SimAsk
from .request import chat_decoder
from .wire import completion_body, reply_usage, sse_choices, sse_finish

_enc = msgspec.json.Encoder()
_PATH = re.compile(r"^/openai/deployments/([^/]+)/chat/completions$")
#: A prompt with this word in it is refused by the (simulated) content filter.
FILTER_WORD = "sim-content-filter"
_SAFE = {"filtered": False, "severity": "safe"}
#: Every category Azure reports, unfiltered.
CLEAR = {k: _SAFE for k in ("hate", "self_harm", "sexual", "violence")}


class ContentFiltered(DialectError):
    """The prompt tripped the simulated content filter."""


class AzureDialect:
    """Azure OpenAI chat completions (see the module docstring)."""

    name = "azure"
    stream_type = b"text/event-stream"

    def matches(self, method: str, path: str) -> bool:
        return method == "POST" and _PATH.match(path) is not None

    def auth_error(self, headers: dict[str, str]) -> tuple[int, bytes] | None:
        bearer = headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not headers.get("api-key") and not bearer:
            why = "Access denied due to missing subscription key or bearer token."
            return 401, _enc.encode({"error": {"code": "401", "message": why}})
        return None

    def read(self, path: str, query: str, body: bytes) -> SimAsk:
        if not parse_qs(query).get("api-version"):
            raise DialectError("Resource not found (no api-version)", status=404)
        m = _PATH.match(path)
        deployment = m.group(1) if m is not None else ""
        req = chat_decoder.decode(body)
        if any(FILTER_WORD in msg.text() for msg in req.messages):
            raise ContentFiltered(
                "The response was filtered due to the prompt triggering "
                "Azure OpenAI's content management policy."
            )
        return SimAsk(
            model=deployment,
            messages=req.messages,
            stream=req.stream,
            max_tokens=req.max_completion_tokens or req.max_tokens,
            tools=req.tools,
            tool_choice=req.tool_choice,
            reasoning_effort=req.reasoning_effort,
            response_format=req.response_format,
        )

    def error(self, status: int, message: str) -> bytes:
        if "content management policy" in message:
            inner = {
                "code": "ResponsibleAIPolicyViolation",
                "content_filter_result": {
                    **CLEAR,
                    "violence": {"filtered": True, "severity": "high"},
                },
            }
            err: dict[str, Any] = {
                "message": message,
                "type": None,
                "param": "prompt",
                "code": "content_filter",
                "status": 400,
                "innererror": inner,
            }
            return _enc.encode({"error": err})
        if "api-version" in message:
            return _enc.encode({"error": {"code": "404", "message": message}})
        code = {429: "429", 400: "invalid_request_error"}.get(status, str(status))
        return _enc.encode(
            {"error": {"code": code, "message": message, "type": None, "param": None}}
        )

    def _chunk(self, ready: Prepared, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        for c in choices:
            c["content_filter_results"] = CLEAR if c.get("finish_reason") is None else {}
        head = {
            "id": f"chatcmpl-azure-{ready.serial}",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "",
            "system_fingerprint": "fp_sim",
            "choices": choices,
            **extra,
        }
        return b"data: " + _enc.encode(head) + b"\n\n"

    def opening(self, ready: Prepared, model: str) -> bytes:
        filters = [{"prompt_index": 0, "content_filter_results": CLEAR}]
        return (
            b"data: "
            + _enc.encode(
                {
                    "id": "",
                    "object": "",
                    "created": 0,
                    "model": "",
                    "choices": [],
                    "prompt_filter_results": filters,
                }
            )
            + b"\n\n"
        )

    def token(self, ready: Prepared, k: int) -> bytes:
        # One chunk per choice: a tool call's naming chunk, then its first fragment.
        return b"".join(self._chunk(ready, [c]) for c in sse_choices(ready.script, k, None))

    def closing(self, ready: Prepared, model: str) -> bytes:
        out = self._chunk(ready, [sse_finish(ready.script, ready.plan)])
        usage = reply_usage(ready.plan, ready.prompt_tokens, ready.cache_read)
        out += self._chunk(ready, [], usage=usage)
        return out + b"data: [DONE]\n\n"

    def whole(self, ready: Prepared, model: str) -> bytes:
        body = completion_body(
            f"chatcmpl-azure-{ready.serial}",
            model,
            ready.script,
            ready.plan,
            ready.prompt_tokens,
            None,
            ready.cache_read,
        )
        body["choices"][0]["content_filter_results"] = CLEAR
        body["prompt_filter_results"] = [{"prompt_index": 0, "content_filter_results": CLEAR}]
        return _enc.encode(body)
