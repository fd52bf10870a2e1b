"""The upstream transport: one interface every HTTP adapter speaks through.

An adapter (``openai`` and the native providers) builds the request -- method, a
path under its ``base_url``, headers, body -- and gets back an exchange: the
status, the headers, and the body as an async stream of bytes (an event stream is
decoded by the adapter: ``sse_parser.py``). Every failure of the transport reaches
the adapter already translated into the gateway's
:class:`~aiserve_trio.core.errors.UpstreamError` hierarchy, naming the adapter; a
status is not a failure here, the adapter decides what a 4xx or 5xx means
(:func:`status_error` is the usual answer).

Three implementations:

- :class:`H1Transport`, the lean HTTP/1.1 client (``h1.py``) over TCP or TLS:
  what every backend gets unless it asks for HTTP/2;
- :class:`H2Transport`, the lean HTTP/2 client (``h2client.py``): ``http2 = true``,
  h2c with prior knowledge on ``http://``, ALPN ``h2`` on ``https://``;
- :class:`Httpx2Transport`, httpx2: ``client = "httpx2"`` (HTTP/1.1, or HTTP/2 with
  ``http2 = true``), and a test's own httpx2 transport.

:func:`open_transport` picks one from an adapter's settings. Why the gateway
keeps a client of its own is in ``docs/architecture.md`` (the transport section).

Usage::

    async with transport.stream("POST", "/chat/completions", headers, body, deadline) as reply:
        if reply.status != 200:
            raise status_error(name, reply.status, await reply.read(2048),
                               reply.header(b"retry-after"))
        async for chunk in reply:
            ...
"""

from __future__ import annotations

import contextlib
import email.utils
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, final

import httpx2
import msgspec
import trio

from ..core.errors import (
    ConfigError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamTLSError,
)
from . import h1, h2client
from .compat import pool_connections
from .settings import UpstreamTLS
from .sse_parser import SSEDecodeError
from .tls import TLSFileError, TLSSettings

if TYPE_CHECKING:
    from ..observability.events import UpstreamHook

__all__ = [
    "PER_CLIENT_HTTP1",
    "PER_CLIENT_HTTP2",
    "ClientPool",
    "H1Transport",
    "H2Transport",
    "Httpx2Transport",
    "Reply",
    "Transport",
    "open_transport",
    "parse_retry_after",
    "status_error",
    "translate_errors",
]

#: How long closing an httpx2 response may take once the request is over.
_CLOSE_GRACE = 1.0
#: Streams one httpx2 client carries: HTTP/1.1 connections per pool / HTTP/2 streams.
PER_CLIENT_HTTP1 = 64
PER_CLIENT_HTTP2 = 100

Headers = Sequence[tuple[bytes, bytes]]


