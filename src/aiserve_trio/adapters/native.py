"""What the native provider adapters (``anthropic``, ``azure_openai``, ``gemini``,
``bedrock``) share: one POST per try, the reply decoded sans-IO, errors mapped once.

A provider adapter says four things: the fixed headers (its auth), the request of
one try (path, headers, body: the translation of the chat request), the decoder of
its stream (bytes in, :class:`~.base.Delta` s out, no I/O), and what an error
status with its body means to a client (:meth:`NativeAdapter.status_error`).
Everything else -- retries before the first token, the out-of-time guard, hooks,
the pool of connections -- is the adapter base's and the transport's.

``models`` may map the public name a client asks for to the provider's own
(``models = { "gpt-4o" = "prod-gpt4o-deployment" }``) or list names sent as they are.
"""

from __future__ import annotations

import abc
import os
import random
from collections.abc import Callable, Mapping
from importlib.metadata import version
from typing import Any, Protocol

import msgspec
import trio

from ..core.errors import BadRequest, ConfigError, GatewayError, UpstreamConnectError
from ..core.messages import Message
from ..observability.annotate import upstream_read
from ..observability.events import NULL_HOOK, UpstreamHook
from . import h1
from .base import Adapter, Capabilities, Delta, DeltaSink, InferenceRequest, budget_ms
from .retry import Progress, RetryPolicy
from .settings import NativeAdapterConfig
from .tokens import fit_request
from .transport import (
    Transport,
    TransportOwner,
    open_transport,
    parse_retry_after,
    translate_errors,
)

__all__ = [
    "TRANSLATED",
    "Image",
    "NativeAdapter",
    "StreamDecoder",
    "content_parts",
    "error_fields",
    "image_url",
    "one_choice",
    "parse_arguments",
    "read_tools",
]

#: The remaining budget, as the gateway itself accepts it (the sim and chained
#: gateways read it; providers ignore it), and the request id, the same on every retry.
BUDGET_HEADER = b"x-request-timeout-ms"
USER_AGENT = f"aiserve-trio/{version('aiserve-trio')}"
#: Bytes of an upstream error body read for the message.
ERROR_BODY_LIMIT = 4096

Headers = list[tuple[bytes, bytes]]


class StreamDecoder(Protocol):
    """A provider's stream decoder: ``feed`` each read, ``check`` after sending, ``end``."""

    def feed(self, data: bytes) -> list[Delta]: ...
    def check(self) -> None: ...
    def end(self) -> Delta: ...


class _ErrorBody(msgspec.Struct):
    message: str = ""
    type: str | None = None
    code: str | int | None = None
    #: Gemini: ``RESOURCE_EXHAUSTED``...; Azure: the number.
    status: str | int | None = None


class _ErrorEnvelope(msgspec.Struct):
    error: _ErrorBody | None = None
    message: str | None = None
    #: Bedrock's exception name (also in the ``x-amzn-errortype`` header).
    kind: str | None = msgspec.field(default=None, name="__type")


_envelope = msgspec.json.Decoder(_ErrorEnvelope)


def error_fields(raw: bytes) -> tuple[str, str]:
    """(the error's type or code, its message) from a provider's error body, as far as
    it is JSON of the usual shapes (``{"error": {...}}`` or ``{"message": ...}``)."""
    try:
        env = _envelope.decode(raw)
    except msgspec.DecodeError:
        return "", raw[:300].decode("utf-8", "replace").strip()
    err = env.error
    if err is not None:
        status = err.status if isinstance(err.status, str) else None
        kind = err.type or (str(err.code) if err.code is not None else "") or status or ""
        return kind, err.message
    return env.kind or "", env.message or ""


# --- what the translations share (pure) ---------------------------------------------

#: What a provider whose request is translated field by field carries besides the
#: core fields; anything else is refused before the call, naming the field.
TRANSLATED = Capabilities(
    fields=frozenset(
        {"tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p", "stop"}
    ),
    parts=frozenset({"text", "image_url"}),
)


