"""The semantic tier: an answer for a question worded differently, never for another question.

Behind the exact cache, on a route whose ``cache`` has ``semantic = {...}``.
After an exact miss the context stage's :meth:`~.service.Cache.admit` asks
:meth:`Semantic.probe` for the request's *probe*: the last user message's
text, embedded through the named adapter within the context stage's time
(slow or failed: no probe, counted, the request goes on as an exact miss), and
its *guard* (:func:`~.key.semantic_guard`): everything of the exact key but
that message's wording -- tenant, route, channel, adapter and policy versions,
model, every sampling field, every earlier message (so session context too),
the session variables -- plus the message's facts (:func:`~.facts.facts`:
numbers, amounts, terms, dates, accounts, negation). :meth:`Semantic.search`
looks only among questions stored under the same guard, and the best at or
above the route's ``threshold`` is served as the exact tier serves a hit.

The probe rides on the flight that answers the miss; when its entry is
stored, :meth:`Semantic.insert` files the question under its guard. Vectors
live in an index per worker (:class:`VectorIndex`: exact cosine search with
numpy, a bucket per guard, bounded by ``[cache] semantic_max_bytes`` -- vectors,
questions and unused rows counted -- and ``semantic_max_entries``, least recently
used out first across guards); with the Redis backend the inserts also go on a
Redis stream every worker follows (``remote.py``), so every worker's index holds
every gateway's questions, and the entries themselves are the exact tier's, in
Redis. With the memory backend, an entry evicted from memory takes its question
with it (:meth:`Semantic.evicted`); an index item whose entry is gone otherwise
(TTL, Redis's eviction) is dropped when it is found.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import numpy as np
import trio

from ..adapters.base import EmbeddingRequest
from ..core.errors import GatewayError
from ..observability.events import NULL_HOOK, CacheHook
from .errors import CacheUnavailable
from .facts import facts
from .key import semantic_guard

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from ..adapters.base import Adapter, InferenceRequest
    from .key import RouteScope
    from .settings import RouteSemantic

T = TypeVar("T")
#: Rows scored between two checkpoints (~0.3 ms at 512 dimensions).
_CHUNK = 4096
#: The semantic hits the console lists.
RECENT = 20


@dataclass(frozen=True, slots=True)
class Probe:
    """A question as the semantic tier sees it: its guard, its vector, its text."""

    guard: str
    vector: NDArray[np.float32]
    question: str


@dataclass(frozen=True, slots=True)
class Found:
    """The nearest stored question under a probe's guard."""

    key: str
    question: str
    similarity: float


@dataclass(frozen=True, slots=True)
class Item:
    """One stored question: the exact key of its entry, under a guard."""

    guard: str
    key: str
    vector: NDArray[np.float32]
    question: str
    #: Unix seconds after which it is not served (its entry's TTL).
    expires: float


def unit(values: Any) -> NDArray[np.float32] | None:
    """``values`` as a float32 unit vector; None when empty, all zeros or not finite."""
    v = np.asarray(values, dtype=np.float32).ravel()
    n = float(np.linalg.norm(v)) if v.size else 0.0
    if not n or not np.isfinite(n):
        return None
    return v / n


