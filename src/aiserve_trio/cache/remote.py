"""The cache across gateways: bounded backend calls, single flight through a shared
backend (Redis), and the semantic index every gateway follows.

- :class:`BackendCalls`: every backend call bounded by ``[cache] timeout_ms``; a
  failure is counted and the backend skipped for ``retry_ms``.
- :class:`SharedFlight`: a flight first claims its key across gateways -- the entry,
  or the lease (this gateway answers, publishing the pieces as they come, and stores
  the entry when it gives the lease up), or another gateway's answer to follow. A
  gateway that dies loses its lease; a follower that received nothing takes over.
- :class:`SharedIndex`: the semantic index's inserts on one capped log that a task
  per worker follows (catch-up at start, bounded; then blocking reads).

``service.py`` is local single flight; with a shared backend it hands a flight to
:meth:`SharedFlight.answer` first.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, TypeVar

import msgspec
import trio

from ..core.errors import GatewayError
from ..observability.events import CacheHook
from .backend import CacheBackend
from .entry import decode_pieces, encode_pieces
from .errors import CacheUnavailable, SharedReplyLost
from .flight import Flight, Producer
from .semantic import Item, Semantic, item_fields, item_of

if TYPE_CHECKING:
    from .settings import CacheConfig

log = logging.getLogger("aiserve_trio.cache")
T = TypeVar("T")
#: A follower reads a published answer that long after it ended.
KEEP_MS = 30_000
#: The semantic index's log is read in pages of this many records, ...
_INDEX_PAGE = 512
#: ... a follower waiting this long in each read for the next.
_INDEX_BLOCK_MS = 1_000


class BackendCalls:
    """Calls to one backend, each bounded; after a failure it is skipped a while."""

    def __init__(self, backend: CacheBackend, config: CacheConfig, hook: CacheHook) -> None:
        self.backend = backend
        self.config = config
        self.hook = hook
        self._timeout = config.timeout_ms / 1000.0
        self._down_until = -1.0

    async def __call__(self, op: str, fn: Callable[[], Awaitable[T]], *, extra_s: float = 0.0) -> T:
        """``fn()`` bounded by ``[cache] timeout_ms``; failures counted, then skipped a while.

        Raises:
            CacheUnavailable: it failed, timed out, or the backend is being skipped.
        """
        if not self.backend.shared:
            return await fn()  # in this process: nothing to wait for, nothing to fail
        now = trio.current_time()
        if now < self._down_until:
            self.hook.cache_error(op)
            raise CacheUnavailable(f"the cache is skipped after a failure ({op})")
        failure: CacheUnavailable | None = None
        with trio.move_on_after(self._timeout + extra_s):
            try:
                return await fn()
            except CacheUnavailable as exc:
                failure = exc
        self._down_until = trio.current_time() + self.config.retry_ms / 1000.0
        self.hook.cache_error(op)
        if failure is not None:
            log.warning("cache backend: %s", failure, exc_info=failure.__cause__)
            raise failure
        raise CacheUnavailable(f"the cache did not answer {op} in time")


@dataclass(frozen=True, slots=True)
class Storing:
    """What the service tells a shared flight about storing its answer."""

    ttl_s: float
    max_bytes: int
    #: The finished flight's entry, encoded; None (counted) when it must not be stored.
    blob: Callable[[str | None], bytes | None]
    #: Called once the entry is stored (counted; its question filed).
    stored: Callable[[], Awaitable[None]]
    #: Fails the flight for its members.
    fail: Callable[[GatewayError], None]


class SharedFlight:
    """Single flight across the gateways on one shared backend (see the module docstring)."""

    def __init__(self, calls: BackendCalls) -> None:
        self.calls = calls
        self.backend = calls.backend
        self.config = calls.config

    async def answer(
        self, flight: Flight, produce: Producer, until: float, storing: Storing
    ) -> bool:
        """Answer ``flight`` with the other gateways: the stored entry, the lease, or
        another gateway's answer. False: the backend failed; answer here, alone.

        Raises:
            SharedReplyLost: the gateway this one followed went away midway.
        """
        token = secrets.token_hex(8)
        lease = self.config.lease_ms
        while True:
            try:
                claim = await self.calls(
                    "claim",
                    partial(self.backend.claim, flight.key, token, lease, fresh=flight.fresh),
                )
            except CacheUnavailable:
                return False
            if claim.kind == "hit":
                assert claim.entry is not None
                flight.publish(claim.entry.pieces, "store")
                flight.finish()
                return True
            if claim.kind == "lead":
                await self._lead(flight, produce, token, until, storing)
                return True
            if claim.token is not None and await self._follow(flight, claim.token):
                return True
            if flight.log.pieces:
                raise SharedReplyLost(
                    "the gateway producing the answer this request shared went away "
                    "midway; it cannot be continued with another answer"
                )
            # That gateway let go before sending anything: claim again (take over).

    async def _lead(
        self, flight: Flight, produce: Producer, token: str, until: float, storing: Storing
    ) -> None:
        """Answer with the lease: publish the pieces for other gateways, then store."""
        capped: str | None = None
        failure: str | None = "cancelled"
        try:
            async with trio.open_nursery() as tasks:
                tasks.start_soon(self._keep_lease, flight.key, token)
                relayed = trio.Event()
                tasks.start_soon(self._relay, flight, token, relayed)
                try:
                    capped = await produce(partial(flight.publish, source="model"), until)
                    flight.finish()
                    failure = None
                except GatewayError as err:
                    failure = err.code or "upstream_error"
                    storing.fail(err)
                await relayed.wait()
                tasks.cancel_scope.cancel(reason="answer relayed")
        finally:
            blob = storing.blob(capped) if failure is None else None
            # Shielded and bounded: a cancelled leader still lets the others take over now.
            with trio.CancelScope(shield=True):
                try:
                    await self.calls(
                        "close",
                        partial(
                            self.backend.close,
                            flight.key,
                            token,
                            outcome="fail" if failure is not None else "done",
                            detail=failure or "",
                            blob=blob,
                            ttl_s=storing.ttl_s,
                            max_bytes=storing.max_bytes,
                            keep_ms=KEEP_MS,
                        ),
                    )
                    if blob is not None:
                        await storing.stored()
                except CacheUnavailable:
                    pass

    async def _keep_lease(self, key: str, token: str) -> None:
        lease = self.config.lease_ms
        while True:
            await trio.sleep(lease / 3000.0)
            try:
                if not await self.calls("renew", partial(self.backend.renew, key, token, lease)):
                    return  # lost: another may take over; our own members are still served
            except CacheUnavailable:
                continue

    async def _relay(self, flight: Flight, token: str, relayed: trio.Event) -> None:
        """Publish the flight's pieces for the gateways that follow it, as they come."""
        cursor = 0
        healthy = True
        try:
            while True:
                pieces = flight.log.since(cursor)
                if pieces and healthy:
                    try:
                        await self.calls(
                            "publish",
                            partial(
                                self.backend.publish,
                                flight.key,
                                token,
                                encode_pieces(pieces),
                                KEEP_MS,
                            ),
                        )
                    except CacheUnavailable:
                        healthy = False  # the others will see the lease go and take over
                cursor += len(pieces)
                if flight.log.ended and cursor >= len(flight.log.pieces):
                    return
                await flight.wait(cursor)
        finally:
            relayed.set()

    async def _follow(self, flight: Flight, token: str) -> bool:
        """Follow another gateway's answer; False when it went away or failed."""
        after = "0-0"
        lease = self.config.lease_ms
        while True:
            try:
                records = await self.calls(
                    "read",
                    partial(self.backend.read, flight.key, token, after, lease),
                    extra_s=lease / 1000.0,
                )
                if (
                    not records
                    and await self.calls("holder", partial(self.backend.holder, flight.key))
                    != token
                ):
                    return False  # it died without a word (its lease expired)
            except CacheUnavailable:
                return False
            for record in records:
                after = record.id
                if record.kind == "pieces":
                    try:
                        pieces = decode_pieces(record.data)
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        return False  # a gateway of another version: answer here
                    flight.publish(pieces, "remote")
                elif record.kind == "done":
                    flight.finish()
                    return True
                else:
                    return False