class _Function(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class _Tool(msgspec.Struct):
    type: str = "function"
    function: _Function | None = None


_tools = msgspec.json.Decoder(list[_Tool])


class _ImageURL(msgspec.Struct):
    url: str


class _ImagePart(msgspec.Struct):
    image_url: _ImageURL | str


_image_part = msgspec.json.Decoder(_ImagePart)
_any = msgspec.json.Decoder()


def read_tools(
    request: InferenceRequest,
) -> list[tuple[str, str | None, dict[str, Any] | None]] | None:
    """(name, description, JSON schema of the parameters) of each function ``tools`` offers;
    None when the request has no ``tools``.

    Raises:
        BadRequest: ``tools`` is not a list of functions.
    """
    raw = request.extra.get("tools")
    if raw is None:
        return None
    try:
        tools = _tools.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadRequest(f"`tools`: {exc}", param="tools") from None
    return [
        (t.function.name, t.function.description, t.function.parameters)
        for t in tools
        if t.function is not None
    ]


def image_url(raw: msgspec.Raw | None, where: str) -> str:
    """The URL of an ``image_url`` part (an object's ``url``, or the bare string).

    Raises:
        BadRequest: the part has none.
    """
    try:
        part = _image_part.decode(raw or b"{}")
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise BadRequest(f"`{where}.image_url.url` is missing", param=where) from None
    return part.image_url if isinstance(part.image_url, str) else part.image_url.url


class Image(msgspec.Struct, frozen=True):
    """An ``image_url`` part: its URL, and for a base64 ``data:`` URL its media type and data."""

    url: str
    media: str = ""
    data: str = ""


#: How a provider says a text piece and an image (``where`` names the part in errors).
Say = Callable[[str], dict[str, Any]]
Show = Callable[[Image, str], dict[str, Any]]


def content_parts(m: Message, i: int, provider: str, say: Say, show: Show) -> list[dict[str, Any]]:
    """The blocks of message ``i``'s content in a provider's terms: a string or text
    parts through ``say``, image parts through ``show`` (empty text dropped).

    Raises:
        BadRequest: a part of another type (naming it), or one ``show`` refuses.
    """
    c = m.content
    if c is None:
        return []
    if isinstance(c, str):
        return [say(c)] if c else []
    out: list[dict[str, Any]] = []
    for j, p in enumerate(c):
        where = f"messages[{i}].content[{j}]"
        if p.type == "text":
            if p.text:
                out.append(say(p.text))
        elif p.type == "image_url":
            url = image_url(p.raw, where)
            head, _, data = url.removeprefix("data:").partition(",")
            media, _, encoding = head.partition(";")
            inline = url.startswith("data:") and encoding == "base64" and bool(data)
            out.append(show(Image(url, media, data) if inline else Image(url), where))
        else:  # the capabilities check refused it already; a guard for direct callers
            raise BadRequest(
                f"`{where}`: `{p.type}` parts cannot be sent to {provider}",
                param=where,
                code="unsupported_content",
            )
    return out


def parse_arguments(text: str, where: str) -> Any:
    """A tool call's arguments as the JSON value they are.

    Raises:
        BadRequest: they are not JSON.
    """
    try:
        return _any.decode(text or "{}")
    except msgspec.DecodeError:
        raise BadRequest(f"`{where}` is not JSON", param=where) from None


def one_choice(request: InferenceRequest) -> None:
    """Raises: BadRequest: the request asks for more than one choice (``n``)."""
    raw = request.extra.get("n")
    try:
        n = 1 if raw is None else msgspec.json.decode(raw, type=int | None) or 1
    except (msgspec.DecodeError, msgspec.ValidationError):
        n = 1
    if n > 1:
        raise BadRequest("`n`: this backend answers one choice per request", param="n")


# --- the adapter -------------------------------------------------------------------------


class NativeAdapter(TransportOwner, Adapter):
    """Base of the provider adapters (see the module docstring)."""

    #: The decoder of a native reply's stream, whose deltas carry the provider's events:
    #: set with :attr:`~.base.Adapter.speaks` by an adapter that takes a client API's
    #: requests as they are (``anthropic``); the parse stage makes a request native only then.
    native_decoder: Callable[[str], StreamDecoder] | None = None

    def __init__(
        self,
        name: str,
        config: NativeAdapterConfig,
        *,
        hook: UpstreamHook = NULL_HOOK,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(
            name, list(config.models), policy=RetryPolicy.from_config(config), hook=hook, rng=rng
        )
        self.config = config
        self.upstream_names: Mapping[str, str] = (
            config.models if isinstance(config.models, dict) else {}
        )
        self.base_url = self.default_base_url() if not config.base_url else config.base_url
        self.transport: Transport | None = None

    # --- what a provider says --------------------------------------------------------

    def default_base_url(self) -> str:
        """Where the provider listens when ``base_url`` is not set."""
        raise ConfigError(f"adapter {self.name}: `base_url` is required")

    @abc.abstractmethod
    def auth_headers(self) -> Headers:
        """The headers every request carries (auth), read when the adapter opens.

        Raises:
            ConfigError: a variable the auth needs is not set.
        """

    @abc.abstractmethod
    def exchange(self, request: InferenceRequest, model: str) -> tuple[str, Headers, bytes]:
        """One try's request: (path and query below ``base_url``, headers, body).

        Raises:
            BadRequest: the request cannot be said in the provider's terms.
        """

    @abc.abstractmethod
    def decoder(self) -> StreamDecoder:
        """A fresh decoder of one reply's stream."""

    @abc.abstractmethod
    def status_error(self, status: int, raw: bytes, retry_after: float | None) -> GatewayError:
        """The error an answer with ``status`` and body ``raw`` is to the gateway."""

    async def signed(self, path: str, body: bytes) -> Headers:
        """Headers that sign this request (``bedrock``: SigV4); none by default."""
        return []

    # --- shared ---------------------------------------------------------------------------

    def env(self, variable: str, key: str) -> str:
        """The value of environment variable ``variable`` (named by the setting ``key``).

        Raises:
            ConfigError: it is not set.
        """
        value = os.environ.get(variable)
        if not value:
            raise ConfigError(
                f"adapter {self.name}: environment variable {variable} ({key}) is not set"
            )
        return value

    def upstream_model(self, model: str) -> str:
        """The provider's name for the public ``model``."""
        return self.upstream_names.get(model, model)

    async def aopen(self, nursery: trio.Nursery) -> None:
        """The transport to ``base_url`` (TLS for ``https://``), with the auth headers.

        Raises:
            ConfigError: a variable the auth needs is not set, a TLS file went bad,
                or a header would break the request head.
        """
        fixed = {
            "content-type": "application/json",
            "user-agent": USER_AGENT,
            **{k.lower(): v for k, v in self.config.headers.items()},
        }
        headers: Headers = [(k.encode(), v.encode()) for k, v in fixed.items()]
        headers += self.auth_headers()
        tls = self.backend_tls(self.base_url, self.config)
        try:
            self.transport = open_transport(
                self.name,
                self.base_url,
                headers,
                max_connections=self.config.max_connections,
                connect_timeout=self.config.connect_timeout_ms / 1000.0,
                tls=tls,
            )
        except (h1.HeaderError, UnicodeError, ValueError) as exc:
            raise ConfigError(f"adapter {self.name}: {exc}") from exc

    async def prepare(self, request: InferenceRequest) -> InferenceRequest:
        """``request`` fitted to ``context_window`` (the oldest history dropped).

        Raises:
            BadRequest: ``context_length_exceeded``, the prompt cannot fit.
        """
        return await fit_request(request, self.config.context_window, self.config.tokenizer)

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        transport = self.transport
        if transport is None:
            raise UpstreamConnectError(f"adapter {self.name} is not open")
        path, headers, body = self.exchange(request, self.upstream_model(request.model))
        headers = [
            *headers,
            *(await self.signed(path, body)),
            (BUDGET_HEADER, b"%d" % budget_ms(request.deadline)),
            (b"x-request-id", request.request_id.encode()),
            *((k.lower().encode(), v.encode()) for k, v in request.forward_headers.items()),
        ]
        with translate_errors(self.name):
            async with transport.stream("POST", path, headers, body, request.deadline) as reply:
                if reply.status != 200:
                    raw = await reply.read(ERROR_BODY_LIMIT)
                    after = reply.header(b"retry-after")
                    wait = parse_retry_after(after.decode("latin-1") if after else None)
                    raise self.status_error(reply.status, raw, wait)
                native = self.native_decoder if request.native is not None else None
                decoder = native(self.name) if native is not None else self.decoder()
                async for chunk in reply:
                    upstream_read(len(chunk))
                    for delta in decoder.feed(chunk):
                        await send.send(delta)
                    decoder.check()
                await send.send(decoder.end())
