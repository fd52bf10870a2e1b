"""The semantic tier shared by gateways through a real redis-server: a question filed
by one gateway is a semantic hit on another, a gateway started later catches up, and
Redis down means plain misses and counted errors, never a failed request.

Real sockets: these run on the real clock, with a fast model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from aiserve_trio.runtime.asgi import App

from .asgi_client import Client
from .cachefakes import ask, metric, reply_text
from .redis_server import RedisServer
from .test_cache_redis import gateways, redis_text
from .test_cache_semantic import Q
from .test_reload import running

pytestmark = pytest.mark.slow

SEMANTIC = '{ ttl_s = 60, semantic = { embeddings = "vec", model = "aiserve-mock" } }'
# After the [cache] keys: the adapter that embeds (a second mock, no delay).
VEC = '\n[adapters.vec]\nkind = "mock"\nmodels = ["aiserve-mock"]\nttft_ms = 0\n'


def indexed(app: App) -> int:
    assert app.cache is not None
    return len(app.cache.semantic.index)


async def until(check: Callable[[], bool]) -> None:
    with trio.fail_after(5):
        while not check():  # noqa: ASYNC110 - waits on another gateway's follower task
            await trio.sleep(0.01)


async def test_a_question_filed_by_one_gateway_is_a_semantic_hit_on_another(
    redis_up: RedisServer,
) -> None:
    async with gateways(redis_up, cache=SEMANTIC, table=VEC, words=12) as (apps, models, _):
        a = await Client(apps[0]).chat(ask(Q))
        assert a.headers["x-aiserve-cache"] == "miss"
        await until(lambda: indexed(apps[1]) == 1)
        b = await Client(apps[1]).chat(ask(Q.upper()))
        assert b.headers["x-aiserve-cache"] == "semantic-hit"
        assert reply_text(b) == reply_text(a)
        assert [m.calls for m in models] == [1, 0]
        # Another term is never the same question, on any gateway.
        c = await Client(apps[1]).chat(ask(Q.replace("20-year", "30-year")))
        assert c.headers["x-aiserve-cache"] == "miss"


async def test_a_gateway_started_later_catches_up_before_it_serves(
    redis_up: RedisServer,
) -> None:
    async with gateways(redis_up, n=1, cache=SEMANTIC, table=VEC) as (apps, _, prefix):
        client = Client(apps[0])
        for i in range(3):
            await client.chat(ask(f"{Q} Branch {i + 1}."))
        await until(lambda: indexed(apps[0]) == 3)
        # The same key prefix: the same Redis data.
        async with gateways(redis_up, n=1, cache=SEMANTIC, table=VEC, prefix=prefix) as (
            late,
            models,
            _,
        ):
            assert indexed(late[0]) == 3  # read during its start-up
            r = await Client(late[0]).chat(ask(f"{Q.lower()} branch 2"))
            assert r.headers["x-aiserve-cache"] == "semantic-hit"
            assert models[0].calls == 0


async def test_redis_down_means_misses_and_counted_errors_never_a_failed_request(
    redis_up: RedisServer,
) -> None:
    async with gateways(redis_up, cache=SEMANTIC, table=VEC) as (apps, models, _):
        await Client(apps[0]).chat(ask(Q))
        await until(lambda: indexed(apps[1]) == 1)
        redis_up.stop()
        try:
            for i, app in enumerate(apps):
                r = await Client(app).chat(ask(Q.lower()))
                assert (r.status, r.headers["x-aiserve-cache"]) == (200, "miss"), i
            assert metric(apps[1], "aiserve_cache_backend_errors_total", op="get") >= 1
            # A failed lookup is not an entry gone: the question stays filed.
            assert indexed(apps[1]) == 1
        finally:
            redis_up.start()
        assert [m.calls for m in models] == [2, 1]


async def test_a_reload_that_turns_the_semantic_tier_on_follows_the_shared_index(
    redis_up: RedisServer, tmp_path: Path
) -> None:
    async with gateways(redis_up, n=1, cache=SEMANTIC, table=VEC) as (apps, _, prefix):
        path = tmp_path / "gateway.toml"
        path.write_text(redis_text(redis_up.url, prefix, "{}", VEC))
        async with running(path) as app:
            assert app.cache is not None
            assert app.cache.semantic.share is None  # no semantic route: no follower
            path.write_text(redis_text(redis_up.url, prefix, SEMANTIC, VEC))
            assert (await app.reloader.reload(by="test")).applied
            await Client(apps[0]).chat(ask(Q))
            await until(lambda: indexed(app) == 1)
            r = await Client(app).chat(ask(Q.lower()))
            assert r.headers["x-aiserve-cache"] == "semantic-hit"