class SharedIndex:
    """The semantic index's inserts shared through the backend's log (see the module docstring)."""

    def __init__(self, calls: BackendCalls, semantic: Semantic) -> None:
        self.calls = calls
        self.semantic = semantic
        self.scope = trio.CancelScope()

    async def share(self, item: Item) -> None:
        await self.calls(
            "index_add",
            partial(
                self.calls.backend.index_add,
                item_fields(item),
                self.calls.config.semantic_max_entries,
            ),
        )

    async def follow(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep this worker's semantic index up with every gateway's inserts: read what
        the log holds (at most ``semantic_catch_up_ms``, then the worker serves), then
        follow it. Failures are counted and retried after ``retry_ms``; meanwhile the
        index misses what others insert, which is a miss, never a wrong answer."""
        config, backend = self.calls.config, self.calls.backend
        after = "0-0"
        with self.scope:
            with trio.move_on_after(config.semantic_catch_up_ms / 1000.0):
                while True:
                    read = partial(backend.index_read, after, _INDEX_PAGE, None)
                    try:
                        page = await self.calls("index_read", read)
                    except CacheUnavailable:
                        break
                    after = self._file(page, after)
                    if len(page) < _INDEX_PAGE:
                        break
            task_status.started()
            while True:
                read = partial(backend.index_read, after, _INDEX_PAGE, _INDEX_BLOCK_MS)
                try:
                    page = await self.calls("index_read", read, extra_s=_INDEX_BLOCK_MS / 1000.0)
                except CacheUnavailable:
                    await trio.sleep(config.retry_ms / 1000.0)
                    continue
                after = self._file(page, after)

    def _file(self, page: list[tuple[str, dict[str, str]]], after: str) -> str:
        for ident, fields in page:
            item = item_of(fields)
            if item is not None:
                self.semantic.index.add(item)
            after = ident
        return after