class Reply(Protocol):
    """The answer of one exchange: the status and headers are read; the body streams."""

    @property
    def status(self) -> int: ...

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower case), if present."""
        ...

    def __aiter__(self) -> AsyncIterator[bytes]:
        """The body, decoded (gzip, deflate), in the pieces it arrived in (never empty)."""
        ...

    async def read(self, limit: int) -> bytes:
        """Up to about ``limit`` bytes of the body (an error body, a JSON answer)."""
        ...


class Transport(Protocol):
    """Requests to one backend (``base_url``), over connections it keeps."""

    def stream(
        self, method: str, path: str, headers: Headers, body: bytes, deadline: float
    ) -> AbstractAsyncContextManager[Reply]:
        """One exchange, as an async context manager around its :class:`Reply`.

        Entering sends the request and reads the response head; leaving closes the
        response (over HTTP/1.1 a connection is kept only when its response was read to
        the end; over HTTP/2 a stream left before its end is reset, its connection kept).

        Args:
            method: ``GET`` or ``POST``.
            path: below ``base_url`` (``/chat/completions``), a query string allowed.
            headers: this request's headers, names in lower case; one named like a
                fixed header (given when the transport was made) replaces it.
            body: the request body (empty for a GET).
            deadline: Trio time by which the exchange must be over: connect, each
                write and each read are bounded by what is left then.

        Raises:
            UpstreamError: how it failed (:class:`UpstreamTLSError`,
                :class:`UpstreamConnectError`, :class:`UpstreamTimeout`,
                :class:`UpstreamProtocolError`), naming the adapter; from the body's
                iteration too.
        """
        ...

    def connections(self) -> tuple[int, int] | None:
        """(open connections, of which busy); None when the client cannot tell."""
        ...

    async def aclose(self) -> None:
        """Close the idle connections (busy ones close when their exchange ends)."""
        ...


class TransportOwner:
    """What an adapter that owns one :class:`Transport` does the same whatever its
    wire format (``openai``, the native providers): its backend's TLS, its connections
    and its close. A base before :class:`~.base.Adapter` in the adapter's bases."""

    name: str
    hook: UpstreamHook
    transport: Transport | None = None

    def backend_tls(self, base_url: str, settings: UpstreamTLS) -> TLSSettings | None:
        """The TLS to ``base_url`` with the adapter's settings (None for ``http://``);
        each handshake reported to the hook.

        Raises:
            ConfigError: a TLS file became unusable since the config was loaded.
        """
        if not base_url.startswith("https://"):
            return None
        name = self.name
        host = httpx2.URL(base_url).host
        try:
            return TLSSettings.from_config(
                settings, host, lambda kind: self.hook.tls_handshake(name, kind)
            )
        except TLSFileError as exc:
            raise ConfigError(f"adapter {name}: {exc}") from None

    async def aclose(self) -> None:
        if self.transport is not None:
            transport, self.transport = self.transport, None
            await transport.aclose()

    def connections(self) -> tuple[int, int] | None:
        """(open upstream connections, of which busy); None when the client cannot tell."""
        return self.transport.connections() if self.transport is not None else (0, 0)


# --- errors, at the boundary -------------------------------------------------------


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
    if isinstance(exc, h1.TLSError):
        return UpstreamTLSError(f"{where}: TLS with the model backend failed: {exc.reason}")
    if isinstance(exc, h1.H1Timeout):
        return UpstreamTimeout(f"{where}: the model backend timed out ({type(exc).__name__})")
    if isinstance(exc, h1.ConnectError):
        return UpstreamConnectError(f"{where}: cannot connect to the model backend")
    if isinstance(exc, h1.ClosedAfterSend):
        return UpstreamConnectError(
            f"{where}: the model backend closed a reused connection after the request "
            "went out (it may have seen it)",
            code="upstream_closed_after_send",
        )
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


def status_error(
    where: str, status: int, raw: bytes, retry_after: bytes | None
) -> UpstreamStatusError:
    """The error for an upstream answer with a status the adapter did not want.

    ``raw``: the start of the error body (quoted, cut to 300 characters).
    """
    detail = raw[:2048].decode("utf-8", "replace").strip()
    return UpstreamStatusError(
        f"{where}: the model backend answered {status}: {detail[:300]}",
        upstream_status=status,
        retry_after=parse_retry_after(
            retry_after.decode("latin-1") if retry_after is not None else None
        ),
    )


def _timeouts(deadline: float, connect: float) -> tuple[float, float]:
    """(io, connect) seconds for an exchange due by ``deadline``: never beyond it."""
    # The floor keeps them positive should the clock have passed the deadline since
    # the caller checked; the caller's cancel scope is the backstop.
    remaining = max(deadline - trio.current_time(), 1e-3)
    return remaining, min(connect, remaining)


def _split(base_url: str) -> tuple[str, str, int, str, str]:
    """(scheme, host, port, Host header, path prefix) of ``base_url``."""
    url = httpx2.URL(base_url.rstrip("/"))
    scheme = url.scheme
    port = url.port or (443 if scheme == "https" else 80)
    name = f"[{url.host}]" if ":" in url.host else url.host  # an IPv6 literal
    host = name if url.port is None else f"{name}:{url.port}"
    return scheme, url.host, port, host, url.raw_path.decode("ascii").rstrip("/")


# --- the lean HTTP/1.1 client --------------------------------------------------------


