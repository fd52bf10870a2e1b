"""``cache/semantic.py``'s vector index: exact nearest question per guard, bounded, in place."""

from __future__ import annotations

import time

import numpy as np
import pytest
import trio

from aiserve_trio.cache import semantic
from aiserve_trio.cache.semantic import Item, VectorIndex, item_fields, item_of, unit


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
