"""The ``openai`` adapter: any OpenAI-compatible HTTP backend, streamed.

A plain ``http://`` backend over HTTP/1.1 is spoken to with the gateway's own
lean client (``h1.py``: a keep-alive pool, the request head built from a
prefix made once, llhttp parsing the response); measured, a request through it
costs a fraction of one through httpx2 (``python -m bench.h1_client``). TLS
(``https://``) and HTTP/2 (``http2 = true``) go through httpx2, and so does
everything when ``client = "httpx2"``.

httpx2: pooled :class:`httpx2.AsyncClient` s per adapter (keep-alive; HTTP/2 when
``http2 = true``), closed at shutdown. httpx2 rather than httpx because,
measured on Trio with 64 concurrent streams, httpx 0.28's single pool collapsed
to 306 req/s (p99 1.26 s) while httpx2 held 1,064 req/s (p99 87 ms), as
measured by ``bench/added_latency.py``.

Not one client but a :class:`ClientPool` of them, each carrying a bounded
number of streams: httpcore2 walks every connection of its pool whenever a
response closes, so with one client the cost of ending a stream grew with the
number of open streams (31 % of the worker's time at 2,000 open streams, bench
scenario (c)). With HTTP/2 a client holds one connection of up to 100 streams
(httpcore2's own cap), so 10,000 streams need 100 upstream sockets, not 10,000.

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

import contextlib
import email.utils
import math
import os
import random
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from importlib.metadata import version as _version
from types import TracebackType
from typing import Any, NoReturn, final

import httpx2
import msgspec
import trio

from ..config import OpenAIAdapterConfig
from ..errors import (
    BadRequest,
    ConfigError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
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
)
from .chat_stream import ChatStreamDecoder
from .compat import pool_connections
from .retry import Progress, RetryPolicy
from .sse_parser import SSEDecodeError
from .tokens import count_prompt, fit_request
from .transcription import multipart_body, read_transcript
from .wire import chat_body

#: Header carrying the remaining budget upstream.
BUDGET_HEADER = "X-Request-Timeout-Ms"
_BUDGET_HEADER = BUDGET_HEADER.lower().encode()
#: Bytes of an upstream error body kept for the message.
_ERROR_BODY_LIMIT = 2048
#: How long closing a response may take once the request is over.
_CLOSE_GRACE = 1.0
_USER_AGENT = f"aiserve-trio/{_version('aiserve-trio')}"
#: Streams one client carries: HTTP/1.1 connections per pool / HTTP/2 streams per connection.
PER_CLIENT_HTTP1 = 64
PER_CLIENT_HTTP2 = 100


class ClientPool:
    """Clients made on demand, each carrying at most ``per_client`` streams at once.

    A request takes the first client with room, so at low concurrency one client
    (and its warm connections) serves everything; more open only as streams pile up.
    """

    __slots__ = ("_clients", "_loads", "_make", "max_clients", "per_client")

    def __init__(
        self, make: Callable[[], httpx2.AsyncClient], per_client: int, max_streams: int
    ) -> None:
        self._make = make
        self.per_client = per_client
        self.max_clients = max(1, -(-max_streams // per_client))
        self._clients: list[httpx2.AsyncClient] = []
        self._loads: list[int] = []

    @contextlib.contextmanager
    def lease(self) -> Iterator[httpx2.AsyncClient]:
        """A client for one stream, for the duration of the block."""
        loads = self._loads
        i = next((i for i, n in enumerate(loads) if n < self.per_client), -1)
        if i < 0:
            if len(loads) < self.max_clients:
                self._clients.append(self._make())
                loads.append(0)
                i = len(loads) - 1
            else:  # all full: the least loaded one queues it in its own pool
                i = min(range(len(loads)), key=loads.__getitem__)
        loads[i] += 1
        try:
            yield self._clients[i]
        finally:
            loads[i] -= 1

    def connections(self) -> tuple[int, int] | None:
        """(open upstream connections, of which busy), over all clients; None if unknown."""
        total = busy = 0
        for client in self._clients:
            counts = pool_connections(client)  # httpx2 exposes no connection count
            if counts is None:
                return None
            total += counts[0]
            busy += counts[1]
        return total, busy

    async def aclose(self) -> None:
        clients, self._clients, self._loads = self._clients, [], []
        with trio.CancelScope(shield=True):
            for client in clients:
                await client.aclose()


_encoder = msgspec.json.Encoder()


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date)."""
    if value is None:
        return None
    value = value.strip()
    try:
        secs = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value).timestamp()
        except (TypeError, ValueError, IndexError):
            return None
        secs = when - (time.time() if now is None else now)
    return max(0.0, secs) if math.isfinite(secs) else None