@final
class H1Transport:
    """The lean HTTP/1.1 client (``h1.py``): plain TCP for ``http://``, TLS for ``https://``."""

    __slots__ = ("_connect_s", "_fixed", "_heads", "_host", "_prefix", "name", "pool")

    def __init__(
        self,
        name: str,
        base_url: str,
        headers: Headers,
        *,
        max_connections: int,
        connect_timeout: float,
        tls: TLSSettings | None = None,
        connect: h1.Connector | None = None,
    ) -> None:
        """Args:
        name: the adapter's, for errors and the handshake counter.
        base_url: ``http://`` or ``https://`` (``https://`` needs ``tls``).
        headers: sent on every request (names in lower case); checked here.
        max_connections: exchanges at once; more wait their turn.
        connect_timeout: seconds a new connection (TLS handshake included) may take.
        tls: the TLS context and session store, for ``https://``.
        connect: makes a connection instead of TCP (tests).

        Raises:
            h1.HeaderError: a fixed header would break the request head.
        """
        scheme, hostname, port, host, prefix = _split(base_url)
        if scheme == "https" and tls is None:
            raise ValueError(f"{base_url}: https needs TLS settings")
        self.name = name
        self._host = host
        self._prefix = prefix
        self._fixed = {k: v for k, v in headers}
        for k, v in self._fixed.items():  # checked once: a bad one fails at start-up
            h1.RequestHead("GET", "/", host, [(k, v)])
        self._connect_s = connect_timeout
        self._heads: dict[tuple[str, str, frozenset[bytes]], h1.RequestHead] = {}
        self.pool = h1.H1Pool(
            hostname,
            port,
            max_connections=max_connections,
            keepalive_expiry=30.0,
            connect=connect,
            tls=tls if scheme == "https" else None,
        )

    def _head(self, method: str, path: str, replaced: frozenset[bytes]) -> h1.RequestHead:
        key = (method, path, replaced)
        head = self._heads.get(key)
        if head is None:
            fixed = [(k, v) for k, v in self._fixed.items() if k not in replaced]
            head = self._heads[key] = h1.RequestHead(method, self._prefix + path, self._host, fixed)
        return head

    def stream(
        self, method: str, path: str, headers: Headers, body: bytes, deadline: float
    ) -> _LeanExchange:
        fixed = self._fixed
        replaced = frozenset(k for k, _ in headers if k in fixed) if fixed else frozenset()
        io, connect = _timeouts(deadline, self._connect_s)
        with translate_errors(self.name):
            head = self._head(method, path, replaced).build(
                list(headers), body if body or method != "GET" else None
            )
        return _LeanExchange(self.name, self.pool.request(head, body, h1.Timeouts(io, connect)))

    def connections(self) -> tuple[int, int]:
        return self.pool.connections()

    async def aclose(self) -> None:
        await self.pool.aclose()


@final
class H2Transport:
    """The lean HTTP/2 client (``h2client.py``): h2c for ``http://``, ALPN h2 for ``https://``."""

    __slots__ = (
        "_authority",
        "_connect_s",
        "_fixed",
        "_heads",
        "_prefix",
        "_scheme",
        "name",
        "pool",
    )

    def __init__(
        self,
        name: str,
        base_url: str,
        headers: Headers,
        *,
        max_connections: int,
        connect_timeout: float,
        tls: TLSSettings | None = None,
        per_connection: int = PER_CLIENT_HTTP2,
    ) -> None:
        """Args as :class:`H1Transport`'s; ``per_connection``: streams one connection
        carries at most (the server may allow fewer). The connection-specific headers
        HTTP/2 forbids (``connection``, ``host``, ``transfer-encoding``...) are not sent.

        Raises:
            h1.HeaderError: a fixed header would break the request (CR, LF or NUL).
        """
        scheme, hostname, port, host, prefix = _split(base_url)
        if scheme == "https" and tls is None:
            raise ValueError(f"{base_url}: https needs TLS settings")
        self.name = name
        self._scheme = scheme.encode("ascii")
        self._authority = host.encode("ascii")
        self._prefix = prefix
        self._fixed = {k: v for k, v in headers if k not in h2client.FORBIDDEN}
        for k, v in self._fixed.items():  # checked once: a bad one fails at start-up
            h1.RequestHead("GET", "/", host, [(k, v)])
        self._connect_s = connect_timeout
        self._heads: dict[tuple[str, str, frozenset[bytes]], list[tuple[bytes, bytes]]] = {}
        self.pool = h2client.H2Pool(
            hostname,
            port,
            max_connections=max_connections,
            per_connection=per_connection,
            tls=tls if scheme == "https" else None,
        )

    def _head(
        self, method: str, path: str, replaced: frozenset[bytes]
    ) -> list[tuple[bytes, bytes]]:
        key = (method, path, replaced)
        head = self._heads.get(key)
        if head is None:
            head = self._heads[key] = [
                (b":method", method.encode("ascii")),
                (b":scheme", self._scheme),
                (b":authority", self._authority),
                (b":path", (self._prefix + path).encode("ascii")),
                *((k, v) for k, v in self._fixed.items() if k not in replaced),
            ]
        return head

    def stream(
        self, method: str, path: str, headers: Headers, body: bytes, deadline: float
    ) -> _LeanExchange:
        fixed = self._fixed
        replaced = frozenset(k for k, _ in headers if k in fixed) if fixed else frozenset()
        io, connect = _timeouts(deadline, self._connect_s)
        with translate_errors(self.name):
            sent = self._head(method, path, replaced).copy()
            for k, v in headers:
                if k not in h2client.FORBIDDEN:
                    sent.append((h1.check_header(k, "name"), h1.check_header(v, "value")))
            if body or method != "GET":
                sent.append((b"content-length", b"%d" % len(body)))
        return _LeanExchange(self.name, self.pool.request(sent, body, h1.Timeouts(io, connect)))

    def connections(self) -> tuple[int, int]:
        return self.pool.connections()

    async def aclose(self) -> None:
        await self.pool.aclose()


