"""The ``openai`` adapter: any OpenAI-compatible HTTP backend, streamed.

It speaks through the upstream transport (``transport.py``): the gateway's own
lean HTTP/1.1 client for ``http://`` and ``https://`` backends, httpx2 for HTTP/2
(``http2 = true``) and when ``client = "httpx2"``. TLS settings (``ca_file``,
``client_cert``/``client_key``, ``server_name``, ``tls_min_version``) apply to both.

Every call streams upstream (``stream: true`` with usage), whether or not the
client streams: the first token is known as soon as it exists, and a cancelled
request closes the upstream response at once. The upstream sees:

- ``X-Request-Timeout-Ms``: the milliseconds left until the inference deadline
  (the same header the gateway itself accepts, so gateways chain);
- ``X-Request-Id``: the gateway's request id, the same on every retry;
- ``traceparent`` / ``tracestate`` when the client sent them;
- ``Authorization: Bearer $<api_key_env>`` when configured (never logged).

Retries (connect errors, timeouts, 429, 5xx; ``Retry-After`` honoured) happen
only before the first token has gone to the client (see ``retry.py``). The
event stream is decoded by ``chat_stream.py`` (no I/O there); every client
failure is translated here into an ``UpstreamError``.
"""

from __future__ import annotations

import os
import random
import secrets
from collections.abc import AsyncIterable
from importlib.metadata import version as _version
from typing import Any, NoReturn

import httpx2
import msgspec
import trio

from ..core.errors import (
    BadRequest,
    ConfigError,
    GatewayError,
    PayloadTooLarge,
    Unprocessable,
    UpstreamConnectError,
    UpstreamError,
    UpstreamStatusError,
)
from ..observability.annotate import upstream_read
from ..observability.events import NULL_HOOK, UpstreamHook
from . import h1
from .base import (
    Adapter,
    DeltaSink,
    EmbeddingRequest,
    InferenceRequest,
    TranscriptionRequest,
    Usage,
    budget_ms,
)
from .chat_stream import ChatStreamDecoder
from .passthrough import native_body
from .responses_native import ResponsesNativeDecoder
from .retry import Progress, RetryPolicy
from .settings import OpenAIAdapterConfig
from .tokens import count_prompt, fit_request
from .transcription import multipart_body, read_transcript
from .transport import (
    Reply,
    Transport,
    TransportOwner,
    open_transport,
    status_error,
    translate_errors,
)
from .wire import chat_body

#: Header carrying the remaining budget upstream.
BUDGET_HEADER = "X-Request-Timeout-Ms"
_BUDGET_HEADER = BUDGET_HEADER.lower().encode()
#: Bytes of an upstream error body kept for the message.
_ERROR_BODY_LIMIT = 2048
_USER_AGENT = f"aiserve-trio/{_version('aiserve-trio')}"

_encoder = msgspec.json.Encoder()