def translate_errors(where: str) -> _Translate:
    """A block that turns client (h1, httpx2) and decoding exceptions into ``UpstreamError``
    subclasses (a class, not a generator: it is entered on every upstream call)."""
    return _Translate(where)


@final
class _Translate:
    __slots__ = ("where",)

    def __init__(self, where: str) -> None:
        self.where = where

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None or isinstance(exc, UpstreamError):
            return
        translated = _translated(self.where, exc)
        if translated is not None:
            raise translated from exc


def _translated(where: str, exc: BaseException) -> UpstreamError | None:
    """The ``UpstreamError`` a client or decoding exception stands for; None: not one of them."""
    if isinstance(exc, h1.H1Timeout):
        return UpstreamTimeout(f"{where}: the model backend timed out ({type(exc).__name__})")
    if isinstance(exc, h1.ConnectError):
        return UpstreamConnectError(f"{where}: cannot connect to the model backend")
    if isinstance(exc, (h1.ReadError, h1.WriteError)):
        return UpstreamConnectError(f"{where}: the connection to the model backend broke")
    if isinstance(exc, h1.RemoteProtocolError):
        return UpstreamProtocolError(f"{where}: the model backend broke the HTTP protocol ({exc})")
    if isinstance(exc, h1.H1Error):
        return UpstreamError(f"{where}: upstream HTTP failure ({type(exc).__name__})")
    if isinstance(exc, httpx2.TimeoutException):
        return UpstreamTimeout(f"{where}: the model backend timed out ({type(exc).__name__})")
    if isinstance(exc, (httpx2.ConnectError, httpx2.UnsupportedProtocol, httpx2.ProxyError)):
        return UpstreamConnectError(f"{where}: cannot connect to the model backend")
    if isinstance(exc, (httpx2.ReadError, httpx2.WriteError, httpx2.CloseError)):
        return UpstreamConnectError(f"{where}: the connection to the model backend broke")
    if isinstance(exc, httpx2.RemoteProtocolError):
        return UpstreamProtocolError(
            f"{where}: the model backend broke the HTTP protocol (connection closed mid-reply?)"
        )
    if isinstance(exc, (httpx2.HTTPError, httpx2.StreamError)):
        return UpstreamError(f"{where}: upstream HTTP failure ({type(exc).__name__})")
    if isinstance(exc, (SSEDecodeError, msgspec.DecodeError)):
        return UpstreamProtocolError(f"{where}: the model backend sent a malformed event")
    return None