class _Lean(Protocol):
    """What :class:`_LeanExchange` wraps: ``h1.Response`` or ``h2client.Response``."""

    @property
    def status(self) -> int: ...

    def header(self, name: bytes) -> bytes | None: ...

    async def __aenter__(self) -> object: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    async def __anext__(self) -> bytes: ...

    async def read(self, limit: int) -> bytes: ...


@final
class _LeanExchange:
    """A lean client's exchange with its errors translated (the :class:`Reply` of
    :class:`H1Transport` and :class:`H2Transport`)."""

    __slots__ = ("_response", "_where")

    def __init__(self, where: str, response: _Lean) -> None:
        self._where = where
        self._response = response

    @property
    def status(self) -> int:
        return self._response.status

    def header(self, name: bytes) -> bytes | None:
        return self._response.header(name)

    async def __aenter__(self) -> _LeanExchange:
        with translate_errors(self._where):
            await self._response.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._response.__aexit__(exc_type, exc, tb)

    def __aiter__(self) -> _LeanExchange:
        return self

    async def __anext__(self) -> bytes:
        with translate_errors(self._where):
            return await self._response.__anext__()

    async def read(self, limit: int) -> bytes:
        with translate_errors(self._where):
            return await self._response.read(limit)


# --- httpx2 ------------------------------------------------------------------------