class OpenAIAdapter(TransportOwner, Adapter):
    """Streams chat completions from an OpenAI-compatible backend."""

    def __init__(
        self,
        name: str,
        config: OpenAIAdapterConfig,
        *,
        hook: UpstreamHook = NULL_HOOK,
        transport: httpx2.AsyncBaseTransport | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """Build the adapter (the transport opens in :meth:`aopen`).

        Args:
            name: the ``[adapters.NAME]`` key.
            config: its settings.
            hook: told of each upstream try, retry, final error and TLS handshake.
            transport: httpx2's transport instead of the network (tests).
            rng: jitter source (tests seed it).
        """
        super().__init__(
            name, config.models, policy=RetryPolicy.from_config(config), hook=hook, rng=rng
        )
        self.config = config
        self._httpx2_transport = transport
        self.transport: Transport | None = None
        if config.wire == "responses":
            self.speaks = frozenset({"responses"})

    async def aopen(self, nursery: trio.Nursery) -> None:
        """Open the transport with the fixed headers (it runs no tasks: ``nursery`` unused).

        Raises:
            ConfigError: ``api_key_env`` names an unset environment variable, a
                configured header would break the request head, or a TLS file
                became unusable since the config was loaded.
        """
        cfg = self.config
        headers = dict(cfg.headers)
        if cfg.api_key_env:
            key = os.environ.get(cfg.api_key_env)
            if not key:
                raise ConfigError(
                    f"adapter {self.name}: environment variable {cfg.api_key_env} "
                    "(api_key_env) is not set"
                )
            headers["Authorization"] = f"Bearer {key}"
        fixed = {
            "accept": "text/event-stream",
            "content-type": "application/json",
            "user-agent": _USER_AGENT,
            **{k.lower(): v for k, v in headers.items()},  # the config's win
        }
        lean = cfg.client == "auto" and self._httpx2_transport is None  # h1 or h2client
        if not lean:
            # httpx2 decodes what it asks for; the lean clients ask for nothing (a
            # backend compresses nothing then; they still decode gzip and deflate).
            fixed.setdefault("accept-encoding", "gzip, deflate")
        tls = self.backend_tls(cfg.base_url, cfg)
        try:
            self.transport = open_transport(
                self.name,
                cfg.base_url,
                [(k.encode(), v.encode()) for k, v in fixed.items()],
                max_connections=cfg.max_connections,
                connect_timeout=cfg.connect_timeout_ms / 1000.0,
                http2=cfg.http2,
                client=cfg.client,
                tls=tls,
                transport=self._httpx2_transport,
            )
        except (h1.HeaderError, UnicodeError) as exc:
            raise ConfigError(f"adapter {self.name}: headers: {exc}") from exc

    def _open(self) -> Transport:
        if self.transport is None:
            raise UpstreamConnectError(f"adapter {self.name} is not open")
        return self.transport

    async def probe(self) -> bool:
        """``GET {base_url}/models`` answers 200 (cheap: no tokens are generated)."""
        transport = self.transport
        if transport is None:
            return False
        try:
            # The caller bounds the probe; the deadline only keeps a lost one from hanging.
            deadline = trio.current_time() + 30.0
            async with transport.stream("GET", "/models", (), b"", deadline) as answer:
                await answer.read(1 << 20)  # to the end, so the connection is kept
                return answer.status == 200
        except UpstreamError:
            return False

    async def prepare(self, request: InferenceRequest) -> InferenceRequest:
        """``request`` fitted to ``context_window`` (the oldest history dropped; ``tokens.py``).

        Raises:
            BadRequest: ``context_length_exceeded``, the prompt cannot fit.
        """
        return await fit_request(request, self.config.context_window, self.config.tokenizer)

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        """One upstream call (see :meth:`Adapter.attempt`)."""
        transport = self._open()
        model = self.config.upstream_model or request.model
        headers = _headers(request.deadline, request.request_id, request.forward_headers)
        if self.config.wire == "responses":
            if request.native is None:
                raise BadRequest(
                    f"adapter {self.name} speaks the Responses API only: "
                    "it serves responses routes",
                    code="unsupported_route",
                )
            body = native_body(request.native, model)
            with translate_errors(self.name):
                async with transport.stream(
                    "POST", "/responses", headers, body, request.deadline
                ) as reply:
                    if reply.status != 200:
                        await self._raise_status(reply)
                    await self._relay(reply, request, send, ResponsesNativeDecoder(self.name))
            return
        with translate_errors(self.name):
            # The body is no local of this frame: the lean client lets go of it once
            # the response's head came, not at the end of a stream that may last minutes.
            async with transport.stream(
                "POST", "/chat/completions", headers, chat_body(request, model), request.deadline
            ) as reply:
                if reply.status != 200:
                    await self._raise_status(reply)
                await self._relay(reply, request, send)

    async def embed_once(self, request: EmbeddingRequest) -> bytes:
        """One ``POST {base_url}/embeddings``: the client's body, the model mapped."""
        transport = self._open()
        fields: dict[str, Any] = dict(request.body)
        if self.config.upstream_model:
            fields["model"] = self.config.upstream_model
        headers = _headers(request.deadline, request.request_id, request.forward_headers)
        async with transport.stream(
            "POST", "/embeddings", headers, _encoder.encode(fields), request.deadline
        ) as reply:
            if reply.status != 200:
                await self._raise_status(reply)
            return b"".join([part async for part in reply])

    async def transcribe_once(self, request: TranscriptionRequest) -> str:
        """One ``POST {base_url}/audio/transcriptions`` (multipart: ``file``, ``model``).

        Raises:
            BadRequest: the backend refused the audio (400, 415 or 422).
            UpstreamError: how the call failed otherwise.
        """
        transport = self._open()
        fields = {"model": request.model, "response_format": "json"}
        kind, body = multipart_body(secrets.token_hex(16), fields, request.audio, request.format)
        headers = [
            *_headers(request.deadline, request.request_id, request.forward_headers),
            # The chat headers ask for JSON in and events out: not for a form.
            (b"content-type", kind),
            (b"accept", b"application/json"),
        ]
        async with transport.stream(
            "POST", "/audio/transcriptions", headers, body, request.deadline
        ) as reply:
            if reply.status in (400, 415, 422):
                try:
                    await self._raise_status(reply, refuse=False)
                except UpstreamStatusError as err:
                    raise BadRequest(
                        f"the audio cannot be transcribed: {err.message}", code="invalid_audio"
                    ) from None
            if reply.status != 200:
                await self._raise_status(reply)
            return read_transcript(await reply.read(1 << 62))

    async def _raise_status(self, reply: Reply, *, refuse: bool = True) -> NoReturn:
        raw = await reply.read(_ERROR_BODY_LIMIT)
        refused = refusal(reply.status, raw) if refuse else None
        if refused is not None:
            raise refused
        raise status_error(self.name, reply.status, raw, reply.header(b"retry-after"))

    async def _relay(
        self,
        body: AsyncIterable[bytes],
        request: InferenceRequest,
        send: DeltaSink,
        decoder: ChatStreamDecoder | ResponsesNativeDecoder | None = None,
    ) -> None:
        if decoder is None:
            decoder = ChatStreamDecoder(self.name)
        async for raw in body:
            upstream_read(len(raw))
            for delta in decoder.feed(raw):
                await send.send(delta)
            decoder.check()  # after the text that came before a bad event
        final = decoder.end()
        if final.usage is None:  # the backend did not count: count the prompt here
            prompt = request.prompt_tokens  # counted already if fitting needed it
            if prompt is None:
                prompt = await count_prompt(request.messages, request.model, self.config.tokenizer)
            usage = Usage(prompt_tokens=prompt, completion_tokens=decoder.pieces)
            final = msgspec.structs.replace(final, usage=usage)
        await send.send(final)


class _ErrorBody(msgspec.Struct):
    message: str = ""
    param: str | None = None
    code: str | int | None = None


class _ErrorEnvelope(msgspec.Struct):
    error: _ErrorBody | None = None


_error_envelope = msgspec.json.Decoder(_ErrorEnvelope)
#: A backend's statuses that say the request itself is wrong: the client's to fix, so
#: the client's 4xx (not a 502 that SDKs retry and alerts count against the backend).
_REFUSALS: dict[int, type[GatewayError]] = {
    400: BadRequest,
    413: PayloadTooLarge,
    422: Unprocessable,
}


def refusal(status: int, raw: bytes) -> GatewayError | None:
    """The client error a backend's refusal of the request is (400, 413, 422), with the
    backend's own message, ``param`` and ``code`` from its OpenAI error envelope (on a
    native Responses route the client reads the provider's error as the provider wrote
    it); None for any other status (401/403/404 are the gateway's setup, 429 and 5xx the
    backend's state: those stay upstream errors)."""
    kind = _REFUSALS.get(status)
    if kind is None:
        return None
    try:
        err = _error_envelope.decode(raw).error
    except msgspec.DecodeError:
        err = None
    if err is None:
        text = raw[:300].decode("utf-8", "replace").strip()
        return kind(f"the model backend refused the request ({status}): {text}")
    code = str(err.code) if err.code is not None else None
    return kind(
        err.message or f"the model backend refused the request ({status})",
        param=err.param,
        code=code,
    )


def _headers(
    deadline: float, request_id: str, forward: dict[str, str]
) -> list[tuple[bytes, bytes]]:
    """A call's own headers: the budget left, the request id, the forwarded ones."""
    return [
        (_BUDGET_HEADER, b"%d" % budget_ms(deadline)),
        (b"x-request-id", request_id.encode()),
        *((k.lower().encode(), v.encode()) for k, v in forward.items()),
    ]
