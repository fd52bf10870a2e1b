"""The response cache's settings: a route's ``cache = { ... }`` and ``[cache]``.

A leaf module (msgspec and the decoding helpers): the config imports it.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from ..core.decoding import Section, field_error, positive
from ..util.redisconn import RedisSettings


class RouteSemantic(Section):
    """A route's semantic cache tier (``cache = { ..., semantic = { ... } }``).

    After an exact miss, the last user message is embedded and an answer stored
    for a question whose wording was near is served -- only when everything else
    matches exactly, the facts of the question included (``cache/semantic.py``).
    """

    #: The adapter (``[adapters.NAME]``) that embeds the question.
    embeddings: str
    #: The embedding model, as that adapter names it.
    model: str
    #: The least cosine similarity served; tune it on your own questions
    #: (docs/benchmarks.md, semantic).
    threshold: float = 0.92
    #: The embedding call is given up after this long (or at the context stage's
    #: cut, if sooner): the request goes on as an exact miss.
    timeout_ms: int = 250
    #: A longer last message is not looked up nor filed (a semantic cache is for
    #: questions; reading the facts of a long text would hold the worker).
    max_chars: int = 2_000

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise field_error("threshold", "must be in (0, 1]")
        positive(self, "timeout_ms", "max_chars")


class RouteCache(Section):
    """A route's response cache (``cache = { ... }`` on a route; off without it).

    Exact match on everything that changes the answer (see ``cache/key.py``);
    what is stored is the reply as the client got it, after the output policies.
    """

    #: ``cache = { enabled = false, ... }`` keeps the settings and turns it off.
    enabled: bool = True
    #: Seconds an entry is served after it was written.
    ttl_s: float = 300.0
    #: Models (as the client names them) whose replies are cached; empty: all.
    models: list[str] = msgspec.field(default_factory=list)
    #: A reply larger than this (encoded) is served but not stored.
    max_entry_bytes: int = 1_048_576
    #: Only requests that ask for a repeatable answer (``temperature`` 0 or a
    #: ``seed``) are looked up, shared and stored; false: every request.
    deterministic_only: bool = True
    #: The semantic tier behind the exact cache; off without it.
    semantic: RouteSemantic | None = None

    def __post_init__(self) -> None:
        positive(self, "ttl_s", "max_entry_bytes")


class CacheConfig(RedisSettings):
    """``[cache]``: where the routes' caches keep their entries."""

    #: ``memory``: per worker, LRU bounded by ``max_bytes``; ``redis``: shared by
    #: every gateway on the server, and identical requests in flight on different
    #: gateways share one upstream call.
    backend: Literal["memory", "redis"] = "memory"
    #: Redis URL (the schemes of ``[sessions] url``); default: ``[sessions] url``.
    url: str | None = None
    #: Memory backend: bytes of entries held at most (least recently used evicted first).
    max_bytes: int = 67_108_864
    #: Every Redis call is given up after this long (the request goes on uncached).
    timeout_ms: int = 50
    #: After a Redis failure the cache is skipped for this long (no waiting on a
    #: server that is down), then tried again.
    retry_ms: int = 1_000
    #: How long a gateway answering a request for others holds its claim without
    #: renewing it (renewed every third of it): when it dies, another takes over after this.
    lease_ms: int = 3_000
    #: Redis ``INFO stats`` (keyspace hits and misses) is read this often.
    stats_interval_s: float = 15.0
    #: Semantic tier: questions (vectors) each worker's index holds at most, least
    #: recently used out (with Redis, also about how many its shared log keeps).
    semantic_max_entries: int = 50_000
    #: Semantic tier: bytes each worker's index holds at most, with either backend --
    #: vectors (unused rows of a guard's matrix too), questions, keys and overheads;
    #: least recently used out, across guards (``aiserve_cache_semantic_bytes``).
    semantic_max_bytes: int = 67_108_864
    #: Semantic tier with Redis: a starting worker reads the shared index this long at most.
    semantic_catch_up_ms: int = 2_000

    def __post_init__(self) -> None:
        positive(self, "max_bytes", "timeout_ms", "retry_ms", "lease_ms")
        super().__post_init__()  # the Redis keys, checked in the order they were
        positive(
            self,
            "stats_interval_s",
            "semantic_max_entries",
            "semantic_max_bytes",
            "semantic_catch_up_ms",
        )