class ClientPool:
    """httpx2 clients made on demand, each carrying at most ``per_client`` streams at once.

    Not one client: httpcore2 walks every connection of its pool whenever a
    response closes, so with one client the cost of ending a stream grew with the
    number of open streams (31 % of the worker's time at 2,000 open streams;
    docs/benchmarks.md, scenario (c)). A request takes the first client with room, so at low
    concurrency one client (and its warm connections) serves everything.
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


@final
class Httpx2Transport:
    """httpx2 clients (:class:`ClientPool`): HTTP/2 over ALPN or h2c, or HTTP/1.1."""

    __slots__ = ("_base", "_connect_s", "_extensions", "_fixed", "clients", "name")

    def __init__(
        self,
        name: str,
        base_url: str,
        headers: Headers,
        *,
        max_connections: int,
        connect_timeout: float,
        http2: bool,
        tls: TLSSettings | None = None,
        transport: httpx2.AsyncBaseTransport | None = None,
    ) -> None:
        """Args as :class:`H1Transport`'s; ``http2``: HTTP/2 (ALPN over https, prior
        knowledge over http); ``transport``: httpx2's own transport (tests)."""
        self.name = name
        self._base = base_url.rstrip("/")
        self._fixed = list(headers)
        self._connect_s = connect_timeout
        # server_name: httpcore2 sends it in SNI and verifies the certificate against it.
        self._extensions = {"sni_hostname": tls.server_name} if tls is not None else {}
        per_client = PER_CLIENT_HTTP2 if http2 else PER_CLIENT_HTTP1
        # Over HTTP/2 a client keeps one connection; the limit matters only if
        # the server turns HTTP/2 down and every stream needs its own.
        limits = httpx2.Limits(
            max_connections=per_client, max_keepalive_connections=per_client, keepalive_expiry=30.0
        )
        cleartext_h2 = http2 and base_url.startswith("http://")
        verify = tls.context if tls is not None else True

        def make() -> httpx2.AsyncClient:
            return httpx2.AsyncClient(
                http1=not cleartext_h2,
                http2=http2,
                limits=limits,
                transport=transport,
                follow_redirects=False,
                trust_env=False,
                verify=verify,
            )

        self.clients = ClientPool(make, per_client, max_connections)

    @contextlib.asynccontextmanager
    async def stream(
        self, method: str, path: str, headers: Headers, body: bytes, deadline: float
    ) -> AsyncIterator[Reply]:
        io, connect = _timeouts(deadline, self._connect_s)
        timeout = httpx2.Timeout(io, connect=connect)
        names = {k for k, _ in headers}
        req = httpx2.Request(
            method,
            self._base + path,
            content=body if body or method != "GET" else None,
            headers=[*(kv for kv in self._fixed if kv[0] not in names), *headers],
            extensions={"timeout": timeout.as_dict(), **self._extensions},
        )
        response: httpx2.Response | None = None
        with self.clients.lease() as client:
            try:
                with translate_errors(self.name):
                    response = await client.send(req, stream=True)
                yield _HttpxReply(self.name, response)
            finally:
                if response is not None:
                    # Shielded so that a cancelled request still closes the upstream
                    # stream (the backend sees the disconnect and stops generating).
                    with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_GRACE):
                        await response.aclose()

    def connections(self) -> tuple[int, int] | None:
        return self.clients.connections()

    async def aclose(self) -> None:
        await self.clients.aclose()


@final
class _HttpxReply:
    """An httpx2 response with its errors translated (closed by the exchange that made it)."""

    __slots__ = ("_chunks", "_response", "_where")

    def __init__(self, where: str, response: httpx2.Response) -> None:
        self._where = where
        self._response = response
        self._chunks: AsyncIterator[bytes] | None = None

    @property
    def status(self) -> int:
        return self._response.status_code

    def header(self, name: bytes) -> bytes | None:
        value = self._response.headers.get(name.decode("latin-1"))
        return None if value is None else value.encode("latin-1")

    def __aiter__(self) -> _HttpxReply:
        if self._chunks is None:
            self._chunks = self._response.aiter_bytes()
        return self

    async def __anext__(self) -> bytes:
        chunks = self._chunks
        assert chunks is not None  # set by __aiter__
        with translate_errors(self._where):
            return await chunks.__anext__()

    async def read(self, limit: int) -> bytes:
        return await h1.read_up_to(self, limit)


def open_transport(
    name: str,
    base_url: str,
    headers: Headers,
    *,
    max_connections: int,
    connect_timeout: float,
    http2: bool = False,
    client: str = "auto",
    tls: TLSSettings | None = None,
    transport: httpx2.AsyncBaseTransport | None = None,
) -> Transport:
    """The transport for an adapter's settings: a lean one (HTTP/1.1, or HTTP/2 with
    ``http2``) unless ``client = "httpx2"`` or a test's httpx2 ``transport`` asks for httpx2.

    Raises:
        h1.HeaderError: a fixed header would break the request head.
    """
    if client == "auto" and transport is None and http2:
        return H2Transport(
            name,
            base_url,
            headers,
            max_connections=max_connections,
            connect_timeout=connect_timeout,
            tls=tls,
        )
    if client == "auto" and transport is None:
        return H1Transport(
            name,
            base_url,
            headers,
            max_connections=max_connections,
            connect_timeout=connect_timeout,
            tls=tls,
        )
    return Httpx2Transport(
        name,
        base_url,
        headers,
        max_connections=max_connections,
        connect_timeout=connect_timeout,
        http2=http2,
        tls=tls,
        transport=transport,
    )
