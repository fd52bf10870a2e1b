"""The memory session bus is bounded by bytes, not only by count (issue 55, item 2): a
store-wide ``max_bytes`` and a per-session ``max_session_bytes`` (oldest turns out), with
bytes counted exactly, and one tenant's flood evicts that tenant's sessions, not another's
(nor its stored responses)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import trio

from aiserve_trio.config import ConfigError, parse_config
from aiserve_trio.runtime.asgi import App
from aiserve_trio.sessions.bus import Turn, var_bytes
from aiserve_trio.sessions.memory import (
    EVENT_OVERHEAD,
    ID_OVERHEAD,
    SESSION_OVERHEAD,
    VAR_OVERHEAD,
    MemoryBus,
)

from .asgi_client import Client, chat_body
from .authcfg import KEY_A, KEY_B, auth_config, auth_toml, bearer
from .conftest import config_text

TTL = 600
KB100 = "x" * 100_000
MIB = 1_048_576


def turn(content: str, rid: str, role: str = "user") -> Turn:
    return Turn(role=role, content=content, channel="app", request_id=rid, ts=1.0)


def expected(bus: MemoryBus) -> int:
    """The bytes of everything ``bus`` holds, counted again from what it holds."""
    total = 0
    for (tenant, sid), entry in bus._sessions.items():
        total += len(tenant) + len(sid) + SESSION_OVERHEAD
        for ev, _ in entry.events:
            total += len(msgspec.json.encode(ev.turn)) + len(ev.id) + EVENT_OVERHEAD
        total += sum(var_bytes(k, v) + VAR_OVERHEAD for k, v in entry.variables.items())
        total += sum(len(rid) + ID_OVERHEAD for rid in entry.written)
    return total


# --- the pure store --------------------------------------------------------------------


async def test_bytes_are_counted_exactly_for_turns_variables_and_ids() -> None:
    bus = MemoryBus()
    [eid] = await bus.append("t", "s", [turn("héllo", "r1")], TTL)
    encoded = len(msgspec.json.encode(turn("héllo", "r1")))
    first = len("t") + len("s") + SESSION_OVERHEAD + len("r1") + ID_OVERHEAD
    first += encoded + len(eid) + EVENT_OVERHEAD
    assert bus.bytes == first
    await bus.set_vars("t", "s", {"name": "Ada"}, TTL)
    assert bus.bytes == first + len("name") + len("Ada") + VAR_OVERHEAD
    await bus.set_vars("t", "s", {"name": "Adélaïde"}, TTL)  # replaced, UTF-8 bytes
    assert bus.bytes == first + len("name") + len("Adélaïde".encode()) + VAR_OVERHEAD
    assert bus.held() == (bus.bytes, 1) == (expected(bus), 1)


async def test_4000_sessions_of_100_kb_stay_within_max_bytes() -> None:
    """Today's bus (count only: 10,000 sessions) would hold all 4,000: ~407 MB counted."""
    bus = MemoryBus(max_bytes=64 * MIB)
    peak = 0
    for i in range(4_000):
        await bus.append("t", f"s{i}", [turn(KB100, f"r{i}")], TTL)
        peak = max(peak, bus.bytes)
    assert peak <= 64 * MIB
    assert bus.bytes == expected(bus)
    # What is left is the most recent: 64 MiB / ~101.7 KB a session.
    assert len(bus) == 659
    assert (await bus.load("t", "s3999", 1, TTL)).turns[0].content == KB100
    assert (await bus.load("t", "s0", 1, TTL)).turns == []


async def test_one_session_past_its_cap_drops_its_oldest_turns() -> None:
    bus = MemoryBus(max_session_bytes=MIB)
    for i in range(30):
        await bus.append("t", "s", [turn(KB100 + str(i), f"r{i}")], TTL)
    assert MIB - 102_000 < bus.bytes <= MIB
    assert bus.bytes == expected(bus)
    turns = (await bus.load("t", "s", 100, TTL)).turns
    assert [t.content[100_000:] for t in turns] == [str(i) for i in range(20, 30)]


