"""Where entries live, and (Redis) how gateways agree who answers a key.

A backend stores entries and, when it is shared by several gateways
(:attr:`CacheBackend.shared`), arbitrates single flight between them: one
gateway *claims* a key (a short lease) and publishes its answer's pieces for
the others to read; when it is done it writes the entry and gives the lease up.

Backends do not time themselves out: the caller (``service.py``) bounds every
call. They raise :class:`~.errors.CacheUnavailable` when they fail.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import trio

from .entry import Entry
from .lru import ByteLRU


@dataclass(frozen=True, slots=True)
class Claim:
    """What claiming a key found: its entry, the lease (this gateway answers), or
    the token of the gateway that holds it (this one follows)."""

    kind: Literal["hit", "lead", "follow"]
    entry: Entry | None = None
    #: ``lead``: this gateway's token; ``follow``: the holder's (None: it just let go).
    token: str | None = None


@dataclass(frozen=True, slots=True)
class Record:
    """One record of a published answer: ``pieces`` (JSON of a list of
    :class:`~.entry.Replayed`), ``done``, or ``fail`` (data: the error's code)."""

    id: str
    kind: str
    data: str


class CacheBackend(abc.ABC):
    kind: str = ""
    #: Shared by several gateways: claims and published answers are needed.
    shared: bool = False

    async def aopen(self) -> None:  # noqa: B027 - optional hook
        """Connect (lazily: a gateway starts while its cache is down)."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        pass

    @abc.abstractmethod
    async def get(self, key: str) -> Entry | None:
        """The entry for ``key``, or None."""

    @abc.abstractmethod
    async def put(self, key: str, entry: Entry, blob: bytes, ttl_s: float) -> None:
        """Store ``entry`` (``blob`` is its encoding) for ``ttl_s`` seconds."""

    async def claim(self, key: str, token: str, lease_ms: int, *, fresh: bool) -> Claim:
        """The entry (unless ``fresh``), else the lease for ``token``, else who holds it.

        One step, so that no gateway starts a second upstream call for an answer
        another has just stored or is producing.
        """
        entry = None if fresh else await self.get(key)
        return Claim("hit", entry) if entry is not None else Claim("lead", token=token)

    # --- shared backends only: the claimed answer, published -------------------
    # A backend that keeps answers to one process never hands out a "follow"
    # claim, so nothing calls these on it: a call is a bug in the caller.

    def _not_shared(self) -> TypeError:
        return TypeError(f"{type(self).__name__} does not share answers between gateways")

    async def renew(self, key: str, token: str, lease_ms: int) -> bool:
        """Extend the lease if ``token`` still holds it."""
        raise self._not_shared()

    async def publish(self, key: str, token: str, pieces: bytes, keep_ms: int) -> None:
        """Append pieces of the answer for the gateways that follow it."""
        raise self._not_shared()

    async def close(
        self,
        key: str,
        token: str,
        *,
        outcome: Literal["done", "fail"],
        detail: str,
        blob: bytes | None,
        ttl_s: float,
        max_bytes: int,
        keep_ms: int,
    ) -> None:
        """End the published answer, store its entry (``blob``, if not over
        ``max_bytes``) and give the lease up -- in one step."""
        raise self._not_shared()

    async def holder(self, key: str) -> str | None:
        """The token holding ``key``'s lease, if any."""
        raise self._not_shared()

    async def read(self, key: str, token: str, after: str, block_ms: int) -> list[Record]:
        """Records of ``token``'s answer after ``after`` (``0-0``: from the start),
        waiting up to ``block_ms`` for the first."""
        raise self._not_shared()

    # --- shared backends only: the semantic index's inserts ----------------------

    async def index_add(self, fields: dict[str, str], max_len: int) -> None:
        """Append one question (the fields of a ``semantic.Item``) to the index's log,
        which keeps about ``max_len`` of the latest."""
        raise self._not_shared()

    async def index_read(
        self, after: str, count: int, block_ms: int | None
    ) -> list[tuple[str, dict[str, str]]]:
        """Up to ``count`` questions after id ``after`` (``0-0``: from the oldest kept),
        waiting up to ``block_ms`` for the first (None: not waiting)."""
        raise self._not_shared()

    def on_evict(self, fn: Callable[[str], None]) -> None:  # noqa: B027 - optional hook
        """Tell ``fn`` each key whose entry this process lets go of. A backend that
        evicts where this process cannot see (Redis) tells nothing: a semantic
        question whose entry is gone there is dropped when it is found."""

    # --- what the gauges show ---------------------------------------------------

    def held(self) -> tuple[int, int] | None:
        """(bytes, entries) held, when this process knows them."""
        return None

    async def server_stats(self) -> dict[str, float]:
        """The server's own counters (Redis ``INFO stats``), if it has any."""
        return {}


class MemoryBackend(CacheBackend):
    """Entries in this process: least recently used first out, bounded by bytes."""

    kind = "memory"

    def __init__(self, max_bytes: int) -> None:
        self._lru: ByteLRU[Entry] = ByteLRU(max_bytes)

    async def get(self, key: str) -> Entry | None:
        return self._lru.get(key, trio.current_time())

    async def put(self, key: str, entry: Entry, blob: bytes, ttl_s: float) -> None:
        self._lru.put(key, entry, len(blob), trio.current_time() + ttl_s)

    def on_evict(self, fn: Callable[[str], None]) -> None:
        self._lru.evicted = fn

    def held(self) -> tuple[int, int]:
        return self._lru.bytes, len(self._lru)
