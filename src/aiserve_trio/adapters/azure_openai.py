"""The ``azure_openai`` adapter: Azure OpenAI chat completions, streamed.

``POST {base_url}/openai/deployments/{deployment}/chat/completions?api-version=
{api_version}``, where the deployment is the model's mapped name in ``models``
(else the model's own name), with ``api-key: $<api_key_env>`` or
``Authorization: Bearer $<token_env>`` (an Entra ID token). The body is the
client's, as for ``openai`` (``wire.py``): every field relayed as sent.

Azure's stream is OpenAI's with additions the decoder (``chat_stream.py``) reads
past: a first chunk with empty ``choices`` (its ``prompt_filter_results``) and
``content_filter_results`` on each choice. A prompt the content filter refuses (a
400 with ``code: "content_filter"``), and a reply the filter stops before any of
it reached the client (``finish_reason: "content_filter"`` and nothing else), are
the client's 400 with code ``content_filter``; a reply stopped midway ends with
that finish reason, as Azure sends it. A context too long is
``context_length_exceeded``; 429 and 5xx are retried before the first token.
"""

from __future__ import annotations

import random
from urllib.parse import quote

from ..core.errors import BadRequest, GatewayError, UpstreamStatusError
from ..observability.events import NULL_HOOK, UpstreamHook
from .base import Capabilities, Delta, InferenceRequest
from .chat_stream import ChatStreamDecoder
from .native import Headers, NativeAdapter, StreamDecoder, error_fields
from .settings import AzureOpenAIAdapterConfig
from .wire import chat_body

__all__ = ["AzureOpenAIAdapter", "FilteredStreamDecoder"]

FILTERED = "content_filter"


def filtered(name: str) -> BadRequest:
    return BadRequest(
        f"{name}: Azure's content filter refused this request", param="messages", code=FILTERED
    )


class FilteredStreamDecoder:
    """OpenAI's stream decoder, with a reply the filter stopped before its first piece
    raised as the client's error instead of an empty answer."""

    __slots__ = ("inner", "name", "sent")

    def __init__(self, name: str) -> None:
        self.name = name
        self.inner = ChatStreamDecoder(name)
        self.sent = False

    def feed(self, data: bytes) -> list[Delta]:
        out = self.inner.feed(data)
        self.sent = self.sent or bool(out)
        return out

    def check(self) -> None:
        self.inner.check()

    def end(self) -> Delta:
        """Raises: BadRequest: ``content_filter``, nothing was sent before the filter stopped it."""
        final = self.inner.end()
        if final.finish_reason == FILTERED and not self.sent:
            raise filtered(self.name)
        return final


class AzureOpenAIAdapter(NativeAdapter):
    """Streams chat completions from an Azure OpenAI deployment."""

    #: The whole OpenAI request is relayed as sent (embeddings are not spoken here).
    capabilities = Capabilities()

    def __init__(
        self,
        name: str,
        config: AzureOpenAIAdapterConfig,
        *,
        hook: UpstreamHook = NULL_HOOK,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(name, config, hook=hook, rng=rng)
        self.azure = config
        self._query = "?api-version=" + quote(config.api_version, safe="")

    def auth_headers(self) -> Headers:
        out = [(b"accept", b"text/event-stream")]
        cfg = self.azure
        if cfg.api_key_env:
            out.append((b"api-key", self.env(cfg.api_key_env, "api_key_env").encode()))
        elif cfg.token_env:
            token = self.env(cfg.token_env, "token_env")
            out.append((b"authorization", b"Bearer " + token.encode()))
        return out

    def exchange(self, request: InferenceRequest, model: str) -> tuple[str, Headers, bytes]:
        path = f"/openai/deployments/{quote(model, safe='')}/chat/completions{self._query}"
        return path, [], chat_body(request, model)

    def decoder(self) -> StreamDecoder:
        return FilteredStreamDecoder(self.name)

    def status_error(self, status: int, raw: bytes, retry_after: float | None) -> GatewayError:
        kind, message = error_fields(raw)
        said = f"{self.name}: Azure OpenAI answered {status} {kind}: {message[:300]}"
        if kind == FILTERED:
            return BadRequest(said, param="messages", code=FILTERED)
        if status == 400 and kind == "context_length_exceeded":
            return BadRequest(said, param="messages", code="context_length_exceeded")
        if status == 400:
            return BadRequest(said, code=kind or "invalid_request_error")
        return UpstreamStatusError(said, upstream_status=status, retry_after=retry_after)
