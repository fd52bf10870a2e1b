"""The response cache through the app, on Trio's virtual clock, with a counting model:
hits, misses, what is in the key, client control, tenants, what is never stored, and
single flight (N identical requests, one upstream call; the first one's failure)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from aiserve_trio.cache.backend import CacheBackend
from aiserve_trio.cache.entry import Entry
from aiserve_trio.config import CORS_EXPOSE_HEADERS, ConfigError, parse_config
from aiserve_trio.core.errors import UpstreamStatusError
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client, Response
from .authcfg import KEY_A, KEY_B, OFF, auth_toml
from .cachefakes import (
    CountingModel,
    ask,
    cache_app,
    cache_config_text,
    counting_backend,
    metric,
    opened,
    reply_text,
    scrubbed,
    usage_of,
)
from .conftest import config_text
from .test_cache_key import CHANGED

# --- config ---------------------------------------------------------------------------


def test_the_cache_is_off_unless_a_route_turns_it_on() -> None:
    assert App(parse_config(config_text(), source="<t>")).cache is None
    app, _ = cache_app()
    assert app.cache is not None
    app, _ = cache_app("{ enabled = false }")
    assert app.cache is None


def test_pages_on_other_origins_may_read_the_cache_header() -> None:
    assert "x-aiserve-cache" in CORS_EXPOSE_HEADERS


@pytest.mark.parametrize(
    ("cache", "key"),
    [
        ("{ ttl_s = 0 }", "routes[0].cache.ttl_s"),
        ("{ max_entry_bytes = -1 }", "routes[0].cache.max_entry_bytes"),
        ('{ models = ["gpt-4o"] }', "routes[0].cache.models[0]"),
        ("{ colour = 1 }", "routes[0].cache"),
    ],
)
def test_a_bad_route_cache_is_refused_naming_the_key(cache: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        parse_config(cache_config_text(cache), source="<t>")


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ('backend = "disk"', "cache.backend"),
        ("max_bytes = 0", "cache.max_bytes"),
        ("timeout_ms = 0", "cache.timeout_ms"),
        ('key_prefix = "a b"', "cache.key_prefix"),
    ],
)
def test_a_bad_cache_table_is_refused_naming_the_key(table: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        parse_config(cache_config_text("{}", f"\n[cache]\n{table}\n"), source="<t>")


# --- the same request twice -------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
async def test_same_request_twice_one_upstream_call_identical_reply(
    nursery: trio.Nursery,
    stream: bool, autojump_clock: trio.testing.MockClock
) -> None:
    app, model = cache_app()
    await opened(app, nursery)
    client = Client(app)
    body = ask(stream=stream, stream_options={"include_usage": True} if stream else None)
    first = await client.chat(body)
    second = await client.chat(body)
    assert (first.status, second.status) == (200, 200)
    assert model.calls == 1
    assert (first.headers["x-aiserve-cache"], second.headers["x-aiserve-cache"]) == ("miss", "hit")
    assert reply_text(first) == "answer 1: what is a end"
    # Byte for byte the same reply: chunk shapes, usage, [DONE].
    assert scrubbed(second) == scrubbed(first)
    if stream:
        assert second.events()[-1] == "[DONE]"
    assert usage_of(second) == usage_of(first)
    assert metric(app, "aiserve_cache_requests_total", route="chat", result="hit") == 1
    assert metric(app, "aiserve_cache_requests_total", route="chat", result="miss") == 1
    assert metric(app, "aiserve_cache_stores_total", route="chat", result="stored") == 1
    assert metric(app, "aiserve_cache_entries") == 1
    assert metric(app, "aiserve_cache_bytes") > 0


@pytest.mark.parametrize("first_streams", [True, False])
async def test_a_streamed_and_a_whole_request_share_the_answer(
    nursery: trio.Nursery,
    first_streams: bool, autojump_clock: trio.testing.MockClock
) -> None:
    app, model = cache_app()
    await opened(app, nursery)
    client = Client(app)
    usage: dict[str, Any] = {"stream_options": {"include_usage": True}}
    streamed, whole = ask(stream=True, **usage), ask(stream=False)
    a = await client.chat(streamed if first_streams else whole)
    b = await client.chat(whole if first_streams else streamed)
    assert model.calls == 1
    assert b.headers["x-aiserve-cache"] == "hit"
    assert reply_text(a) == reply_text(b) == "answer 1: what is a end"
    assert usage_of(a) == usage_of(b)


DOUBLING_PACK = """
[[rules]]
id = "double"
pattern = 'cache'
replace = 'cache-cache'
"""


def policed_app(tmp_path: Path, model: CountingModel, pack: str = DOUBLING_PACK) -> App:
    """The cache route with gdpr-redact (input and output) and a compliance pack whose
    rewrite is not idempotent: running the output filters twice would show."""
    (tmp_path / "double.toml").write_text(pack)
    text = cache_config_text(
        "{}", f'\n[policies.doubling]\nkind = "compliance"\npack = "{tmp_path}/double.toml"\n'
    ).replace("policies = []", 'policies = ["gdpr-redact", "doubling"]')
    return App(parse_config(text, source="<t>"), adapters={"mock": model})


@pytest.mark.parametrize("stream", [True, False])
async def test_a_hit_replays_the_post_policy_reply_without_running_the_policies(
    nursery: trio.Nursery,
    stream: bool, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    model = CountingModel(words=5)
    app = policed_app(tmp_path, model)
    await opened(app, nursery)
    client = Client(app)
    body = ask("cache ann@example.com now", stream=stream)
    first = await client.chat(body)
    second = await client.chat(body)
    assert model.calls == 1
    # The input policy ran before the key: the model never saw the address.
    assert "ann@example.com" not in model.requests[0].messages[-1].text()
    assert reply_text(first).startswith("answer 1: cache-cache ")
    assert reply_text(second) == reply_text(first)  # rewritten once, not twice
    assert scrubbed(second) == scrubbed(first)
    rewritten = metric(app, "policy_actions_total", policy="doubling", action="rewritten")
    assert rewritten == 1  # the hit did not run the output filter


async def test_an_entry_expires_after_its_ttl(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    app, model = cache_app("{ ttl_s = 10 }")
    await opened(app, nursery)
    client = Client(app)
    await client.chat(ask())
    await trio.sleep(9)
    assert (await client.chat(ask())).headers["x-aiserve-cache"] == "hit"
    await trio.sleep(1.5)
    assert (await client.chat(ask())).headers["x-aiserve-cache"] == "miss"
    assert model.calls == 2


# --- what is in the key -----------------------------------------------------------------


# One model on these routes: the key test covers a changed model.
FIELDS = [c for c in CHANGED if c[0] != "model"]


@pytest.mark.parametrize(("what", "change"), FIELDS, ids=[c[0] for c in FIELDS])
async def test_any_changed_field_is_a_miss(
    nursery: trio.Nursery,
    what: str, change: dict[str, Any], autojump_clock: trio.testing.MockClock
) -> None:
    # Every request cached here, so that a sampled temperature counts too.
    app, model = cache_app("{ deterministic_only = false }")
    await opened(app, nursery)
    client = Client(app)
    base = ask("hi")
    base["model"] = "aiserve-mock"
    varied = {**base, **change}
    first = await client.chat(base)
    second = await client.chat(varied)
    assert first.status == 200, first.body
    assert second.status == 200, second.body
    assert second.headers["x-aiserve-cache"] == "miss"
    assert model.calls == 2
    # ... and each is then a hit on its own.
    assert (await client.chat(varied)).headers["x-aiserve-cache"] == "hit"
    assert model.calls == 2


async def test_key_order_and_whitespace_are_a_hit(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    app, model = cache_app()
    await opened(app, nursery)
    client = Client(app)
    compact = (
        b'{"model":"aiserve-mock","messages":[{"role":"user","content":"hi"}],'
        b'"temperature":0,"response_format":{"type":"json_object"},"stop":["x","y"]}'
    )
    spaced = (
        b'{\n  "stop" : [ "x" , "y" ] ,\n  "response_format" : { "type" : "json_object" },\n'
        b'  "temperature" : 0.0 , "messages" : [ { "content" : "h\\u0069" , "role" : "user" } ],'
        b'\n  "model" : "aiserve-mock"\n}'
    )
    headers = {"content-type": "application/json"}
    a = await client.request("POST", "/v1/chat/completions", body=compact, headers=headers)
    b = await client.request("POST", "/v1/chat/completions", body=spaced, headers=headers)
    assert (a.headers["x-aiserve-cache"], b.headers["x-aiserve-cache"]) == ("miss", "hit")
    assert model.calls == 1


async def test_two_tenants_never_share(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    model = CountingModel()
    text = cache_config_text("{}").replace(OFF, auth_toml())
    app = App(parse_config(text, source="<t>"), adapters={"mock": model})
    await opened(app, nursery)
    client = Client(app)
    alice = {"authorization": f"Bearer {KEY_A}", "x-channel": "app"}
    bob = {"authorization": f"Bearer {KEY_B}", "x-channel": "app"}
    a1 = await client.chat(ask(), headers=alice)
    b1 = await client.chat(ask(), headers=bob)
    assert (a1.status, b1.status) == (200, 200)
    assert b1.headers["x-aiserve-cache"] == "miss"
    assert (reply_text(a1), reply_text(b1)) == (
        "answer 1: what is a end",
        "answer 2: what is a end",
    )
    a2 = await client.chat(ask(), headers=alice)
    b2 = await client.chat(ask(), headers=bob)
    assert (reply_text(a2), reply_text(b2)) == (reply_text(a1), reply_text(b1))
    assert model.calls == 2


async def test_sessions_are_part_of_what_the_model_sees(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The same question in two conversations: the history differs, so does the key.
    app, model = cache_app()
    await opened(app, nursery)
    client = Client(app)
    await client.chat(ask("my income is 5000"), headers={"x-session-id": "s-1"})
    await client.chat(ask("what is a cache"), headers={"x-session-id": "s-1"})
    r = await client.chat(ask("what is a cache"), headers={"x-session-id": "s-2"})
    assert r.headers["x-aiserve-cache"] == "miss"
    assert model.calls == 3


# --- client control and what is cacheable ---------------------------------------------------


async def test_no_cache_skips_the_lookup_and_stores_a_fresh_answer(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, model = cache_app()
    await opened(app, nursery)
    client = Client(app)
    await client.chat(ask())
    fresh = await client.chat(ask(), headers={"cache-control": "no-cache"})
    assert fresh.headers["x-aiserve-cache"] == "bypass"
    assert reply_text(fresh) == "answer 2: what is a end"
    after = await client.chat(ask())
    assert after.headers["x-aiserve-cache"] == "hit"
    assert reply_text(after) == "answer 2: what is a end"  # the fresh one was stored
    assert model.calls == 2


async def test_no_store_neither_looks_up_nor_stores(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    app, model = cache_app()
    await opened(app, nursery)
    client = Client(app)
    r = await client.chat(ask(), headers={"cache-control": "no-store"})
    assert r.headers["x-aiserve-cache"] == "bypass"
    assert (await client.chat(ask())).headers["x-aiserve-cache"] == "miss"
    assert (await client.chat(ask(), headers={"cache-control": "no-store"})).headers[
        "x-aiserve-cache"
    ] == "bypass"
    assert model.calls == 3
    assert metric(app, "aiserve_cache_requests_total", route="chat", result="bypass") == 2


@pytest.mark.parametrize(
    ("body", "cached"),
    [
        ({"temperature": 0}, True),
        ({"seed": 42}, True),
        ({"temperature": 0.7, "seed": 42}, True),
        ({}, False),
        ({"temperature": 0.7}, False),
    ],
    ids=["temperature-0", "seed", "seed-and-temperature", "default-temperature", "sampled"],
)
async def test_by_default_only_deterministic_requests_are_cached(
    nursery: trio.Nursery,
    body: dict[str, Any], cached: bool, autojump_clock: trio.testing.MockClock
) -> None:
    app, model = cache_app()
    await opened(app, nursery)
    client = Client(app)
    request = {"model": "aiserve-mock", "messages": [{"role": "user", "content": "q"}], **body}
    await client.chat(request)
    r = await client.chat(request)
    assert r.headers["x-aiserve-cache"] == ("hit" if cached else "bypass")
    assert model.calls == (1 if cached else 2)


async def test_a_route_may_cache_sampled_requests(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    app, model = cache_app("{ deterministic_only = false }")
    await opened(app, nursery)
    client = Client(app)
    request = {"model": "aiserve-mock", "messages": [{"role": "user", "content": "q"}]}
    await client.chat(request)
    assert (await client.chat(request)).headers["x-aiserve-cache"] == "hit"
    assert model.calls == 1


async def test_models_outside_the_route_cache_list_are_not_cached(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    extra_model = 'models = ["aiserve-mock", "other"]'
    text = cache_config_text('{ models = ["other"] }').replace(
        'models = ["aiserve-mock"]', extra_model
    )
    model = CountingModel()
    model.models = ["aiserve-mock", "other"]
    app = App(parse_config(text, source="<t>"), adapters={"mock": model})
    await opened(app, nursery)
    client = Client(app)
    for _ in range(2):
        r = await client.chat(ask())
    assert r.headers["x-aiserve-cache"] == "bypass"
    for _ in range(2):
        r = await client.chat(ask(model="other"))
    assert r.headers["x-aiserve-cache"] == "hit"
    assert model.calls == 3


async def test_a_route_without_a_cache_says_nothing(autojump_clock: trio.testing.MockClock) -> None:
    app = App(parse_config(config_text(), source="<t>"))
    r = await Client(app).chat(ask())
    assert "x-aiserve-cache" not in r.headers


async def test_an_entry_too_large_is_served_not_stored(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, _model = cache_app("{ max_entry_bytes = 100 }")
    await opened(app, nursery)
    client = Client(app)
    assert reply_text(await client.chat(ask())) == "answer 1: what is a end"
    assert (await client.chat(ask())).headers["x-aiserve-cache"] == "miss"
    assert metric(app, "aiserve_cache_stores_total", route="chat", result="too_large") == 2


# --- what is never stored -------------------------------------------------------------------


async def test_an_upstream_error_is_not_stored(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    boom = UpstreamStatusError("bad request", upstream_status=400)
    app, model = cache_app(model=CountingModel(fail=[boom]))
    await opened(app, nursery)
    client = Client(app)
    r = await client.chat(ask(stream=True))
    assert r.status == 502
    ok = await client.chat(ask(stream=True))
    assert ok.headers["x-aiserve-cache"] == "miss"
    assert reply_text(ok) == "answer 2: what is a end"
    assert model.calls == 2


async def test_a_reply_cut_by_its_deadline_is_not_stored(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, model = cache_app(model=CountingModel(words=50, gap=0.05))
    await opened(app, nursery)
    client = Client(app)
    long = ask(" ".join(f"w{i}" for i in range(60)), stream=True)
    r = await client.chat(long, headers={"x-request-timeout-ms": "1000"})
    assert "stage_deadline_exceeded" in r.events()[-2]
    again = await client.chat(long)
    assert again.headers["x-aiserve-cache"] == "miss"
    assert model.calls == 2


async def test_a_reply_cut_by_a_cap_is_not_stored(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    extra_cap = "max_reply_bytes = 12\n"
    text = cache_config_text("{}").replace("cache = {}", extra_cap + "cache = {}")
    model = CountingModel()
    app = App(parse_config(text, source="<t>"), adapters={"mock": model})
    await opened(app, nursery)
    client = Client(app)
    r = await client.chat(ask(stream=True))
    assert "max_reply_bytes" in r.events()[-2]
    assert (await client.chat(ask(stream=True))).headers["x-aiserve-cache"] == "miss"
    assert model.calls == 2


async def test_the_shared_answer_stops_at_the_byte_cap_whoever_reads_slowly(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The answer is produced at the model's pace, not the client's: the cap stops it
    # there, so what is held for the readers stays bounded by the cap too.
    text = cache_config_text("{}").replace("cache = {}", "max_reply_bytes = 40\ncache = {}")
    model = CountingModel(ttft=0.01, gap=0.01, words=40)
    app = App(parse_config(text, source="<t>"), adapters={"mock": model})
    await opened(app, nursery)
    body = ask(" ".join(f"word{i}" for i in range(40)), stream=True)
    t0 = trio.current_time()
    r = await Client(app).chat(body, send_delay=1.0)
    assert "max_reply_bytes" in r.events()[-2]
    assert model.cancelled == 1
    assert model.finished == 0
    assert trio.current_time() - t0 > 2  # the client took its time; the model did not wait


async def test_a_reply_cut_by_the_token_cap_is_not_stored(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A backend that ignores the limit it was sent: the gateway ends it, "length".
    text = cache_config_text("{}").replace("cache = {}", "max_tokens = 2\ncache = {}")
    model = CountingModel()
    app = App(parse_config(text, source="<t>"), adapters={"mock": model})
    await opened(app, nursery)
    client = Client(app)
    r = await client.chat(ask())
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert (model.cancelled, model.finished) == (1, 0)  # stopped at the cap
    assert (await client.chat(ask())).headers["x-aiserve-cache"] == "miss"
    assert metric(app, "aiserve_cache_stores_total", route="chat", result="capped") == 2


async def test_a_reply_whose_only_client_left_is_not_stored(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, model = cache_app(model=CountingModel(words=20, gap=0.05))
    await opened(app, nursery)
    client = Client(app)
    body = ask(" ".join(f"w{i}" for i in range(30)), stream=True)
    async with client.open("POST", "/v1/chat/completions", json_body=body) as ex:
        await ex.wait_for_bytes(2)
        ex.disconnect()
    await trio.sleep(1)
    assert model.cancelled == 1  # nobody else wanted it: the upstream call stopped
    assert len(app.cache.flights) == 0 if app.cache else False
    again = await client.chat(body)
    assert again.headers["x-aiserve-cache"] == "miss"
    assert model.calls == 2


async def test_a_refusal_is_not_stored(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    from aiserve_trio.adapters.base import Delta, DeltaSink, InferenceRequest, Usage
    from aiserve_trio.adapters.retry import Progress

    class Refusing(CountingModel):
        async def attempt(
            self, request: InferenceRequest, send: DeltaSink, progress: Progress
        ) -> None:
            self.calls += 1
            await send.send(Delta(refusal="I cannot help with that."))
            await send.send(
                Delta(finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=5))
            )

    app, _model = cache_app(model=Refusing())
    await opened(app, nursery)
    client = Client(app)
    r = await client.chat(ask())
    assert r.json()["choices"][0]["message"]["refusal"] == "I cannot help with that."
    assert (await client.chat(ask())).headers["x-aiserve-cache"] == "miss"
    assert metric(app, "aiserve_cache_stores_total", route="chat", result="refused") == 2


# --- single flight ----------------------------------------------------------------------------


async def _many(
    client: Client, n: int, body: dict[str, Any], *, every: float = 0.0, **kw: Any
) -> list[Response]:
    out: list[Response | None] = [None] * n

    async def one(i: int) -> None:
        await trio.sleep(i * every)
        out[i] = await client.chat(body, **kw)

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    return [r for r in out if r is not None]


async def test_fifty_identical_streams_make_one_upstream_call(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # They arrive over 100 ms while the answer streams for 130 ms: the late ones
    # join mid-stream and catch up from the start.
    app, model = cache_app(model=CountingModel(ttft=0.05, gap=0.02, words=5))
    await opened(app, nursery)
    backend = counting_backend(app)
    client = Client(app)
    body = ask("tell me about caches", stream=True, stream_options={"include_usage": True})
    replies = await _many(client, 50, body, every=0.002)
    assert model.calls == 1
    # The first looked the key up; the others found its answer in flight.
    assert (backend.gets, backend.puts) == (1, 1)
    assert len(replies) == 50
    assert all(r.status == 200 and r.events()[-1] == "[DONE]" for r in replies)
    texts = {reply_text(r) for r in replies}
    assert texts == {"answer 1: tell me about caches end"}
    assert {scrubbed(r) for r in replies} == {scrubbed(replies[0])}
    results = [r.headers["x-aiserve-cache"] for r in replies]
    assert results.count("miss") == 1
    assert results.count("coalesced") == 49
    assert metric(app, "aiserve_cache_requests_total", route="chat", result="coalesced") == 49
    assert metric(app, "aiserve_cache_flights") == 0
    # Stored once, for whoever comes next.
    assert (await client.chat(body)).headers["x-aiserve-cache"] == "hit"


async def test_a_streamed_follower_gets_pieces_as_they_are_released(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, _ = cache_app(model=CountingModel(ttft=0.1, gap=0.1, words=5))
    await opened(app, nursery)
    client = Client(app)
    body = ask("one two three four", stream=True)
    t0 = trio.current_time()
    replies = await _many(client, 2, body, every=0.01)
    follower = replies[1]
    times = [t - t0 for t, _ in follower.chunks]
    # Not all at the end: the first piece at ~0.1 s, the last ~0.4 s later.
    assert times[0] == pytest.approx(0.1, abs=0.02)
    assert times[-1] - times[0] >= 0.35


async def test_a_slow_client_slows_nobody_else(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    app, model = cache_app(model=CountingModel(ttft=0.01, gap=0.01, words=5))
    await opened(app, nursery)
    client = Client(app)
    body = ask("one two three four", stream=True)
    done: dict[str, float] = {}

    async def go(name: str, delay: float) -> None:
        await client.chat(body, send_delay=delay)
        done[name] = trio.current_time()

    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(go, "slow", 0.5)  # first: it launches the flight
        await trio.sleep(0.001)
        nursery.start_soon(go, "fast", 0.0)
    assert model.calls == 1
    assert done["fast"] - t0 < 0.1
    assert done["slow"] - t0 > 1.0


async def test_the_first_client_leaving_does_not_stop_the_others(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, model = cache_app(model=CountingModel(ttft=0.05, gap=0.05, words=8))
    await opened(app, nursery)
    client = Client(app)
    body = ask("a b c d e f g h", stream=True)
    others: list[Response] = []

    async def follow() -> None:
        others.extend(await _many(client, 5, body, every=0.001))

    async with (
        trio.open_nursery() as nursery,
        client.open("POST", "/v1/chat/completions", json_body=body) as first,
    ):
        await trio.sleep(0.001)
        nursery.start_soon(follow)
        await first.wait_for_bytes(2)
        first.disconnect()  # mid-stream
    assert model.calls == 1
    assert model.cancelled == 0
    assert len(others) == 5
    assert {reply_text(r) for r in others} == {"answer 1: a b c d e f g end"}
    # The answer finished, so it was stored.
    assert (await client.chat(body)).headers["x-aiserve-cache"] == "hit"


async def test_a_first_request_with_little_time_does_not_cut_the_others(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The flight lasts as long as the latest deadline of the requests sharing it.
    app, model = cache_app(model=CountingModel(ttft=0.5, gap=0.01))
    await opened(app, nursery)
    client = Client(app)
    body = ask(stream=True)
    out: dict[str, Response] = {}

    async def go(name: str, headers: dict[str, str]) -> None:
        out[name] = await client.chat(body, headers=headers)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(go, "hurried", {"x-request-timeout-ms": "400"})
        nursery.start_soon(go, "patient", {})
    assert out["hurried"].status == 504
    assert out["patient"].status == 200
    assert reply_text(out["patient"]) == "answer 1: what is a end"
    assert model.calls == 1


async def test_a_request_joining_later_extends_the_time_of_the_answer(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Launched with the first one's short time; the second joins 0.1 s later with
    # more, and the answer goes on for it after the first has timed out.
    app, model = cache_app(model=CountingModel(ttft=0.5, gap=0.01))
    await opened(app, nursery)
    client = Client(app)
    body = ask(stream=True)
    out: dict[str, Response] = {}

    async def go(name: str, delay: float, headers: dict[str, str]) -> None:
        await trio.sleep(delay)
        out[name] = await client.chat(body, headers=headers)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(go, "hurried", 0.0, {"x-request-timeout-ms": "400"})
        nursery.start_soon(go, "patient", 0.1, {})
    assert out["hurried"].status == 504
    assert out["patient"].status == 200
    assert out["patient"].headers["x-aiserve-cache"] == "coalesced"
    assert reply_text(out["patient"]) == "answer 1: what is a end"
    assert model.calls == 1


async def test_a_follower_takes_over_an_answer_that_ran_out_of_time(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The backend is told the longest a request on the route may take (route max
    # 1 s: 0.675 s of inference); a request arriving 0.3 s later has until 0.975 s.
    # The first answer runs out at 0.675 s; the later request, which has received
    # nothing, asks anew.
    text = cache_config_text("{}").replace("cache = {}", "deadline = { default_ms = 1000, max_ms = 1000 }\ncache = {}")
    model = CountingModel(ttft=[1.0, 0.05], gap=0.01)
    app = App(parse_config(text, source="<t>"), adapters={"mock": model})
    await opened(app, nursery)
    client = Client(app)
    out: dict[str, Response] = {}

    async def go(name: str, delay: float) -> None:
        await trio.sleep(delay)
        out[name] = await client.chat(ask(stream=True))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(go, "first", 0.0)
        nursery.start_soon(go, "later", 0.3)
    assert out["first"].status == 504
    assert out["later"].status == 200
    assert out["later"].headers["x-aiserve-cache"] == "miss"
    assert reply_text(out["later"]) == "answer 2: what is a end"
    assert model.calls == 2


async def test_the_first_call_failing_one_follower_asks_again_for_everyone(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A 503 after the adapter's own retries: one new flight, not one per follower.
    flaky = UpstreamStatusError("overloaded", upstream_status=503)
    app, model = cache_app(model=CountingModel(fail=[flaky]))
    await opened(app, nursery)
    client = Client(app)
    replies = await _many(client, 10, ask(stream=True), every=0.001)
    assert model.calls == 2
    assert {reply_text(r) for r in replies} == {"answer 2: what is a end"}
    assert [r.headers["x-aiserve-cache"] for r in replies].count("miss") == 1


async def test_an_answer_that_cannot_be_had_is_everyones_error_once(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Not worth another try (a 400), or failing again: shared, no storm of calls.
    bad = UpstreamStatusError("bad", upstream_status=400)
    app, model = cache_app(model=CountingModel(fail=[bad]))
    await opened(app, nursery)
    replies = await _many(Client(app), 10, ask(), every=0.001)
    assert model.calls == 1
    assert {r.status for r in replies} == {502}
    flaky = [UpstreamStatusError("overloaded", upstream_status=503)] * 2
    app, model = cache_app(model=CountingModel(fail=list(flaky)))
    await opened(app, nursery)
    replies = await _many(Client(app), 10, ask(), every=0.001)
    assert model.calls == 2
    assert {r.status for r in replies} == {502}
    error = json.loads(replies[0].body)["error"]
    assert error["code"] == "upstream_status_error"


async def test_no_cache_requests_do_not_join_an_answer_in_flight(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, model = cache_app(model=CountingModel(ttft=0.2))
    await opened(app, nursery)
    client = Client(app)
    out: list[Response] = []

    async def go(headers: dict[str, str]) -> None:
        out.append(await client.chat(ask(), headers=headers))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(go, {})
        await trio.sleep(0.01)
        nursery.start_soon(go, {"cache-control": "no-cache"})
    assert model.calls == 2
    assert {reply_text(r) for r in out} == {"answer 1: what is a end", "answer 2: what is a end"}


class _SlowToLetGo(CacheBackend):
    """A shared backend (in memory) whose lease release takes half a second."""

    shared = True

    def __init__(self) -> None:
        self.closed = 0

    async def get(self, key: str) -> Entry | None:
        return None

    async def put(self, key: str, entry: Entry, blob: bytes, ttl_s: float) -> None:
        pass

    async def renew(self, key: str, token: str, lease_ms: int) -> bool:
        return True

    async def publish(self, key: str, token: str, pieces: bytes, keep_ms: int) -> None:
        pass

    async def close(self, key: str, token: str, **kw: Any) -> None:
        await trio.sleep(0.5)
        self.closed += 1


async def test_a_failed_answer_is_gone_for_new_requests_at_once(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # While the failed flight still lets go of its lease, a new request starts afresh.
    bad = UpstreamStatusError("bad", upstream_status=400)
    app, model = cache_app("{}", "\n[cache]\ntimeout_ms = 5000\n", model=CountingModel(fail=[bad]))
    await opened(app, nursery)
    assert app.cache is not None
    app.cache.backend = backend = _SlowToLetGo()
    client = Client(app)
    out: dict[str, Response] = {}

    async def go(name: str, delay: float) -> None:
        await trio.sleep(delay)
        out[name] = await client.chat(ask())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(go, "first", 0.0)
        nursery.start_soon(go, "second", 0.2)  # the first failed at 0.05 s
    assert out["first"].status == 502
    assert out["second"].status == 200
    assert model.calls == 2
    await trio.sleep(1)
    assert backend.closed == 2  # both let go in the end


async def test_the_request_span_says_what_the_cache_did(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    model = CountingModel()
    cfg = parse_config(cache_config_text(), source="<t>")
    app = App(cfg, adapters={"mock": model}, tracer_provider=provider)
    await opened(app, nursery)
    client = Client(app)
    for _ in range(2):
        await client.chat(ask(stream=True))
    roots = [s for s in exporter.get_finished_spans() if s.name == "POST chat"]
    assert [(s.attributes or {}).get("aiserve.cache") for s in roots] == ["miss", "hit"]
    # A hit still has its stages, the inference one included (it replayed).
    names = [s.name for s in exporter.get_finished_spans()]
    assert names.count("inference") == 2


# --- numbers the key must survive (issue 33, item 8) ---------------------------------


@pytest.mark.parametrize(
    "number", [b"1e1000000", b"-1e-1000000", b"1." + b"9" * 5000, b"9" * 4000]
)
async def test_huge_and_tiny_numbers_are_keyed_not_a_500(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock, number: bytes
) -> None:
    app, model = cache_app()
    await opened(app, nursery)
    client = Client(app)
    body = b'{"model":"aiserve-mock","messages":[{"role":"user","content":"hi"}],'
    body += b'"temperature":0,"metadata_extra":{"n":' + number + b"}}"
    headers = {"content-type": "application/json"}
    a = await client.request("POST", "/v1/chat/completions", body=body, headers=headers)
    b = await client.request("POST", "/v1/chat/completions", body=body, headers=headers)
    assert (a.status, b.status) == (200, 200)
    assert (a.headers["x-aiserve-cache"], b.headers["x-aiserve-cache"]) == ("miss", "hit")
    assert model.calls == 1


async def test_an_integer_too_long_to_read_is_invalid_json_naming_the_limit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, model = cache_app()
    body = b'{"model":"aiserve-mock","messages":[{"role":"user","content":"hi"}],'
    body += b'"temperature":0,"options":{"n":' + b"7" * 5000 + b"}}"
    r = await Client(app).request(
        "POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"}
    )
    assert r.status == 400
    error = r.json()["error"]
    assert error["code"] == "invalid_json"
    assert "4300 digits" in error["message"]
    assert model.calls == 0
