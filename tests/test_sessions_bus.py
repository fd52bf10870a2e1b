"""The session bus contract, run against both backends (memory and a real redis-server)."""
# coredis 6.9 leaves a failed connection's anyio memory streams unclosed (ResourceWarning
# at GC); the tests that make Redis unreachable collect them under this filter.

from __future__ import annotations

import gc
import secrets
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from aiserve_trio.config import SessionsConfig
from aiserve_trio.core.errors import BadRequest
from aiserve_trio.observability.metrics import Metrics
from aiserve_trio.sessions.bus import (
    Event,
    SessionBus,
    SessionBusError,
    Turn,
    check_session_id,
    check_vars,
    parse_event_id,
)
from aiserve_trio.sessions.memory import MemoryBus
from aiserve_trio.sessions.redis_streams import (
    RedisBus,
    session_keys,
    turn_fields,
    turn_from_fields,
)

from .redis_server import RedisServer

TTL = 600
MAX_TURNS = 10


def turn(i: int, request_id: str | None = None, role: str = "user") -> Turn:
    return Turn(
        role=role, content=f"message {i}", channel="app", request_id=request_id or f"r{i}", ts=i
    )


def redis_bus(url: str) -> RedisBus:
    cfg = SessionsConfig(
        backend="redis",
        url=url,
        key_prefix=f"t{secrets.token_hex(4)}",
        max_turns=MAX_TURNS,
        history_turns=MAX_TURNS,
    )
    return RedisBus(cfg, Metrics())


@pytest.fixture(params=["memory", "redis"])
async def bus(request: pytest.FixtureRequest) -> AsyncIterator[SessionBus]:
    b: SessionBus
    if request.param == "memory":
        b = MemoryBus(max_turns=MAX_TURNS)
    else:
        server: RedisServer = request.getfixturevalue("redis_up")
        b = redis_bus(server.url)
    await b.aopen()
    try:
        yield b
    finally:
        await b.aclose()


async def test_append_then_load_gives_history_and_variables(bus: SessionBus) -> None:
    assert await bus.ping()
    await bus.set_vars("t1", "s1", {"monthly_income": "8000"}, TTL)
    await bus.set_vars("t1", "s1", {"loan_term": "20 years"}, TTL)
    for i in range(3):
        ids = await bus.append("t1", "s1", [turn(i), turn(i, role="assistant")], TTL)
        assert len(ids) == 2
    s = await bus.load("t1", "s1", 4, TTL)
    assert [t.content for t in s.turns] == ["message 1"] * 2 + ["message 2"] * 2
    assert [t.role for t in s.turns] == ["user", "assistant"] * 2
    assert s.variables == {"monthly_income": "8000", "loan_term": "20 years"}
    assert (await bus.load("t1", "s1", 0, TTL)).turns == []


async def test_unknown_session_is_empty(bus: SessionBus) -> None:
    s = await bus.load("t1", "nobody", 5, TTL)
    assert (s.turns, s.variables) == ([], {})
    assert await bus.read("t1", "nobody", None, limit=5, block_ms=0) == []


async def test_turn_fields_round_trip(bus: SessionBus) -> None:
    t = Turn(
        role="assistant",
        content="line 1\nline 2 — 房贷",
        channel="ivr",
        request_id="chatcmpl-1",
        ts=1700000000.25,
        truncated=True,
        flags={"fraud_score": "0.4"},
    )
    await bus.append("t1", "s1", [t], TTL)
    assert (await bus.load("t1", "s1", 1, TTL)).turns == [t]


async def test_append_is_idempotent_per_request_id(bus: SessionBus) -> None:
    first = await bus.append("t1", "s1", [turn(1, "req-a"), turn(2, "req-a")], TTL)
    again = await bus.append("t1", "s1", [turn(1, "req-a"), turn(2, "req-a")], TTL)
    assert len(first) == 2
    assert again == []
    assert len((await bus.load("t1", "s1", 10, TTL)).turns) == 2


