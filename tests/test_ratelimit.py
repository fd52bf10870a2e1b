"""Rate limits: bucket arithmetic, the memory limiter on the virtual clock, 429 with
Retry-After through the app, and the Redis limiter (one Lua script) on a real Redis."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from aiserve_trio.core.errors import RateLimited
from aiserve_trio.security.auth import Principal
from aiserve_trio.security.ratelimit import Bucket, MemoryLimiter, RedisLimiter, decide

from .asgi_client import Client, chat_body
from .authcfg import KEY_A, KEY_B, auth_app, auth_toml, bearer
from .redis_server import RedisServer


def key(rpm: int = 0, tpm: int = 0, key_id: str = "k") -> Principal:
    return Principal(
        key_id=key_id, tenant="t", routes=frozenset("*"), channels=frozenset("*"), rpm=rpm, tpm=tpm
    )


def test_bucket_refills_up_to_a_minute() -> None:
    b = Bucket(level=0.0, at=0.0)
    b.refill(30.0, per_minute=60)
    assert b.level == pytest.approx(30.0)
    b.refill(1000.0, per_minute=60)
    assert b.level == 60.0


@pytest.mark.parametrize(
    ("req", "tok", "rpm", "tpm", "wait"),
    [
        (None, None, 0, 0, 0.0),
        (1.0, None, 60, 0, 0.0),
        (0.5, None, 60, 0, 0.5),
        (None, 0.0, 0, 600, 0.1),
        (None, -59.0, 0, 600, 6.0),
        (0.0, -59.0, 60, 600, 6.0),
    ],
)
def test_decide(req: float | None, tok: float | None, rpm: int, tpm: int, wait: float) -> None:
    assert decide(req, tok, rpm, tpm) == pytest.approx(wait)


async def test_memory_requests_per_minute(autojump_clock: Any) -> None:
    lim, p = MemoryLimiter(), key(rpm=3)
    for _ in range(3):
        await lim.admit(p)
    with pytest.raises(RateLimited) as info:
        await lim.admit(p)
    assert info.value.headers["Retry-After"] == "20"
    await trio.sleep(20)
    await lim.admit(p)


async def test_memory_tokens_per_minute_go_into_debt(autojump_clock: Any) -> None:
    lim, p = MemoryLimiter(), key(tpm=600)
    await lim.admit(p)
    await lim.charge(p, 1200)  # more than a minute's worth: floored at -600
    with pytest.raises(RateLimited) as info:
        await lim.admit(p)
    assert info.value.headers["Retry-After"] == "61"
    await trio.sleep(61)
    await lim.admit(p)


async def test_keys_do_not_share_buckets(autojump_clock: Any) -> None:
    lim = MemoryLimiter()
    await lim.admit(key(rpm=1, key_id="a"))
    await lim.admit(key(rpm=1, key_id="b"))
    with pytest.raises(RateLimited):
        await lim.admit(key(rpm=1, key_id="a"))


async def test_app_answers_429_with_retry_after(autojump_clock: Any) -> None:
    client = Client(auth_app(auth_toml(rpm=2)))
    h = bearer(KEY_A)
    assert (await client.chat(chat_body(), h)).status == 200
    assert (await client.chat(chat_body(), h)).status == 200
    r = await client.chat(chat_body(), h)
    assert r.status == 429
    assert r.headers["retry-after"] == "30"
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    # Another key is not affected; after the wait the first one is served again.
    assert (await client.chat(chat_body(), bearer(KEY_B))).status == 200
    await trio.sleep(30)
    assert (await client.chat(chat_body(), h)).status == 200


async def test_app_charges_reply_tokens(autojump_clock: Any) -> None:
    client = Client(auth_app(auth_toml(tpm=20)))
    h = bearer(KEY_A)
    r = await client.chat(chat_body("tell me about deadlines"), h)
    assert r.status == 200
    assert r.json()["usage"]["total_tokens"] > 20
    r = await client.chat(chat_body(), h)
    assert r.status == 429


@pytest.mark.slow
async def test_redis_limiter_is_shared_and_atomic(redis_up: RedisServer) -> None:
    prefix = f"rl{trio.current_time():.0f}"
    one, two = RedisLimiter(redis_up.url, prefix), RedisLimiter(redis_up.url, prefix)
    await one.aopen()
    await two.aopen()
    try:
        p = key(rpm=10, key_id="shared")
        refused = 0

        async def hit(lim: RedisLimiter) -> None:
            nonlocal refused
            try:
                await lim.admit(p)
            except RateLimited:
                refused += 1

        # 30 concurrent requests through two "workers": exactly 10 get through.
        async with trio.open_nursery() as nursery:
            for i in range(30):
                nursery.start_soon(hit, one if i % 2 else two)
        assert refused == 20
        t = key(tpm=100, key_id="tok")
        await one.admit(t)
        await two.charge(t, 500)
        with pytest.raises(RateLimited):
            await one.admit(t)
    finally:
        await two.aclose()  # entered last, left first: coredis pools nest
        await one.aclose()


@pytest.mark.slow
async def test_two_gateways_share_the_redis_limit_and_shut_down_cleanly(redis_up: RedisServer) -> None:
    # Through the apps' own start-up and shutdown: the limiter's Redis client is
    # entered after the session bus's and must be closed before it, outside the
    # shutdown shield (Trio closes cancel scopes in reverse order of opening).
    import secrets

    from aiserve_trio.config import parse_config
    from aiserve_trio.runtime.asgi import App

    from .conftest import config_text
    from .test_sessions_http import running

    sessions = f'[sessions]\nbackend = "redis"\nurl = "{redis_up.url}"\nkey_prefix = "rl{secrets.token_hex(4)}"'
    text = config_text().replace("[auth]\nenabled = false\n", auth_toml(rpm=3, extra='ratelimit_backend = "redis"'))
    text = text.replace('[sessions]\nbackend = "memory"', sessions)
    one, two = App(parse_config(text, source="<test>")), App(parse_config(text, source="<test>"))
    async with running(one), running(two):
        statuses = []
        for app in (one, two, one, two, one):
            r = await Client(app).chat(chat_body(), bearer(KEY_A, **{"x-channel": "app"}))
            statuses.append(r.status)
    assert statuses == [200, 200, 200, 429, 429]
