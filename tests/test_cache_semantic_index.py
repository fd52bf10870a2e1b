"""``cache/semantic.py``'s vector index: exact nearest question per guard, bounded in
bytes and number, in place."""

from __future__ import annotations

import gc
import hashlib
import time
import tracemalloc

import msgspec
import numpy as np
import pytest
import trio
import trio.testing

from aiserve_trio.cache import semantic
from aiserve_trio.cache.backend import MemoryBackend
from aiserve_trio.cache.entry import Entry
from aiserve_trio.cache.semantic import Item, Probe, VectorIndex, item_fields, item_of, unit
from aiserve_trio.cache.service import Cache
from aiserve_trio.config import CacheConfig


def v(*xs: float) -> np.ndarray:
    out = unit(list(xs))
    assert out is not None
    return out


def item(guard: str, key: str, vec: np.ndarray, expires: float = 1e12) -> Item:
    return Item(guard, key, vec, f"question {key}", expires)


async def test_the_nearest_under_the_guard_and_only_under_it() -> None:
    ix = VectorIndex(100)
    ix.add(item("g", "a", v(1, 0, 0)))
    ix.add(item("g", "b", v(1, 1, 0)))
    ix.add(item("h", "c", v(0, 1, 0)))
    found = await ix.search("g", v(0, 1, 0), time.time())
    assert found is not None
    assert found.key == "b"
    assert found.similarity == pytest.approx(0.7071, abs=1e-4)
    assert await ix.search("nope", v(0, 1, 0), time.time()) is None


async def test_expired_questions_are_skipped_and_removed_ones_gone() -> None:
    ix = VectorIndex(100)
    ix.add(item("g", "old", v(1, 0), expires=10.0))
    ix.add(item("g", "new", v(1, 1), expires=100.0))
    found = await ix.search("g", v(1, 0), now=50.0)
    assert found is not None
    assert found.key == "new"
    ix.remove("g", "new")
    assert await ix.search("g", v(1, 0), now=50.0) is None
    assert len(ix) == 1


async def test_full_means_oldest_out_and_rows_stay_in_step_with_items() -> None:
    ix = VectorIndex(50)
    rng = np.random.default_rng(3)
    vectors = {f"k{i}": v(*rng.standard_normal(16)) for i in range(120)}
    for key, vec in vectors.items():
        ix.add(item("g", key, vec))
    assert len(ix) == 50
    # Every kept question is found by its own vector, exactly (no row moved wrongly).
    for i in range(70, 120):
        found = await ix.search("g", vectors[f"k{i}"], time.time())
        assert found is not None
        assert found.key == f"k{i}"
        assert found.similarity == pytest.approx(1.0, abs=1e-5)
    gone = await ix.search("g", vectors["k0"], time.time())
    assert gone is not None
    assert gone.key != "k0"