async def test_tenants_never_share_a_session(bus: SessionBus) -> None:
    await bus.set_vars("bank-a", "session:1", {"secret": "a"}, TTL)
    await bus.append("bank-a", "session:1", [turn(1)], TTL)
    other = await bus.load("bank-b", "session:1", 10, TTL)
    assert (other.turns, other.variables) == ([], {})
    # A tenant/session split that would collide if keys were naively joined.
    await bus.set_vars("bank", "a:session:1", {"x": "1"}, TTL)
    assert (await bus.load("bank-a", "session:1", 1, TTL)).variables == {"secret": "a"}


async def test_turns_are_trimmed_to_max_turns(bus: SessionBus) -> None:
    n = 250
    for i in range(n):
        await bus.append("t1", "s1", [turn(i)], TTL)
    s = await bus.load("t1", "s1", MAX_TURNS, TTL)
    assert [t.content for t in s.turns] == [f"message {i}" for i in range(n - MAX_TURNS, n)]
    kept = await bus.read("t1", "s1", None, limit=1000, block_ms=0)
    if isinstance(bus, RedisBus):
        # MAXLEN ~ trims whole stream nodes (100 entries by default): bounded, not exact.
        assert MAX_TURNS <= len(kept) <= MAX_TURNS + 100
    else:
        assert len(kept) == MAX_TURNS


async def test_read_after_an_id_has_no_gaps_and_no_duplicates(bus: SessionBus) -> None:
    ids = []
    for i in range(6):
        ids += await bus.append("t1", "s1", [turn(i)], TTL)
    assert sorted(ids, key=parse_event_id) == ids
    assert len(set(ids)) == 6
    got = await bus.read("t1", "s1", ids[2], limit=100, block_ms=0)
    assert [e.id for e in got] == ids[3:]
    assert [e.turn.content for e in got] == [f"message {i}" for i in range(3, 6)]
    assert await bus.read("t1", "s1", ids[-1], limit=100, block_ms=0) == []
    assert [e.id for e in await bus.read("t1", "s1", None, limit=2, block_ms=0)] == ids[-2:]
    assert [e.id for e in await bus.read("t1", "s1", ids[0], limit=2, block_ms=0)] == ids[1:3]


async def test_blocked_read_wakes_on_append(bus: SessionBus) -> None:
    ids = await bus.append("t1", "s1", [turn(0)], TTL)
    got: list[Event] = []

    async def reader() -> None:
        got.extend(await bus.read("t1", "s1", ids[0], limit=10, block_ms=5_000))

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        await bus.append("t1", "s1", [turn(1)], TTL)
    assert [e.turn.content for e in got] == ["message 1"]
    assert trio.current_time() - start < 2.0


async def test_blocked_read_returns_empty_after_block_ms(bus: SessionBus) -> None:
    start = trio.current_time()
    assert await bus.read("t1", "quiet", "0-0", limit=10, block_ms=100) == []
    assert 0.09 <= trio.current_time() - start < 2.0


async def test_follow_replays_then_goes_live(bus: SessionBus) -> None:
    await bus.append("t1", "s1", [turn(0), turn(1)], TTL)
    send, recv = trio.open_memory_channel[Event](10)
    seen: list[str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: bus.follow("t1", "s1", None, send, block_ms=200))
        for _ in range(2):
            seen.append((await recv.receive()).turn.content)
        await bus.append("t1", "s1", [turn(2)], TTL)
        seen.append((await recv.receive()).turn.content)
        nursery.cancel_scope.cancel()
    assert seen == ["message 0", "message 1", "message 2"]


# --- sans-IO helpers ------------------------------------------------------------


@pytest.mark.parametrize(
    "sid", ["", "a" * 129, "a b", "x}{y", "-lead", "é", "a/b", "a\r\nSET", "ok\n"]
)
def test_bad_session_ids_are_refused(sid: str) -> None:
    with pytest.raises(BadRequest):
        check_session_id(sid)


def test_good_session_ids_pass() -> None:
    assert check_session_id("session:20240521:abc789") == "session:20240521:abc789"