class _Bucket:
    """The questions under one guard: their vectors as the rows of one matrix, kept
    in place (appended; a removed row is replaced by the last), and what each row
    stands for in lists beside it (the vector is not kept twice).

    The matrix starts at one row and doubles when full; it halves once a quarter or
    less of it is used (eviction, expiry), so its slack is at most three rows in four
    and a guard that held many questions once does not keep their room.
    """

    __slots__ = ("expires", "guard", "keys", "n", "pos", "questions", "rows")

    def __init__(self, guard: str, dims: int) -> None:
        self.guard = guard
        self.rows: NDArray[np.float32] = np.empty((1, dims), dtype=np.float32)
        self.keys: list[str] = []
        self.questions: list[str] = []
        #: Unix seconds after which each question is not served (its entry's TTL).
        self.expires: list[float] = []
        self.pos: dict[str, int] = {}
        self.n = 0

    def put(self, item: Item) -> int:
        """File ``item``; the bytes the matrix grew by."""
        at = self.pos.get(item.key)
        grown = 0
        if at is None:
            if self.n == len(self.rows):
                grown = self._resize(2 * len(self.rows))
            at = self.n
            self.n += 1
            self.keys.append(item.key)
            self.questions.append(item.question)
            self.expires.append(item.expires)
            self.pos[item.key] = at
        else:
            self.questions[at] = item.question
            self.expires[at] = item.expires
        self.rows[at] = item.vector
        return grown

    def drop(self, key: str) -> int | None:
        """Remove ``key``'s question; the bytes the matrix shrank by (None: not here)."""
        at = self.pos.pop(key, None)
        if at is None:
            return None
        last = self.n - 1
        if at != last:
            moved = self.keys[last]
            self.keys[at] = moved
            self.questions[at] = self.questions[last]
            self.expires[at] = self.expires[last]
            self.rows[at] = self.rows[last]
            self.pos[moved] = at
        self.keys.pop()
        self.questions.pop()
        self.expires.pop()
        self.n = last
        if last and last <= len(self.rows) // 4:
            return self._resize(len(self.rows) // 2)
        return 0

    def _resize(self, rows: int) -> int:
        """Move the used rows into a matrix of ``rows``; the change in bytes."""
        was = self.rows.nbytes
        moved = np.empty((rows, self.rows.shape[1]), dtype=np.float32)
        moved[: self.n] = self.rows[: self.n]
        self.rows = moved
        return moved.nbytes - was


#: What the index counts for a bucket besides its matrix's rows and its guard's
#: string: the bucket, its three lists and position dict (empty), the matrix's
#: header, and its slot in the index's dict of buckets. Measured with tracemalloc
#: (``tests/test_cache_semantic_index.py`` checks the account against it).
BUCKET_BYTES = 640
#: What the index counts for a question besides its key's and its text's strings:
#: its slots in the bucket's lists and position dict, its expiry (a float), and its
#: place in the index's order (an ordered dict's entry and link). Measured as above.
ITEM_BYTES = 200


class VectorIndex:
    """Questions by guard, searched exactly (cosine), bounded in bytes and in number:
    least recently used out first, across guards.

    Exact search over a guard's bucket, because a lookup only ever compares
    questions under one guard (buckets are small next to the whole index) and one
    core scores 10,000 vectors of 512 dimensions in about a millisecond
    (docs/benchmarks.md, semantic index: the measurement against usearch's HNSW).
    The product is ``np.einsum``: one thread, where BLAS's threads fight the other
    workers for the cores. A search scores ``_CHUNK`` rows between checkpoints.

    :attr:`bytes` is what the index holds, counted as it changes: every matrix
    whole (its unused rows too), each question's key and text, and the overheads
    above. A client may choose a new guard with every request (a ``seed``, the
    system prompt), so a bucket costs what it holds and not a fixed matrix, and
    ``max_bytes`` bounds the whole: past it, the least recently filed or served
    questions go, whatever their guard. One question per entry (its exact key):
    filing another for the same key replaces it, and :meth:`discard` drops it when
    its entry is evicted.
    """

    def __init__(self, max_entries: int, max_bytes: int = 67_108_864) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        #: The bytes held, as counted (see the class docstring).
        self.bytes = 0
        self._buckets: dict[str, _Bucket] = {}
        #: key -> its bucket's guard, least recently filed or served first.
        self._order: collections.OrderedDict[str, str] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def add(self, item: Item) -> None:
        """File ``item`` (replacing the question stored for the same entry), then
        evict the least recently used while over either bound."""
        dims = len(item.vector)
        cost = ITEM_BYTES + sys.getsizeof(item.key) + sys.getsizeof(item.question)
        if BUCKET_BYTES + sys.getsizeof(item.guard) + 4 * dims + cost > self.max_bytes:
            return  # alone over the bound: never held
        guard = self._order.get(item.key)
        if guard is not None and guard != item.guard:
            self.remove(guard, item.key)  # filed anew under another guard
        bucket = self._buckets.get(item.guard)
        if bucket is None:
            bucket = self._buckets[item.guard] = _Bucket(item.guard, dims)
            self.bytes += BUCKET_BYTES + sys.getsizeof(item.guard) + bucket.rows.nbytes
        elif bucket.rows.shape[1] != dims:
            return  # another model's vector under this guard: not comparable
        at = bucket.pos.get(item.key)
        if at is not None:
            self.bytes -= sys.getsizeof(bucket.questions[at]) - sys.getsizeof(item.question)
        else:
            self.bytes += cost
        self.bytes += bucket.put(item)
        self._order[item.key] = bucket.guard
        self._order.move_to_end(item.key)
        # Bounded: each turn removes a question.
        while self._order and (self.bytes > self.max_bytes or len(self._order) > self.max_entries):
            key, guard = next(iter(self._order.items()))
            self.remove(guard, key)

    def remove(self, guard: str, key: str) -> None:
        """Drop ``key``'s question if it is filed under ``guard``."""
        bucket = self._buckets.get(guard)
        if bucket is None:
            return
        at = bucket.pos.get(key)
        if at is None:
            return
        question = bucket.questions[at]
        shrank = bucket.drop(key)
        assert shrank is not None
        self.bytes += shrank - ITEM_BYTES - sys.getsizeof(key) - sys.getsizeof(question)
        del self._order[key]
        if not bucket.n:
            del self._buckets[guard]
            self.bytes -= BUCKET_BYTES + sys.getsizeof(bucket.guard) + bucket.rows.nbytes

    def discard(self, key: str) -> None:
        """Drop the question of the entry ``key``, whatever its guard: the entry was
        evicted (or expired) from this worker's memory."""
        guard = self._order.get(key)
        if guard is not None:
            self.remove(guard, key)

    def touch(self, key: str) -> None:
        """``key``'s question was served: it is the most recently used."""
        if key in self._order:
            self._order.move_to_end(key)

    async def search(self, guard: str, vector: NDArray[np.float32], now: float) -> Found | None:
        """The stored question under ``guard`` nearest to ``vector`` (expired ones skipped)."""
        bucket = self._buckets.get(guard)
        if bucket is None or bucket.rows.shape[1] != len(vector):
            return None
        best: tuple[float, int] | None = None
        for start in range(0, bucket.n, _CHUNK):
            if start:
                await trio.lowlevel.checkpoint()
            end = min(start + _CHUNK, bucket.n)
            scores = np.einsum("ij,j->i", bucket.rows[start:end], vector)
            for j in np.argsort(-scores):
                at = start + int(j)
                if bucket.expires[at] > now:  # the best of the chunk still served
                    score = float(scores[j])
                    if best is None or score > best[0]:
                        best = (score, at)
                    break
        if best is None:
            return None
        score, at = best
        return Found(bucket.keys[at], bucket.questions[at], min(score, 1.0))


@dataclass(frozen=True, slots=True)
class SemanticHit:
    """A semantic hit, as the console lists it for an operator to audit."""

    at: float
    route: str
    similarity: float
    asked: str
    stored: str
    #: The tenant that asked (the console shows an admin its own tenant's only).
    tenant: str = ""


def item_fields(item: Item) -> dict[str, str]:
    """``item`` as the fields of its record in the shared index's log."""
    return {
        "g": item.guard,
        "k": item.key,
        "v": base64.b64encode(item.vector.astype("<f4").tobytes()).decode(),
        "q": item.question,
        "x": repr(item.expires),
    }


def item_of(fields: dict[str, str]) -> Item | None:
    """The item of a record of the shared index's log; None for one this version
    cannot read."""
    try:
        raw = base64.b64decode(fields["v"], validate=True)
        vector = unit(np.frombuffer(raw, dtype="<f4")) if len(raw) % 4 == 0 else None
        if vector is None:
            return None
        return Item(fields["g"], fields["k"], vector, fields["q"], float(fields["x"]))
    except (KeyError, ValueError):
        return None


class _EmbeddingData(msgspec.Struct):
    embedding: list[float]


class _EmbeddingAnswer(msgspec.Struct):
    data: list[_EmbeddingData]


_answer = msgspec.json.Decoder(_EmbeddingAnswer)
_encode = msgspec.json.Encoder().encode


def question_of(request: InferenceRequest) -> tuple[str, dict[str, Any]] | None:
    """The last message's text and its other fields, when it is a user's text
    (else the request has no question for the semantic tier)."""
    if not request.messages:
        return None
    last = request.messages[-1]
    if last.role != "user" or last.tool_calls or last.part_types() - {"text"}:
        return None
    text = last.text()
    if not text.strip():
        return None
    return text, {"role": last.role, "name": last.name}


class Semantic:
    """The semantic tier of one app's cache: the embedder calls, the index, the hits."""

    def __init__(
        self, max_entries: int, hook: CacheHook = NULL_HOOK, *, max_bytes: int = 67_108_864
    ) -> None:
        self.index = VectorIndex(max_entries, max_bytes)
        self.hook = hook
        self.recent: collections.deque[SemanticHit] = collections.deque(maxlen=RECENT)
        #: Publishes an insert to the other workers (set with a shared backend).
        self.share: Callable[[Item], Awaitable[None]] | None = None

    async def probe(
        self,
        settings: RouteSemantic,
        embedder: Adapter,
        scope: RouteScope,
        *,
        request_id: str,
        tenant: str,
        channel: str,
        request: InferenceRequest,
        deadline: float,
    ) -> Probe | None:
        """The request's probe, or None: no user question last (or one longer than
        ``max_chars``), or the embedding failed or was late (counted as a cache
        error ``embed``)."""
        asked = question_of(request)
        if asked is None or len(asked[0]) > settings.max_chars:
            return None
        text, last = asked
        deadline = min(deadline, trio.current_time() + settings.timeout_ms / 1000.0)
        vector = await self._embed(settings, embedder, request_id, text, deadline)
        if vector is None:
            return None
        guard = semantic_guard(
            scope,
            tenant=tenant,
            channel=channel,
            model=request.model,
            earlier=[m.to_raw() for m in request.messages[:-1]],
            last=last,
            facts=facts(text),
            fields=request.extra,
            max_tokens=request.max_tokens,
            variables=request.variables,
            embedder=(settings.embeddings, settings.model),
        )
        return Probe(guard, vector, text)

    async def _embed(
        self,
        settings: RouteSemantic,
        embedder: Adapter,
        request_id: str,
        text: str,
        deadline: float,
    ) -> NDArray[np.float32] | None:
        body = {"model": msgspec.Raw(_encode(settings.model)), "input": msgspec.Raw(_encode(text))}
        call = EmbeddingRequest(
            request_id=request_id, model=settings.model, deadline=deadline, body=body
        )
        with trio.move_on_at(deadline):
            try:
                answer = _answer.decode(await embedder.embed(call))
                vector = unit(answer.data[0].embedding) if answer.data else None
            except (GatewayError, msgspec.DecodeError, msgspec.ValidationError):
                vector = None
            if vector is None:
                self.hook.cache_error("embed")
            return vector
        self.hook.cache_error("embed")  # late: the context stage's time ran out
        return None

    async def search(self, probe: Probe) -> Found | None:
        return await self.index.search(probe.guard, probe.vector, time.time())

    def observe(self, route: str, found: Found | None, threshold: float) -> bool:
        """Count a lookup's best similarity; whether it is served."""
        if found is None:
            return False
        hit = found.similarity >= threshold
        self.hook.cache_similarity(route, found.similarity, "hit" if hit else "miss")
        return hit

    def served(self, route: str, probe: Probe, found: Found, tenant: str = "") -> None:
        self.index.touch(found.key)
        self.recent.append(
            SemanticHit(
                time.time(), route, found.similarity, probe.question, found.question, tenant
            )
        )

    def forget(self, probe: Probe, found: Found) -> None:
        """The entry of ``found`` is gone (expired, evicted): drop its question."""
        self.index.remove(probe.guard, found.key)

    def evicted(self, key: str) -> None:
        """The entry ``key`` left this worker's memory (evicted, expired): its question
        goes too, so the index holds nothing the exact tier has let go of."""
        self.index.discard(key)

    async def insert(self, probe: Probe, key: str, ttl_s: float) -> None:
        """File the question of a stored entry here, and share it when shared."""
        item = Item(probe.guard, key, probe.vector, probe.question, time.time() + ttl_s)
        self.index.add(item)
        if self.share is not None:
            # Counted by the call; the others miss it, this worker has it.
            with contextlib.suppress(CacheUnavailable):
                await self.share(item)

    def listing(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """The last semantic hits, newest first (the console's cache view): ``tenant``'s
        only, unless it is None."""
        return [
            {
                "at": h.at,
                "route": h.route,
                "similarity": round(h.similarity, 4),
                "asked": h.asked,
                "stored": h.stored,
            }
            for h in reversed(self.recent)
            if tenant is None or h.tenant == tenant
        ]
