"""Redis: the connection settings its users share, and a client for a URL.

``[sessions]`` and ``[cache]`` each name a Redis (the cache's default is the
sessions' URL); the Redis rate limiter and the spend ledger use the sessions' one.
:class:`RedisSettings` holds the keys both tables have; :func:`client_for_url`
makes the coredis client (coredis is imported then: only a Redis backend needs it).
"""

from __future__ import annotations

import re
from contextlib import AsyncExitStack
from typing import Any, Literal
from urllib.parse import urlsplit

from ..core.decoding import Section, field_error, positive


class RedisSettings(Section):
    """The keys of a table whose backend may be Redis (``[sessions]``, ``[cache]``)."""

    backend: Literal["memory", "redis"] = "memory"
    #: ``redis://``, ``rediss://``, ``unix://``, ``redis+cluster://h:p,h:p``,
    #: ``redis+sentinel://h:p,h:p/service[/db]``.
    url: str | None = None
    #: Connections for the request path.
    pool_size: int = 32
    #: Connections for followers (each blocks one in ``XREAD BLOCK``): live session
    #: events, or gateways following another gateway's answer.
    follow_pool_size: int = 64
    connect_timeout_ms: int = 1_000
    key_prefix: str = "aiserve"

    def __post_init__(self) -> None:
        positive(self, "pool_size", "follow_pool_size", "connect_timeout_ms")
        if not re.match(r"^[A-Za-z0-9_.-]{1,64}$", self.key_prefix):
            raise field_error("key_prefix", "must be 1-64 letters, digits or '_.-'")


def client_for_url(url: str, max_connections: int, connect_timeout: float) -> Any:
    """A coredis client for ``url`` (not yet entered).

    ``redis://``, ``rediss://``, ``unix://``: a single server.
    ``redis+cluster://host:port[,host:port...]``: Redis Cluster (startup nodes).
    ``redis+sentinel://host:port[,host:port...]/service[/db]``: the primary of a
    Sentinel-managed service.

    Raises:
        ValueError: an unsupported scheme or a malformed URL.
    """
    import coredis  # late: needed only with a Redis backend
    from coredis.connection import TCPLocation

    parts = urlsplit(url)
    common: dict[str, Any] = {"decode_responses": True, "connect_timeout": connect_timeout}
    if parts.scheme in ("redis", "rediss", "unix"):
        return coredis.Redis.from_url(url, max_connections=max_connections, **common)
    nodes = _nodes(parts.netloc, url)
    if parts.scheme == "redis+cluster":
        return coredis.RedisCluster(
            startup_nodes=[{"host": h, "port": p} for h, p in nodes],
            max_connections=max_connections,
            **common,
        )
    if parts.scheme == "redis+sentinel":
        path = [p for p in parts.path.split("/") if p]
        if not path:
            raise ValueError(f"{url!r}: a sentinel URL names the service: /service[/db]")
        db = int(path[1]) if len(path) > 1 else 0
        # Keyword arguments, not a `connection_kwargs` dict: coredis takes them as
        # **connection_kwargs (a dict under that name was passed on as one bogus option).
        sentinel = coredis.Sentinel(
            [TCPLocation(h, p) for h, p in nodes],
            db=db,
            max_connections=max_connections,
            **common,
        )
        return _SentinelPrimary(sentinel, sentinel.primary_for(path[0]))
    raise ValueError(
        f"{url!r}: scheme must be redis, rediss, unix, redis+cluster or redis+sentinel"
    )


class _SentinelPrimary:
    """The client of a Sentinel service's primary, entered with the sentinels it asks.

    coredis finds the primary through the sentinels' own clients, which work only
    once entered; entering the primary's client alone fails on the first command.
    Everything else is the primary's client.
    """

    def __init__(self, sentinel: Any, primary: Any) -> None:
        self._sentinel = sentinel
        self._primary = primary
        self._stack: AsyncExitStack | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._primary, name)

    async def __aenter__(self) -> Any:
        stack = AsyncExitStack()
        await stack.enter_async_context(self._sentinel)
        await stack.enter_async_context(self._primary)
        self._stack = stack
        return self

    async def __aexit__(self, *exc: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()


def _nodes(netloc: str, url: str) -> list[tuple[str, int]]:
    nodes = []
    for item in netloc.rpartition("@")[2].split(","):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{url!r}: every node must be host:port")
        nodes.append((host.strip("[]"), int(port)))
    return nodes