def test_event_ids_parse_and_refuse() -> None:
    assert parse_event_id("1700000000000-3") == (1700000000000, 3)
    for bad in ("", "1", "a-b", "1-2-3", "1-2\n"):
        with pytest.raises(BadRequest):
            parse_event_id(bad)


def test_vars_are_checked() -> None:
    assert check_vars({"loan_term": "20y"}, "metadata") == {"loan_term": "20y"}
    for bad in ({"bad name": "x"}, {"x": "y" * 2000}, {f"v{i}": "" for i in range(65)}):
        with pytest.raises(BadRequest):
            check_vars(bad, "metadata")


def test_redis_keys_share_a_hash_tag_and_separate_tenants() -> None:
    keys = session_keys("aiserve", "bank-a", "session:1")
    assert keys == (
        "aiserve:{bank-a:session:1}:turns",
        "aiserve:{bank-a:session:1}:vars",
        "aiserve:{bank-a:session:1}:seen",
    )
    # Tenants have no ':', so this session id cannot reach bank-a's keys.
    assert session_keys("aiserve", "bank", "-a:session:1")[0] != keys[0]
    t = turn(3)
    assert turn_from_fields(dict(zip(*[iter(turn_fields(t))] * 2, strict=True))) == t
    with pytest.raises(SessionBusError):
        turn_from_fields({"role": "user"})


# --- memory backend: bounds and expiry, on the virtual clock ---------------------


async def test_memory_sessions_expire_after_ttl_and_use_refreshes(autojump_clock: object) -> None:
    bus = MemoryBus()
    await bus.set_vars("t", "s", {"a": "1"}, 100)
    await trio.sleep(90)
    assert (await bus.load("t", "s", 5, 100)).variables == {"a": "1"}  # refreshed here
    await trio.sleep(90)
    assert (await bus.load("t", "s", 5, 100)).variables == {"a": "1"}
    await trio.sleep(101)
    assert (await bus.load("t", "s", 5, 100)).variables == {}
    assert len(bus) == 0


async def test_memory_evicts_least_recently_used(autojump_clock: object) -> None:
    bus = MemoryBus(max_sessions=3)
    for s in ("a", "b", "c"):
        await bus.set_vars("t", s, {"v": s}, 100)
    await bus.load("t", "a", 1, 100)  # a is now the most recently used
    await bus.set_vars("t", "d", {"v": "d"}, 100)
    assert len(bus) == 3
    assert (await bus.load("t", "b", 1, 100)).variables == {}
    assert (await bus.load("t", "a", 1, 100)).variables == {"v": "a"}


async def test_memory_waiters_do_not_leak(autojump_clock: object) -> None:
    bus = MemoryBus()
    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(lambda: bus.read("t", "s", "0-0", limit=1, block_ms=1000))
    assert bus._waiters._events == {}


# --- redis backend specifics ---------------------------------------------------


@pytest.mark.slow
async def test_redis_keys_expire_with_the_ttl(redis_up: RedisServer) -> None:
    bus = redis_bus(redis_up.url)
    await bus.aopen()
    try:
        await bus.set_vars("t1", "s1", {"a": "1"}, 50)
        await bus.append("t1", "s1", [turn(1)], 50)
        await bus.load("t1", "s1", 1, 100)  # use refreshes every key to the route's ttl
        for key in session_keys(bus.config.key_prefix, "t1", "s1"):
            assert redis_up.command("TTL", key) in (b":100", b":99")
    finally:
        await bus.aclose()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_redis_down_is_a_session_bus_error() -> None:
    from .servers import free_port

    bus = redis_bus(f"redis://127.0.0.1:{free_port()}/0")
    await bus.aopen()
    try:
        assert not await bus.ping()
        with pytest.raises(SessionBusError):
            await bus.load("t", "s", 1, 10)
        with pytest.raises(SessionBusError):
            await bus.append("t", "s", [turn(1)], 10)
        assert bus.metrics is not None
        assert bus.metrics.session_errors.labels("load")._value.get() == 1
    finally:
        await bus.aclose()
        gc.collect()  # the unclosed-stream warnings surface here, under this test's filter