async def test_expired_and_evicted_sessions_give_their_bytes_back(autojump_clock: Any) -> None:
    bus = MemoryBus(max_sessions=3)
    for s in "abcd":
        await bus.append("t", s, [turn(KB100, s)], 100)
        await bus.set_vars("t", s, {"v": s}, 100)
    assert len(bus) == 3
    assert bus.bytes == expected(bus)
    await trio.sleep(101)
    await bus.set_vars("t", "e", {"v": "e"}, 100)  # sweeps the expired ones
    assert len(bus) == 1
    assert bus.bytes == expected(bus)
    assert bus.tenant_held("t") == (bus.bytes, 1)


async def test_a_tenant_flooding_the_count_evicts_its_own_sessions() -> None:
    bus = MemoryBus(max_sessions=100)
    await bus.set_vars("b", "mine", {"v": "1"}, TTL)
    for i in range(150):
        await bus.set_vars("a", f"s{i}", {"v": "1"}, TTL)
    assert len(bus) == 100
    assert (await bus.load("b", "mine", 1, TTL)).variables == {"v": "1"}
    assert bus.tenant_held("a")[1] == 99


async def test_a_tenant_flooding_the_bytes_evicts_its_own_sessions() -> None:
    bus = MemoryBus(max_bytes=4 * MIB, max_session_bytes=MIB)
    for i in range(5):
        await bus.append("b", f"b{i}", [turn(KB100, f"rb{i}")], TTL)
    for i in range(200):
        await bus.append("a", f"s{i}", [turn(KB100, f"r{i}")], TTL)
        assert bus.bytes <= 4 * MIB
    assert bus.tenant_held("b")[1] == 5
    assert (await bus.load("b", "b0", 1, TTL)).turns[0].content == KB100


async def test_the_tenant_holding_the_most_pays_even_when_another_creates() -> None:
    bus = MemoryBus(max_sessions=4)
    for i in range(3):
        await bus.set_vars("a", f"s{i}", {"v": "1"}, TTL)
    await bus.set_vars("b", "b0", {"v": "1"}, TTL)
    await bus.set_vars("b", "b1", {"v": "1"}, TTL)  # full: a (3 sessions) loses s0
    assert bus.tenant_held("a")[1] == 2
    assert bus.tenant_held("b")[1] == 2
    assert (await bus.load("a", "s0", 1, TTL)).variables == {}


async def test_a_session_larger_than_the_store_is_not_kept() -> None:
    bus = MemoryBus(max_bytes=50_000, max_session_bytes=50_000)
    await bus.set_vars("t", "s", {"v": "x" * 1000}, TTL)
    await bus.append("t", "s", [turn(KB100, "r")], TTL)  # the turn alone is past the cap
    assert bus.bytes == expected(bus) <= 50_000
    assert (await bus.load("t", "s", 1, TTL)).turns == []


def test_max_session_bytes_above_max_bytes_is_refused() -> None:
    text = _sessions(config_text(), max_bytes=1_000_000, max_session_bytes=2_000_000)
    with pytest.raises(ConfigError, match="max_session_bytes"):
        parse_config(text, source="<t>")


# --- through the app ---------------------------------------------------------------------


def _sessions(text: str, **values: int) -> str:
    """``text`` with those ``[sessions]`` keys set."""
    lines = "".join(f"{k} = {v}\n" for k, v in values.items())
    return text.replace('[sessions]\nbackend = "memory"\n', f'[sessions]\nbackend = "memory"\n{lines}', 1)