async def test_a_large_bucket_is_searched_in_slices_with_checkpoints(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Slices of 100 rows: 39 checkpoints in a search of 4,000 (Trio may run the
    # searching task again first at any one of them, never at all of them).
    monkeypatch.setattr(semantic, "_CHUNK", 100)
    ix = VectorIndex(20_000)
    rng = np.random.default_rng(4)
    vecs = rng.standard_normal((4_000, 8)).astype(np.float32)
    for i, row in enumerate(vecs):
        ix.add(item("g", f"k{i}", v(*row)))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await trio.lowlevel.checkpoint()
            ticks += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        # The ticker first runs when the search lets it: between its slices.
        found = await ix.search("g", v(*vecs[3_999]), time.time())
        nursery.cancel_scope.cancel()
    assert found is not None
    assert found.key == "k3999"
    assert ticks > 0


def test_an_item_travels_through_its_record_fields() -> None:
    it = item("g", "k", v(0.5, 0.25, 1.0), expires=123.5)
    back = item_of(item_fields(it))
    assert back is not None
    assert (back.guard, back.key, back.question, back.expires) == ("g", "k", "question k", 123.5)
    assert np.allclose(back.vector, it.vector)
    assert item_of({"g": "g"}) is None
    assert item_of({**item_fields(it), "v": "not base64!"}) is None


# --- issue 55: the index's bytes, bounded and counted ----------------------------------


def _hex(text: str, size: int) -> str:
    return hashlib.blake2b(text.encode(), digest_size=size).hexdigest()


def _fresh(i: int, rng: np.random.Generator, dims: int = 512) -> Item:
    """A question under a guard of its own, made fresh (its strings and vector are
    the index's alone once filed, as the service's probe's are)."""
    vec = unit(rng.standard_normal(dims))
    assert vec is not None
    question = f"What is the annual fee of card number {i} for a customer who asks?"
    return Item(
        _hex(f"guard {i}", 32), "aiserve:cache:" + _hex(f"key {i}", 16), vec, question, 1e12
    )


def _traced() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


@pytest.mark.parametrize("budget", [1_048_576, 64 * 1_048_576])
def test_15000_distinct_guards_stay_within_the_bytes_and_the_account_is_true(
    budget: int,
) -> None:
    # Issue 55: a bucket was an 8 x 512 float32 matrix from its first question
    # (~17 KB a guard, outside any byte bound). Now the account (every matrix
    # whole, the strings, the overheads) never passes the budget, and it is what
    # tracemalloc -- which sees numpy's allocations -- says the index holds.
    rng = np.random.default_rng(55)
    tracemalloc.start()
    try:
        base = _traced()
        ix = VectorIndex(1_000_000, budget)
        for i in range(15_000):
            ix.add(_fresh(i, rng))
            assert ix.bytes <= budget
        real = _traced() - base
    finally:
        tracemalloc.stop()
    assert len(ix) > 0
    assert real <= budget * 1.05
    assert ix.bytes == pytest.approx(real, rel=0.10)


def test_a_bucket_starts_at_one_row_doubles_and_gives_its_room_back() -> None:
    rng = np.random.default_rng(5)
    ix = VectorIndex(1_000)
    ix.add(item("g", "k0", v(*rng.standard_normal(16))))
    bucket = ix._buckets["g"]
    assert bucket.rows.shape == (1, 16)
    one = ix.bytes
    for i in range(1, 33):
        ix.add(item("g", f"k{i}", v(*rng.standard_normal(16))))
    assert bucket.rows.shape == (64, 16)
    for i in range(1, 32):
        ix.remove("g", f"k{i}")
    assert (bucket.n, len(bucket.rows)) == (2, 4)  # halved while a quarter or less was used
    ix.remove("g", "k32")
    assert ix.bytes == one + 16 * 4  # the first question, in a two-row matrix
    ix.remove("g", "k0")
    assert (ix.bytes, len(ix), ix._buckets) == (0, 0, {})


async def test_past_its_bytes_the_least_recently_used_go_first_across_guards() -> None:
    rng = np.random.default_rng(6)
    items = [_fresh(i, rng, dims=64) for i in range(4)]
    probe = VectorIndex(100)
    probe.add(items[0])
    ix = VectorIndex(100, max_bytes=3 * probe.bytes + 100)  # room for three guards
    for it in items[:3]:
        ix.add(it)
    ix.touch(items[0].key)  # served: the most recently used
    ix.add(items[3])
    assert len(ix) == 3
    assert ix.bytes <= ix.max_bytes
    assert await ix.search(items[1].guard, items[1].vector, time.time()) is None
    for kept in (items[0], items[2], items[3]):
        found = await ix.search(kept.guard, kept.vector, time.time())
        assert found is not None
        assert found.key == kept.key


def test_one_question_an_entry_filed_anew_under_another_guard_moves() -> None:
    ix = VectorIndex(100)
    ix.add(item("g", "k", v(1, 0)))
    ix.add(item("h", "k", v(0, 1)))
    assert len(ix) == 1
    assert list(ix._buckets) == ["h"]
    ix.discard("k")
    assert (ix.bytes, len(ix)) == (0, 0)


async def test_an_entry_evicted_from_memory_takes_its_question(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Issue 55: the memory backend's LRU evicted the entry and the question stayed
    # in the index (and its bytes) until a lookup found it gone.
    config = msgspec.structs.replace(CacheConfig(), max_bytes=100)
    cache = Cache(config, {}, MemoryBackend(config.max_bytes))
    entry = Entry(pieces=[])

    async def check(c: Cache) -> None:
        for key in ("k1", "k2"):
            probe = Probe(f"guard-{key}", v(1, 0, 0), f"question {key}")
            await c.semantic.insert(probe, key, 60)
        await c.backend.put("k1", entry, b"x" * 60, 60)
        await c.backend.put("k2", entry, b"x" * 60, 60)  # k1 out
        assert c.semantic_held()[1] == 1
        assert await c.semantic.index.search("guard-k1", v(1, 0, 0), time.time()) is None
        await trio.sleep(61)  # k2 expires: its question goes when it is found gone
        assert await c.backend.get("k2") is None
        assert c.semantic_held() == (0, 0)

    await check(cache)
    await check(cache.successor({}))  # a reload keeps the index: the hook must be its


def test_the_bound_defaults_to_64_mib_and_must_be_positive() -> None:
    assert CacheConfig().semantic_max_bytes == 67_108_864
    with pytest.raises(msgspec.ValidationError, match="semantic_max_bytes"):
        msgspec.convert({"semantic_max_bytes": 0}, CacheConfig)
