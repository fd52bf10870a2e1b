"""The semantic cache tier through the app, on Trio's virtual clock, with the mock's
lexical vectors: a question worded differently is served the stored answer, and only
when everything else -- the facts of the question included -- is the same."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from aiserve_trio.config import CORS_EXPOSE_HEADERS, ConfigError, parse_config
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client
from .authcfg import KEY_A, KEY_B, OFF, auth_toml
from .cachefakes import CountingModel, ask, cache_config_text, metric, opened, reply_text, scrubbed

SEMANTIC = '{ ttl_s = 600, semantic = { embeddings = "vec", model = "aiserve-mock" } }'
#: A second mock adapter that only embeds (the chat adapter is the counting model).
VEC = '\n[adapters.vec]\nkind = "mock"\nmodels = ["aiserve-mock"]\nttft_ms = {ttft}\n'
Q = "What is the interest rate of the 20-year fixed mortgage?"


def semantic_app(
    cache: str = SEMANTIC, *, ttft: int = 0, extra: str = "", auth: bool = False
) -> tuple[App, CountingModel]:
    model = CountingModel(words=12)
    text = cache_config_text(cache, VEC.format(ttft=ttft) + extra)
    if auth:
        text = text.replace(OFF, auth_toml())
    return App(parse_config(text, source="<t>"), adapters={"mock": model}), model


def similarity_count(app: App, result: str) -> float:
    return metric(app, "aiserve_cache_semantic_similarity_count", route="chat", result=result)


@pytest.mark.parametrize(
    "again",
    [
        "what is the interest rate of the 20 year fixed mortgage",
        "WHAT IS THE INTEREST RATE OF THE 20-YEAR FIXED MORTGAGE???",
        "  What is the interest rate   of the 20-year fixed mortgage ? ",
    ],
)
async def test_the_same_question_worded_differently_is_a_semantic_hit(
    nursery: trio.Nursery,
    again: str, autojump_clock: trio.testing.MockClock
) -> None:
    app, model = semantic_app()
    await opened(app, nursery)
    client = Client(app)
    first = await client.chat(ask(Q))
    second = await client.chat(ask(again))
    assert first.headers["x-aiserve-cache"] == "miss"
    assert second.status == 200
    assert second.headers["x-aiserve-cache"] == "semantic-hit"
    assert float(second.headers["x-aiserve-cache-similarity"]) >= 0.92
    assert model.calls == 1
    # Replayed as an exact hit is: the same bytes as the first reply.
    assert scrubbed(second) == scrubbed(first)
    assert metric(app, "aiserve_cache_requests_total", route="chat", result="semantic_hit") == 1
    assert similarity_count(app, "hit") == 1
    [hit] = app.cache.semantic.listing() if app.cache else []
    assert (hit["asked"], hit["stored"]) == (again, Q)


@pytest.mark.parametrize(
    "other",
    [
        "What is the interest rate of the 30-year fixed mortgage?",  # term
        "What is the interest rate of the 20-month fixed mortgage?",  # unit of the term
        "What is the interest rate of the 20-year fixed mortgage of 500000 yuan?",  # amount
        "What is the interest rate of the 20-year fixed mortgage in 2027?",  # number
        "What is not the interest rate of the 20-year fixed mortgage?",  # negation
    ],
)
async def test_another_number_term_amount_or_negation_is_a_miss(
    nursery: trio.Nursery,
    other: str, autojump_clock: trio.testing.MockClock
) -> None:
    app, model = semantic_app()
    await opened(app, nursery)
    client = Client(app)
    await client.chat(ask(Q))
    r = await client.chat(ask(other))
    assert r.headers["x-aiserve-cache"] == "miss"
    assert "x-aiserve-cache-similarity" not in r.headers
    assert model.calls == 2
    assert reply_text(r) != reply_text(await client.chat(ask(Q)))


LONG = (
    "Please tell me what the current interest rate is for a 20-year fixed rate mortgage "
    "loan with your bank today"
)


@pytest.mark.parametrize(
    "other",
    [LONG.replace("20-year", "30-year"), LONG.replace("today", "tomorrow"), LONG + " not"],
)
async def test_the_facts_guard_a_question_whose_wording_is_nearer_than_the_threshold(
    nursery: trio.Nursery,
    other: str, autojump_clock: trio.testing.MockClock
) -> None:
    app, model = semantic_app()
    await opened(app, nursery)
    assert app.cache is not None
    client = Client(app)
    await client.chat(ask(LONG))
    r = await client.chat(ask(other))
    assert r.headers["x-aiserve-cache"] == "miss"
    assert model.calls == 2
    # Not even a candidate: another guard is never searched.
    assert similarity_count(app, "hit") + similarity_count(app, "miss") == 0


async def test_another_temperature_or_system_prompt_is_a_miss(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, model = semantic_app()
    await opened(app, nursery)
    client = Client(app)
    await client.chat(ask(Q, seed=7, temperature=0.2))
    hot = await client.chat(ask(Q.lower(), seed=7, temperature=0.7))
    assert hot.headers["x-aiserve-cache"] == "miss"
    system = {"role": "system", "content": "Answer for premium customers."}
    prompted = ask(Q.lower(), seed=7, temperature=0.2)
    prompted["messages"].insert(0, system)
    assert (await client.chat(prompted)).headers["x-aiserve-cache"] == "miss"
    assert model.calls == 3
    same = await client.chat(ask(Q.lower(), seed=7, temperature=0.2))
    assert same.headers["x-aiserve-cache"] == "semantic-hit"
    assert model.calls == 3


async def test_another_tenant_never_hits(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    app, model = semantic_app(auth=True)
    await opened(app, nursery)
    client = Client(app)
    alice = {"authorization": f"Bearer {KEY_A}", "x-channel": "app"}
    bob = {"authorization": f"Bearer {KEY_B}", "x-channel": "app"}
    await client.chat(ask(Q), headers=alice)
    b = await client.chat(ask(Q.lower()), headers=bob)
    assert b.headers["x-aiserve-cache"] == "miss"
    a = await client.chat(ask(Q.lower()), headers=alice)
    assert a.headers["x-aiserve-cache"] == "semantic-hit"
    assert model.calls == 2


async def test_a_conversation_with_another_history_never_hits(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Session context is in the guard: a personalised answer stays with its conversation.
    app, model = semantic_app()
    await opened(app, nursery)
    client = Client(app)
    await client.chat(ask("my income is 5000 a month"), headers={"x-session-id": "s-1"})
    await client.chat(ask(Q), headers={"x-session-id": "s-1"})
    other = await client.chat(ask(Q.lower()), headers={"x-session-id": "s-2"})
    assert other.headers["x-aiserve-cache"] == "miss"
    assert model.calls == 3


async def test_a_near_question_below_the_threshold_is_a_miss_and_counted(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, model = semantic_app()
    await opened(app, nursery)
    client = Client(app)
    await client.chat(ask(Q))
    r = await client.chat(ask("What is the interest rate of the 20-year variable mortgage?"))
    assert r.headers["x-aiserve-cache"] == "miss"
    assert model.calls == 2
    assert similarity_count(app, "miss") == 1


async def test_requests_that_are_not_deterministic_are_neither_served_nor_stored(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, model = semantic_app()
    await opened(app, nursery)
    client = Client(app)
    await client.chat(ask(Q, temperature=0.8))
    r = await client.chat(ask(Q.lower(), temperature=0.8))
    assert r.headers["x-aiserve-cache"] == "bypass"
    assert (await client.chat(ask(Q.lower()))).headers["x-aiserve-cache"] == "miss"
    assert model.calls == 3


async def test_a_slow_embedding_is_a_plain_miss_never_a_failed_request(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The embedder takes 1 s; the semantic tier gives it 250 ms.
    app, model = semantic_app(ttft=1_000)
    await opened(app, nursery)
    client = Client(app)
    t0 = trio.current_time()
    first = await client.chat(ask(Q))
    second = await client.chat(ask(Q.lower()))
    assert (first.status, second.status) == (200, 200)
    assert second.headers["x-aiserve-cache"] == "miss"
    # Two model answers (0.05 s and 4 words each) and two embeddings given up at 0.25 s.
    assert trio.current_time() - t0 == pytest.approx(2 * (0.25 + 0.05 + 0.12), abs=0.05)
    assert model.calls == 2
    assert metric(app, "aiserve_cache_backend_errors_total", op="embed") == 2
    # The exact tier is still there.
    assert (await client.chat(ask(Q))).headers["x-aiserve-cache"] == "hit"


async def test_a_failed_embedding_is_a_plain_miss(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # The counting model answers chat only: asking it for embeddings fails.
    cache = '{ semantic = { embeddings = "mock", model = "aiserve-mock" } }'
    app, _ = semantic_app(cache)
    await opened(app, nursery)
    client = Client(app)
    await client.chat(ask(Q))
    r = await client.chat(ask(Q.lower()))
    assert (r.status, r.headers["x-aiserve-cache"]) == (200, "miss")
    assert metric(app, "aiserve_cache_backend_errors_total", op="embed") == 2


async def test_an_expired_entry_is_not_served_and_its_question_is_dropped(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, model = semantic_app('{ ttl_s = 5, semantic = { embeddings = "vec", model = "m" } }')
    await opened(app, nursery)
    client = Client(app)
    await client.chat(ask(Q))
    assert app.cache is not None
    assert len(app.cache.semantic.index) == 1
    await trio.sleep(6)
    r = await client.chat(ask(Q.lower()))
    assert r.headers["x-aiserve-cache"] == "miss"
    assert model.calls == 2
    # Dropped, then filed again with the new answer.
    assert len(app.cache.semantic.index) == 1


async def test_only_a_users_text_is_looked_up(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    app, model = semantic_app()
    await opened(app, nursery)
    client = Client(app)
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cheque.png"}}

    def with_image(text: str) -> dict[str, Any]:
        body = ask()
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": text}, image]}]
        return body

    assert (await client.chat(with_image(Q))).status == 200
    assert (await client.chat(with_image(Q.lower()))).headers["x-aiserve-cache"] == "miss"
    assert model.calls == 2
    assert app.cache is not None
    assert len(app.cache.semantic.index) == 0


async def test_a_question_longer_than_max_chars_is_not_looked_up(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
) -> None:
    cache = '{ semantic = { embeddings = "vec", model = "m", max_chars = 40 } }'
    app, model = semantic_app(cache)
    await opened(app, nursery)
    client = Client(app)
    await client.chat(ask(Q))
    assert (await client.chat(ask(Q.lower()))).headers["x-aiserve-cache"] == "miss"
    await client.chat(ask("How do I reset my PIN?"))
    assert (await client.chat(ask("how do i reset my pin"))).headers["x-aiserve-cache"] == (
        "semantic-hit"
    )
    assert model.calls == 3


def test_pages_on_other_origins_may_read_the_similarity() -> None:
    assert "x-aiserve-cache-similarity" in CORS_EXPOSE_HEADERS


@pytest.mark.parametrize(
    ("cache", "key"),
    [
        (
            '{ semantic = { embeddings = "nope", model = "m" } }',
            "routes[0].cache.semantic.embeddings",
        ),
        (
            '{ semantic = { embeddings = "vec", model = "m", threshold = 1.5 } }',
            "routes[0].cache.semantic.threshold",
        ),
        ('{ semantic = { embeddings = "vec" } }', "routes[0].cache.semantic"),
    ],
)
def test_a_bad_semantic_table_is_refused_naming_the_key(cache: str, key: str) -> None:
    text = cache_config_text(cache, VEC.format(ttft=0))
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        parse_config(text, source="<t>")


def test_a_semantic_hit_is_priced_as_an_exact_hit_is() -> None:
    from aiserve_trio.spend.prices import free

    assert free("semantic-hit") is free("hit") is True


async def test_the_semantic_index_bytes_are_a_gauge_of_their_own(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # Issue 55: the index's memory was in no metric (aiserve_cache_bytes counts entries).
    app, _ = semantic_app()
    await opened(app, nursery)
    await Client(app).chat(ask(Q))
    assert app.cache is not None
    held, questions = app.cache.semantic_held()
    assert questions == 1
    assert held > 512  # a vector of the mock's, its question, key and guard
    assert metric(app, "aiserve_cache_semantic_bytes") == held
    assert held <= app.config.cache.semantic_max_bytes
