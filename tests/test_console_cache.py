"""The console's cache view (``GET /admin/api/cache``): exact and semantic hits by route,
the similarity histogram, and the last semantic hits with both questions."""

from __future__ import annotations

import trio
import trio.testing

from aiserve_trio.console import cacheview

from .asgi_client import Client
from .cachefakes import ask, opened
from .test_cache_semantic import Q, semantic_app
from .test_console_api import API, call


def test_the_cache_view_is_behind_the_consoles_auth_like_the_rest() -> None:
    # test_console_api's auth tests run over every path of this list.
    assert "/admin/api/cache" in API


async def test_the_view_counts_hits_and_shows_both_questions_of_a_semantic_hit(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, _ = semantic_app()
    await opened(app, nursery)
    client = Client(app)
    await client.chat(ask(Q))
    await client.chat(ask(Q))  # exact hit
    asked = Q.upper()
    assert (await client.chat(ask(asked))).headers["x-aiserve-cache"] == "semantic-hit"
    await client.chat(ask("What is the interest rate of the 20-year variable mortgage?"))
    r = await call(app, "GET", "/admin/api/cache")
    assert r.status == 200
    out = r.json()
    assert out["results"] == {"chat": {"miss": 2, "hit": 1, "semantic_hit": 1}}
    assert out["semantic_entries"] == 2
    [hit] = out["recent"]
    assert (hit["route"], hit["asked"], hit["stored"]) == ("chat", asked, Q)
    assert hit["similarity"] >= 0.92
    sim = out["similarity"]
    assert sum(sim["hit"]) == 1
    assert sum(sim["miss"]) == 1
    # The served lookup is in the top bucket, the one below the threshold lower down.
    top = sim["le"].index(1.0)
    assert sim["hit"][top] == 1
    assert sim["miss"].index(1) < top


async def test_the_view_keeps_the_last_twenty_semantic_hits_newest_first(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, _ = semantic_app()
    await opened(app, nursery)
    client = Client(app)
    await client.chat(ask(Q))
    variants = [Q.lower() + "?" * i for i in range(1, 26)]
    for text in variants:
        assert (await client.chat(ask(text))).headers["x-aiserve-cache"] == "semantic-hit"
    out = (await call(app, "GET", "/admin/api/cache")).json()
    assert [h["asked"] for h in out["recent"]] == variants[::-1][:20]


def test_the_histogram_is_read_per_bucket_not_cumulated() -> None:
    from prometheus_client import CollectorRegistry, Histogram

    h = Histogram(
        "x", "x", ["route", "result"], buckets=(0.5, 0.9, 1.0), registry=CollectorRegistry()
    )
    for value, result in ((0.4, "miss"), (0.8, "miss"), (0.85, "miss"), (0.95, "hit")):
        h.labels("r", result).observe(value)
    sim = cacheview.similarity(h.collect())
    assert sim == {"le": [0.5, 0.9, 1.0, None], "hit": [0, 0, 1, 0], "miss": [1, 2, 0, 0]}