async def test_sessions_of_100_kb_through_the_app_stay_within_max_bytes() -> None:
    """60 chats of 100 KB, each in a new session, on a 2 MiB store: today's bus kept all
    60 (~12 MB counted: the question and its echo); the gauge shows what is held."""
    text = _sessions(config_text(), max_bytes=2 * MIB, max_session_bytes=MIB)
    app = App(parse_config(text, source="<t>"))
    client = Client(app)
    assert isinstance(app.bus, MemoryBus)
    for i in range(60):
        r = await client.chat(chat_body("echo: " + KB100), {"x-session-id": f"big-{i}"})
        assert r.status == 200, r.body
        assert app.bus.bytes <= 2 * MIB
    assert app.bus.bytes == expected(app.bus)
    assert 0 < len(app.bus) < 60
    last = (await client.request("GET", "/v1/sessions/big-59")).json()
    assert last["turns"][0]["content"] == "echo: " + KB100
    assert (await client.request("GET", "/v1/sessions/big-0")).json()["turns"] == []
    metrics = (await client.request("GET", "/metrics")).body.decode()
    gauges = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line[:1] != "#")
    assert float(gauges["aiserve_session_bytes"]) == app.bus.bytes
    assert float(gauges["aiserve_sessions"]) == len(app.bus)


async def test_one_tenants_flood_leaves_another_tenants_session_and_stored_response() -> None:
    """10,050 ``PUT /v1/sessions/{id}/vars`` by alice (bank-a, no model call) on the
    default 10,000 sessions: today's global LRU evicted bob's (bank-b) session and made
    his stored response a 404; now alice's flood evicts alice's oldest sessions."""
    app = App(auth_config())
    client = Client(app)
    assert isinstance(app.bus, MemoryBus)
    stored = await client.request(
        "POST",
        "/v1/responses",
        json_body={"model": "aiserve-mock", "input": "echo: remember me"},
        headers=bearer(KEY_B),
    )
    assert stored.status == 200, stored.body
    r = await client.request(
        "PUT", "/v1/sessions/bob-1/vars", json_body={"name": "Bob"}, headers=bearer(KEY_B)
    )
    assert r.status == 200, r.body
    for i in range(10_050):
        r = await client.request(
            "PUT", f"/v1/sessions/flood-{i}/vars", json_body={"v": "x"}, headers=bearer(KEY_A)
        )
        assert r.status == 200, r.body
    assert len(app.bus) == 10_000
    view = await client.request("GET", "/v1/sessions/bob-1", headers=bearer(KEY_B))
    assert view.json()["variables"] == {"name": "Bob"}
    again = await client.request(
        "POST",
        "/v1/responses",
        json_body={
            "model": "aiserve-mock",
            "input": "echo: still there?",
            "previous_response_id": stored.json()["id"],
        },
        headers=bearer(KEY_B),
    )
    assert again.status == 200, again.body
    # Alice paid with her own oldest sessions.
    gone = await client.request("GET", "/v1/sessions/flood-0", headers=bearer(KEY_A))
    assert gone.json()["variables"] == {}
    assert app.bus.tenant_held("bank-b")[1] == 3  # and the new response


async def test_session_writes_count_against_the_keys_request_rate(autojump_clock: Any) -> None:
    """alice may make 5 requests a minute: a 6th PUT /vars (a new session) is a 429, as
    a 6th chat would be; a minute on, she may again. Today's gate let every PUT through."""
    client = Client(App(auth_config(auth_toml(rpm=5))))
    statuses = []
    for i in range(6):
        r = await client.request(
            "PUT", f"/v1/sessions/s-{i}/vars", json_body={"v": "x"}, headers=bearer(KEY_A)
        )
        statuses.append(r.status)
    assert statuses == [200] * 5 + [429]
    assert r.headers["retry-after"] == "12"
    await trio.sleep(60)
    r = await client.request(
        "PUT", "/v1/sessions/s-6/vars", json_body={"v": "x"}, headers=bearer(KEY_A)
    )
    assert r.status == 200


def test_changing_a_bound_needs_a_restart() -> None:
    """The bus is built once per worker: a reload must not pretend to apply a new bound."""
    from aiserve_trio.reload import needs_restart

    old = parse_config(config_text(), source="<t>")
    for key, value in (("max_bytes", 536_870_912), ("max_session_bytes", 2_097_152)):
        new = parse_config(_sessions(config_text(), **{key: value}), source="<t>")
        assert f"sessions.{key}" in (needs_restart(old, new) or "")
