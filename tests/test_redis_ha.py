"""Scale-out on a real Redis Cluster and a real Sentinel set-up (issue 16, item 4).

The code accepts ``redis+cluster://`` and ``redis+sentinel://`` URLs
(``sessions/redis_streams.py client_for_url``); here they run for real, against
``redis-server`` processes on loopback (``tests/redis_cluster.py``):

- the cross-channel session scenario through the gateway (in-process), on each;
- the Redis rate limiter shared by two "workers", on each;
- a primary failover in the middle of a run -- ``CLUSTER FAILOVER`` on the
  replica of the session's master, or SIGKILL of the Sentinel primary -- with
  the gateway under load: every request is served (or, on the route that does
  not degrade, refused with the envelope while the bus is away), never wrong
  (each reply is exactly the one asked for), and every delivered turn is in the
  bus exactly once (the outbox keeps what could not be written, and writes it
  once the new primary answers).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import pytest
import trio

from aiserve_trio.config import parse_config
from aiserve_trio.core.errors import RateLimited
from aiserve_trio.runtime.asgi import App
from aiserve_trio.security.ratelimit import RedisLimiter

from .asgi_client import Client, Response, chat_body
from .conftest import config_text
from .redis_cluster import Cluster, Sentinels
from .test_ratelimit import key
from .test_sessions_http import build, running, test_seed_scenario_app_then_wechat_then_ivr

pytestmark = [
    pytest.mark.slow,
    pytest.mark.fault,
    # coredis leaves a failed connection's anyio streams unclosed (collected later).
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

TENANT = "default"

FAIL, DEGRADE = "/v1/fail", "/v1/degrade"
_SESSIONS = '[sessions]\nbackend = "memory"'


def two_routes(url: str) -> App:
    """The zero-delay mock behind a failing and a degrading route, sessions on ``url``."""
    text = config_text(ttft_ms="0", inter_token_ms="0")
    text = text.replace(
        _SESSIONS,
        f'[sessions]\nbackend = "redis"\nurl = "{url}"\nkey_prefix = "ha{secrets.token_hex(4)}"\n'
        "outbox_retry_ms = 50\noutbox_retry_max_ms = 200\nconnect_timeout_ms = 300",
    )
    for path, mode in ((FAIL, "fail"), (DEGRADE, "degrade")):
        text += (
            f'\n[[routes]]\npath = "{path}"\nname = "{mode}"\nadapter = "mock"\n'
            f'default_model = "aiserve-mock"\non_context_timeout = "{mode}"\n'
        )
    return App(parse_config(text, source="<ha redis test>"))


# --- the session scenario and the limiter, on each set-up -----------------------------------


async def test_cross_channel_sessions_on_a_cluster(redis_cluster: Cluster) -> None:
    async with running(build("redis", redis_cluster.url)) as app:
        await test_seed_scenario_app_then_wechat_then_ivr(app)


async def test_cross_channel_sessions_on_sentinel(redis_sentinel: Sentinels) -> None:
    async with running(build("redis", redis_sentinel.url)) as app:
        await test_seed_scenario_app_then_wechat_then_ivr(app)


@pytest.mark.parametrize("setup", ["redis_cluster", "redis_sentinel"])
async def test_rate_limiter_is_shared_and_atomic(setup: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue(setup).url
    prefix = f"rl{secrets.token_hex(4)}"
    one, two = RedisLimiter(url, prefix), RedisLimiter(url, prefix)
    await one.aopen()
    await two.aopen()
    try:
        refused = 0
        # Keys of several ids land on several masters of the cluster.
        for key_id in ("alpha", "beta", "gamma"):
            p = key(rpm=10, key_id=key_id)

            async def hit(lim: RedisLimiter, p: Any = p) -> None:
                nonlocal refused
                try:
                    await lim.admit(p)
                except RateLimited:
                    refused += 1

            async with trio.open_nursery() as nursery:
                for i in range(30):
                    nursery.start_soon(hit, one if i % 2 else two)
        assert refused == 3 * 20
        t = key(tpm=100, key_id="tok")
        await one.admit(t)
        await two.charge(t, 500)
        with pytest.raises(RateLimited):
            await one.admit(t)
    finally:
        await two.aclose()
        await one.aclose()


# --- failover in the middle of a run ------------------------------------------------------


def reply_of(r: Response) -> str:
    return str(r.json()["choices"][0]["message"]["content"])


async def run_through(app: App, fault: Any, *, workers: int = 6, seconds: float = 3.0) -> dict[str, Any]:
    """Load ``app`` with session chats on both routes; call ``fault()`` (blocking, in a
    thread) a third of the way in. Returns what the clients saw."""
    client = Client(app)
    seen: list[tuple[str, str, str, Response]] = []  # route, session, question, response

    async def worker(w: int, until: float) -> None:
        sid = f"ha:{secrets.token_hex(3)}:{w}"
        i = 0
        while trio.current_time() < until:
            route = FAIL if (w + i) % 2 else DEGRADE
            question = f"turn {w}.{i}"
            headers = {"x-session-id": sid, "x-channel": "app", "x-request-timeout-ms": "2000"}
            r = await client.request("POST", route, json_body=chat_body(f"echo: {question}"), headers=headers)
            seen.append((route, sid, question, r))
            i += 1
            await trio.sleep(0.05)

    start = trio.current_time()
    async with trio.open_nursery() as load:
        for w in range(workers):
            load.start_soon(worker, w, start + seconds)
        await trio.sleep(seconds / 3)
        switched = await trio.to_thread.run_sync(fault)
    # Every delivered turn is written once the bus answers again (the outbox drains).
    with trio.fail_after(15):
        while len(app.writeback.outbox):  # noqa: ASYNC110 - the outbox has no event to wait on
            await trio.sleep(0.05)
    stored: dict[str, int] = {}
    for sid in {s for _, s, _, _ in seen}:
        for e in await app.bus.read(TENANT, sid, None, limit=10_000, block_ms=0):
            stored[e.turn.request_id] = stored.get(e.turn.request_id, 0) + 1
    return {"seen": seen, "stored": stored, "switched": switched}


def check_run(result: dict[str, Any]) -> dict[str, int]:
    seen: list[tuple[str, str, str, Response]] = result["seen"]
    stored: dict[str, int] = result["stored"]
    counts = {"ok": 0, "degraded": 0, "refused": 0}
    owed = set()
    for route, _sid, question, r in seen:
        rid = r.headers["x-request-id"]
        if r.status == 200:
            assert reply_of(r) == question  # never wrong: the reply to this very question
            owed.add(rid)
            counts["degraded" if r.headers.get("x-aiserve-degraded") else "ok"] += 1
        else:
            # Only the route that does not degrade may refuse, with the envelope.
            assert route == FAIL, (route, r.status, r.body[:200])
            assert r.status in (503, 504), r.body[:200]
            err = json.loads(r.body)["error"]
            assert {"message", "type", "code"} <= err.keys()
            counts["refused"] += 1
    missing = owed - stored.keys()
    assert not missing, f"delivered turns lost: {sorted(missing)[:5]}"
    twice = {rid: n for rid, n in stored.items() if n != 2}
    assert not twice, f"turns stored other than once (user + assistant): {twice}"
    assert stored.keys() <= owed
    return counts


async def test_cluster_failover_in_the_middle_of_a_run(redis_cluster: Cluster) -> None:
    app = two_routes(redis_cluster.url)
    # The sessions' keys spread over the masters; fail over the one holding a key of
    # the prefix (any master serves some of the run's sessions).
    victim = f"{app.config.sessions.key_prefix}:{{{TENANT}:x}}:turns"
    async with running(app):
        result = await run_through(app, lambda: redis_cluster.failover(victim))
    counts = check_run(result)
    old, new = result["switched"]
    assert new in redis_cluster.masters()
    assert old not in redis_cluster.masters()
    assert counts["ok"] > 0


async def test_sentinel_primary_killed_in_the_middle_of_a_run(redis_sentinel: Sentinels) -> None:
    app = two_routes(redis_sentinel.url)
    async with running(app):
        result = await run_through(app, redis_sentinel.kill_primary, seconds=5.0)
    counts = check_run(result)
    old, new = result["switched"]
    assert redis_sentinel.current_primary() == new != old
    # The primary was gone for the sentinels' detection time: the degrading route
    # served without context meanwhile, and the other one refused with 503/504.
    assert counts["degraded"] > 0
    assert counts["ok"] > 0


async def test_rate_limiter_through_a_cluster_failover(redis_cluster: Cluster) -> None:
    prefix = f"rl{secrets.token_hex(4)}"
    one, two = RedisLimiter(redis_cluster.url, prefix), RedisLimiter(redis_cluster.url, prefix)
    await one.aopen()
    await two.aopen()
    try:
        busy = key(rpm=100_000, key_id="busy")
        admitted = 0
        slowest = 0.0

        async def hammer(lim: RedisLimiter, until: float) -> None:
            nonlocal admitted, slowest
            while trio.current_time() < until:
                t0 = trio.current_time()
                await lim.admit(busy)  # fails open while the master moves: never raises
                slowest = max(slowest, trio.current_time() - t0)
                admitted += 1
                await trio.sleep(0.005)

        victim = f"{prefix}:rl:{{busy}}:req"
        async with trio.open_nursery() as n:
            until = trio.current_time() + 3.0
            n.start_soon(hammer, one, until)
            n.start_soon(hammer, two, until)
            await trio.sleep(0.5)
            await trio.to_thread.run_sync(redis_cluster.failover, victim)
        assert admitted > 100
        assert slowest <= 1.2  # a call waits at most its 1 s bound, then lets the request go
        # After the failover the buckets count exactly again: the same slot, on its new master.
        p = key(rpm=10, key_id="after")
        assert redis_cluster.master_of(f"{prefix}:rl:{{after}}:req") in redis_cluster.masters()
        refused = 0
        for i in range(30):
            try:
                await (one if i % 2 else two).admit(p)
            except RateLimited:
                refused += 1
        assert refused == 20
    finally:
        await two.aclose()
        await one.aclose()


async def test_the_gateways_rate_limit_on_a_cluster(redis_cluster: Cluster) -> None:
    from .authcfg import KEY_A, auth_toml, bearer

    auth = auth_toml(rpm=3, extra='ratelimit_backend = "redis"')
    text = config_text().replace("[auth]\nenabled = false\n", auth)
    text = text.replace(
        _SESSIONS,
        f'[sessions]\nbackend = "redis"\nurl = "{redis_cluster.url}"\n'
        f'key_prefix = "rl{secrets.token_hex(4)}"',
    )
    # Two workers (apps) share the key's buckets through the cluster.
    one = App(parse_config(text, source="<test>"))
    two = App(parse_config(text, source="<test>"))
    async with running(one), running(two):
        statuses = []
        for app in (one, two, one, two, one):
            r = await Client(app).chat(chat_body(), bearer(KEY_A, **{"x-channel": "app"}))
            statuses.append(r.status)
    assert statuses == [200, 200, 200, 429, 429]