class OpenAIAdapter(Adapter):
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
        """Build the adapter (the pool opens in :meth:`aopen`).

        Args:
            name: the ``[adapters.NAME]`` key.
            config: its settings.
            hook: told of each upstream try, retry and final error.
            transport: replaces the network transport (tests).
            rng: jitter source (tests seed it).
        """
        super().__init__(
            name, config.models, policy=RetryPolicy.from_config(config), hook=hook, rng=rng
        )
        self.config = config
        self._transport = transport
        self._clients: ClientPool | None = None
        #: The lean HTTP/1.1 client's pool, when it serves this backend (see aopen).
        self._lean: h1.H1Pool | None = None
        self._lean_heads: dict[str, h1.RequestHead] = {}
        # Requests are built here, not by client.build_request, which re-merges
        # the base URL and the default headers on every call (~0.1 ms).
        self._url = httpx2.URL(config.base_url.rstrip("/") + "/chat/completions")
        self._embed_url = httpx2.URL(config.base_url.rstrip("/") + "/embeddings")
        self._models_url = httpx2.URL(config.base_url.rstrip("/") + "/models")
        self._headers: list[tuple[bytes, bytes]] = []  # set in aopen (the API key)

    async def aopen(self, nursery: trio.Nursery) -> None:
        """Make the client pool and the fixed headers (httpx2 runs no tasks: ``nursery`` unused).

        Raises:
            ConfigError: ``api_key_env`` names an unset environment variable.
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
        per_client = PER_CLIENT_HTTP2 if cfg.http2 else PER_CLIENT_HTTP1
        # Over HTTP/2 a client keeps one connection; the limit matters only if
        # the server turns HTTP/2 down and every stream needs its own.
        limits = httpx2.Limits(
            max_connections=per_client,
            max_keepalive_connections=per_client,
            keepalive_expiry=30.0,
        )
        # http:// with http2 = true: HTTP/2 with prior knowledge (h2c), not HTTP/1.1.
        cleartext_h2 = cfg.http2 and cfg.base_url.startswith("http://")

        def make() -> httpx2.AsyncClient:
            return httpx2.AsyncClient(
                http1=not cleartext_h2,
                http2=cfg.http2,
                limits=limits,
                transport=self._transport,
                follow_redirects=False,
                trust_env=False,
            )

        self._clients = ClientPool(make, per_client, cfg.max_connections)
        fixed = {
            "accept": "text/event-stream",
            "accept-encoding": "gzip, deflate",
            "content-type": "application/json",
            "user-agent": _USER_AGENT,
            **{k.lower(): v for k, v in headers.items()},  # the config's win
        }
        self._headers = [(k.encode(), v.encode()) for k, v in fixed.items()]
        url = self._url
        if (
            cfg.client == "auto"
            and self._transport is None
            and not cfg.http2
            and url.scheme == "http"
        ):
            self._open_lean(fixed)

    def _open_lean(self, fixed: dict[str, str]) -> None:
        """The lean client's pool and request heads (httpx2 stays for nothing else)."""
        url = self._url
        port = url.port or 80
        name = f"[{url.host}]" if ":" in url.host else url.host  # an IPv6 literal
        host = name if url.port is None else f"{name}:{url.port}"
        # No accept-encoding: a backend compresses nothing then (h1 still decodes
        # gzip and deflate should one do it anyway).
        lean = [(k.encode(), v.encode()) for k, v in fixed.items() if k != "accept-encoding"]
        try:
            self._lean_heads = {
                "chat": h1.RequestHead("POST", url.raw_path.decode("ascii"), host, lean),
                "embed": h1.RequestHead(
                    "POST", self._embed_url.raw_path.decode("ascii"), host, lean
                ),
                "models": h1.RequestHead(
                    "GET", self._models_url.raw_path.decode("ascii"), host, lean
                ),
            }
        except ValueError as exc:
            raise ConfigError(f"adapter {self.name}: headers: {exc}") from exc
        self._lean = h1.H1Pool(
            url.host, port, max_connections=self.config.max_connections, keepalive_expiry=30.0
        )

    async def aclose(self) -> None:
        if self._lean is not None:
            lean, self._lean = self._lean, None
            await lean.aclose()
        if self._clients is not None:
            clients, self._clients = self._clients, None
            await clients.aclose()

    def connections(self) -> tuple[int, int] | None:
        """(open upstream connections, of which busy); None when this httpx2 cannot tell."""
        if self._lean is not None:
            return self._lean.connections()
        return self._clients.connections() if self._clients is not None else (0, 0)

    async def probe(self) -> bool:
        """``GET {base_url}/models`` answers 200 (cheap: no tokens are generated)."""
        lean = self._lean
        if lean is not None:
            head = self._lean_heads["models"].build([], None)
            timeout = self.config.connect_timeout_ms / 1000.0
            try:
                # The caller bounds the probe; these only keep a lost one from hanging.
                async with lean.request(head, b"", h1.Timeouts(30.0, timeout)) as answer:
                    await answer.read(1 << 20)  # to the end, so the connection is kept
                    return answer.status == 200
            except h1.H1Error:
                return False
        clients = self._clients
        if clients is None:
            return False
        with clients.lease() as client:
            try:
                response = await client.get(self._models_url, headers=self._headers)
            except httpx2.HTTPError:
                return False
        return response.status_code == 200

    async def prepare(self, request: InferenceRequest) -> InferenceRequest:
        """``request`` fitted to ``context_window`` (the oldest history dropped; ``tokens.py``).

        Raises:
            BadRequest: ``context_length_exceeded``, the prompt cannot fit.
        """
        return await fit_request(request, self.config.context_window, self.config.tokenizer)

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        """One upstream call on a client of the pool (see :meth:`Adapter.attempt`)."""
        clients = self._clients
        if clients is None:
            raise UpstreamConnectError(f"adapter {self.name} is not open")
        body = chat_body(request, self.config.upstream_model or request.model)
        lean = self._lean
        if lean is not None:
            await self._call_lean(lean, request, body, send)
            return
        with clients.lease() as client:
            await self._call(client, request, body, send)

    def _lean_request(
        self,
        kind: str,
        body: bytes,
        deadline: float,
        request_id: str,
        forward: dict[str, str],
    ) -> tuple[bytes, h1.Timeouts]:
        """The lean client's request head and timeouts: as :meth:`_request`'s."""
        remaining = max(deadline - trio.current_time(), 1e-3)
        timeouts = h1.Timeouts(remaining, min(self.config.connect_timeout_ms / 1000.0, remaining))
        headers = [
            (_BUDGET_HEADER, b"%d" % max(1, int(remaining * 1000))),
            (b"x-request-id", request_id.encode()),
            *((k.lower().encode(), v.encode()) for k, v in forward.items()),
        ]
        return self._lean_heads[kind].build(headers, body), timeouts

    async def _call_lean(
        self, pool: h1.H1Pool, request: InferenceRequest, body: bytes, send: DeltaSink
    ) -> None:
        with translate_errors(self.name):
            head, timeouts = self._lean_request(
                "chat", body, request.deadline, request.request_id, request.forward_headers
            )
            async with pool.request(head, body, timeouts) as response:
                if response.status != 200:
                    await self._raise_lean_status(response)
                await self._relay(response, request, send)

    async def _raise_lean_status(self, response: h1.Response) -> NoReturn:
        raw = await response.read(_ERROR_BODY_LIMIT)
        after = response.header(b"retry-after")
        self._status_error(
            response.status, raw, after.decode("latin-1") if after is not None else None
        )

    def _request(
        self,
        url: httpx2.URL,
        body: bytes,
        deadline: float,
        request_id: str,
        forward: dict[str, str],
    ) -> httpx2.Request:
        """An upstream request with the budget, the request id and the forwarded headers."""
        # The base class checked that time was left; the floor keeps the
        # timeouts positive should the clock have moved past the deadline since.
        remaining = max(deadline - trio.current_time(), 1e-3)
        # Client timeouts never exceed the budget; the stage's cancel scope is the backstop.
        timeout = httpx2.Timeout(
            remaining, connect=min(self.config.connect_timeout_ms / 1000.0, remaining)
        )
        headers = [
            *self._headers,
            (_BUDGET_HEADER, b"%d" % max(1, int(remaining * 1000))),
            (b"x-request-id", request_id.encode()),
            *((k.encode(), v.encode()) for k, v in forward.items()),
        ]
        return httpx2.Request(
            "POST", url, content=body, headers=headers, extensions={"timeout": timeout.as_dict()}
        )

    async def _call(
        self,
        client: httpx2.AsyncClient,
        request: InferenceRequest,
        body: bytes,
        send: DeltaSink,
    ) -> None:
        req = self._request(
            self._url, body, request.deadline, request.request_id, request.forward_headers
        )
        response: httpx2.Response | None = None
        try:
            with translate_errors(self.name):
                response = await client.send(req, stream=True)
                if response.status_code != 200:
                    await self._raise_status(response)
                async with contextlib.aclosing(response.aiter_bytes()) as chunks:
                    await self._relay(chunks, request, send)
        finally:
            if response is not None:
                # Shielded so that a cancelled request still closes the upstream
                # stream (the backend sees the disconnect and stops generating).
                with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_GRACE):
                    await response.aclose()

    async def embed_once(self, request: EmbeddingRequest) -> bytes:
        """One ``POST {base_url}/embeddings``: the client's body, the model mapped."""
        clients = self._clients
        if clients is None:
            raise UpstreamConnectError(f"adapter {self.name} is not open")
        fields: dict[str, Any] = dict(request.body)
        if self.config.upstream_model:
            fields["model"] = self.config.upstream_model
        req = self._request(
            self._embed_url,
            _encoder.encode(fields),
            request.deadline,
            request.request_id,
            request.forward_headers,
        )
        lean = self._lean
        if lean is not None:
            with translate_errors(self.name):
                head, timeouts = self._lean_request(
                    "embed",
                    req.content,
                    request.deadline,
                    request.request_id,
                    request.forward_headers,
                )
                async with lean.request(head, req.content, timeouts) as answer:
                    if answer.status != 200:
                        await self._raise_lean_status(answer)
                    return b"".join([part async for part in answer])
        response: httpx2.Response | None = None
        with clients.lease() as client:
            try:
                with translate_errors(self.name):
                    response = await client.send(req, stream=True)
                    if response.status_code != 200:
                        await self._raise_status(response)
                    return await response.aread()
            finally:
                if response is not None:
                    with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_GRACE):
                        await response.aclose()

    async def transcribe_once(self, request: TranscriptionRequest) -> str:
        """One ``POST {base_url}/audio/transcriptions`` (multipart: ``file``, ``model``).

        Raises:
            BadRequest: the backend refused the audio (400, 415 or 422).
            UpstreamError: how the call failed otherwise.
        """
        clients = self._clients
        if clients is None:
            raise UpstreamConnectError(f"adapter {self.name} is not open")
        fields = {"model": request.model, "response_format": "json"}
        kind, body = multipart_body(secrets.token_hex(16), fields, request.audio, request.format)
        url = httpx2.URL(self.config.base_url.rstrip("/") + "/audio/transcriptions")
        req = self._request(
            url, body, request.deadline, request.request_id, request.forward_headers
        )
        # The chat headers ask for JSON in and events out: not for a form.
        req.headers["content-type"] = kind.decode("ascii")
        req.headers["accept"] = "application/json"
        response: httpx2.Response | None = None
        with clients.lease() as client:
            try:
                with translate_errors(self.name):
                    response = await client.send(req, stream=True)
                    if response.status_code in (400, 415, 422):
                        try:
                            await self._raise_status(response)
                        except UpstreamStatusError as err:
                            raise BadRequest(
                                f"the audio cannot be transcribed: {err.message}",
                                code="invalid_audio",
                            ) from None
                    if response.status_code != 200:
                        await self._raise_status(response)
                    return read_transcript(await response.aread())
            finally:
                if response is not None:
                    with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_GRACE):
                        await response.aclose()

    async def _raise_status(self, response: httpx2.Response) -> NoReturn:
        raw = b""
        async with contextlib.aclosing(response.aiter_bytes()) as body:
            async for part in body:
                raw += part
                if len(raw) >= _ERROR_BODY_LIMIT:
                    break
        self._status_error(response.status_code, raw, response.headers.get("retry-after"))

    def _status_error(self, status: int, raw: bytes, retry_after: str | None) -> NoReturn:
        detail = raw[:_ERROR_BODY_LIMIT].decode("utf-8", "replace").strip()
        raise UpstreamStatusError(
            f"{self.name}: the model backend answered {status}: {detail[:300]}",
            upstream_status=status,
            retry_after=parse_retry_after(retry_after),
        )

    async def _relay(
        self, body: AsyncIterator[bytes], request: InferenceRequest, send: DeltaSink
    ) -> None:
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
