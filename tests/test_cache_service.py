"""The response cache's admission, directly (``cache/service.py`` ``Cache.admit``): what
one request does with the cache -- bypass it, replay a stored entry, launch a flight or
share one -- decided with no request running and no upstream. ``test_cache.py`` sees the
same decisions through the whole app."""

from __future__ import annotations

import trio

from aiserve_trio.adapters.base import InferenceRequest
from aiserve_trio.cache.entry import Replayed, encode, new_entry
from aiserve_trio.cache.service import Cache, Ticket, build_cache
from aiserve_trio.core.messages import Message

from .conftest import make_config

PATH = "/t/cached"
ROUTES = f"""
[[routes]]
path = "{PATH}"
name = "cached"
adapter = "mock"
cache = {{ ttl_s = 300, models = ["aiserve-mock"] }}
"""


def cache() -> Cache:
    config = make_config(ROUTES)
    built = build_cache(config, {r.path: r.path.strip("/") for r in config.routes})
    assert built is not None
    return built


def request(text: str = "what is a flight?", model: str = "aiserve-mock") -> InferenceRequest:
    return InferenceRequest(
        request_id="r",
        model=model,
        messages=[Message(role="user", content=text)],
        deadline=trio.current_time() + 10,
        temperature=0.0,
    )


async def admit(
    c: Cache,
    req: InferenceRequest,
    *,
    path: str = PATH,
    tenant: str = "acme",
    cache_control: str | None = None,
    temperature: float | None = 0.0,
) -> Ticket | None:
    return await c.admit(
        path=path,
        tenant=tenant,
        channel="api",
        cache_control=cache_control,
        temperature=temperature,
        request=req,
        deadline=trio.current_time() + 1,
    )


async def test_a_route_without_a_cache_has_no_ticket() -> None:
    assert await admit(cache(), request(), path="/v1/chat/completions") is None


async def test_what_may_not_be_cached_bypasses_it() -> None:
    c = cache()
    asked_not_to = await admit(c, request(), cache_control="no-store")
    other_model = await admit(c, request(model="another"))
    random_answer = await admit(c, request(), temperature=0.7)  # deterministic_only
    for ticket in (asked_not_to, other_model, random_answer):
        assert ticket is not None
        assert (ticket.result, ticket.member, ticket.entry) == ("bypass", None, None)
    assert len(c.flights) == 0


async def test_the_same_question_shares_one_flight_and_another_tenants_does_not() -> None:
    c = cache()
    first = await admit(c, request())
    second = await admit(c, request())
    other = await admit(c, request(), tenant="globex")
    assert first is not None
    assert second is not None
    assert other is not None
    assert first.member is not None
    assert second.member is not None
    assert other.member is not None
    assert first.result == second.result == "flight"
    assert first.member.flight is second.member.flight  # one upstream call for both
    assert other.member.flight is not first.member.flight  # a key holds its tenant
    Cache.release(first)
    Cache.release(second)
    assert first.member.left
    assert second.member.left


async def test_no_cache_asks_for_a_fresh_flight_beside_the_running_one() -> None:
    c = cache()
    running = await admit(c, request())
    fresh = await admit(c, request(), cache_control="no-cache")
    assert running is not None
    assert running.member is not None
    assert fresh is not None
    assert fresh.member is not None
    assert fresh.member.flight is not running.member.flight
    assert fresh.member.flight.key == running.member.flight.key


async def test_a_stored_answer_is_a_hit() -> None:
    c = cache()
    miss = await admit(c, request())
    assert miss is not None
    assert miss.member is not None
    key = miss.member.flight.key
    Cache.release(miss)
    entry = new_entry([Replayed(text="a shared upstream call", tokens=4)], "cached")
    await c.backend.put(key, entry, encode(entry), 300)
    hit = await admit(c, request())
    assert hit is not None
    assert (hit.result, hit.member) == ("hit", None)
    assert hit.entry is not None
    assert hit.entry.pieces[0].text == "a shared upstream call"
    other = await admit(c, request("something else"))  # not answered by it
    assert other is not None
    assert other.result == "flight"
