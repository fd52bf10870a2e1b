"""Prices: a request's cost from its usage at the served model's price, on the
response (``X-Aiserve-Cost``, ``usage.cost``), the Outcome and the metrics."""

from __future__ import annotations

import json
import re

import msgspec
import pytest

from aiserve_trio.adapters.base import Adapter, Usage
from aiserve_trio.config import ConfigError, parse_config
from aiserve_trio.runtime.asgi import App
from aiserve_trio.spend.prices import Pricing, decimal, unpriced_models
from aiserve_trio.spend.settings import ModelPrice, PricingConfig

from .asgi_client import Client, chat_body
from .conftest import config_text
from .spendcfg import PRICES


def priced_app(extra: str = PRICES) -> App:
    return App(parse_config(config_text() + "\n" + extra, source="<test>"))


def metric(app: App, name: str, **labels: str) -> float:
    value = app.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


# --- the arithmetic (pure) ---------------------------------------------------------


def pricing(**models: ModelPrice) -> Pricing:
    return Pricing(PricingConfig(models=models))


def test_cost_is_tokens_times_price_per_million():
    p = pricing(**{"gpt-big": ModelPrice(input_per_mtok=3.0, output_per_mtok=15.0)})
    cost = p.cost("gpt-big", Usage(prompt_tokens=1_000, completion_tokens=2_000))
    assert cost == pytest.approx(1_000 * 3e-6 + 2_000 * 15e-6)


def test_cached_and_reasoning_tokens_have_their_own_prices():
    price = ModelPrice(
        input_per_mtok=4.0, output_per_mtok=10.0, cached_input_per_mtok=1.0, reasoning_per_mtok=20.0
    )
    p = pricing(**{"gpt-big": price})
    usage = Usage(
        prompt_tokens=1_000,
        completion_tokens=500,
        completion_details=msgspec.Raw(b'{"reasoning_tokens": 100}'),
        cache_read_tokens=600,  # the decoders read OpenAI's prompt_tokens_details.cached_tokens
    )
    expected = (400 * 4.0 + 600 * 1.0 + 400 * 10.0 + 100 * 20.0) / 1e6
    assert p.cost("gpt-big", usage) == pytest.approx(expected)


def test_a_model_without_a_price_or_a_reply_without_usage_costs_nothing():
    p = pricing(**{"gpt-big": ModelPrice(input_per_mtok=3.0)})
    assert p.cost("gpt-other", Usage(prompt_tokens=10, completion_tokens=10)) == 0.0
    assert p.cost("gpt-big", None) == 0.0


async def test_a_fallback_is_priced_as_the_model_that_answered(autojump_clock):
    from .test_group import GROUP_TOML, Fake, Script

    prices = PRICES.replace("aiserve-mock", "pooled") + (
        '[pricing.models."sorry-model"]\ninput_per_mtok = 1.0\noutput_per_mtok = 1.0\n'
    )
    config = parse_config(config_text() + GROUP_TOML + prices, source="<test>")
    # Both deployments fail before a token: the group's fallback (sorry-model) answers.
    fail: dict[str, Adapter] = {"a": Fake("a", Script(ttft=None)), "b": Fake("b", Script(ttft=None))}
    app = App(config, adapters=fail)
    r = await Client(app).request("POST", "/v1/pool", json_body=chat_body("hi", model="pooled"))
    assert r.status == 200
    assert r.headers["x-aiserve-fallback"] == "1"
    usage = r.json()["usage"]
    at_fallback_price = (usage["prompt_tokens"] + usage["completion_tokens"]) * 1e-6
    assert float(r.headers["x-aiserve-cost"]) == pytest.approx(at_fallback_price)
    assert metric(app, "aiserve_spend_total", tenant="default", key="none", route="pool",
                  model="sorry_model") == pytest.approx(at_fallback_price)


def test_a_cache_hit_costs_nothing_and_counts_as_saved():
    p = pricing(**{"gpt-big": ModelPrice(input_per_mtok=2.0)})
    usage = Usage(prompt_tokens=500_000, completion_tokens=0)
    for hit in ("hit", "coalesced"):
        assert p.charge("gpt-big", usage, hit) == pytest.approx((0.0, 1.0))
    assert p.charge("gpt-big", usage, "miss") == pytest.approx((1.0, 0.0))


def test_the_header_writes_a_plain_decimal():
    assert decimal(0.000123) == "0.000123"
    assert decimal(2.0) == "2.0"
    assert "e" not in decimal(1e-9)


def test_start_up_names_the_served_models_without_a_price():
    cfg = parse_config(config_text() + PRICES.replace('"aiserve-mock"', '"other"'))
    assert unpriced_models(cfg) == ["aiserve-mock"]
    assert unpriced_models(parse_config(config_text() + PRICES)) == []
    # A group's members and fallbacks answer too; an adapter no route uses does not.
    from .test_group import GROUP_TOML

    unused = '[adapters.spare]\nkind = "mock"\nmodels = ["spare-model"]\n'
    grouped = parse_config(config_text() + GROUP_TOML + unused + PRICES)
    assert unpriced_models(grouped) == ["pooled", "sorry-model"]


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ('[pricing.models.m]\ninput_per_mtok = -1.0\n', "pricing.models[...].input_per_mtok"),
        ('[pricing]\ncurrency = "$"\n', "pricing.currency"),
        ('[pricing.models.m]\nprice = 1.0\n', "pricing.models[...]"),
    ],
)
def test_bad_prices_are_refused_naming_the_key(toml, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        parse_config(config_text() + "\n" + toml, source="<test>")


# --- on the wire ------------------------------------------------------------------------


async def test_every_answer_carries_its_cost(autojump_clock):
    app = priced_app()
    r = await Client(app).chat(chat_body("echo: what did this cost"))
    assert r.status == 200
    usage = r.json()["usage"]
    expected = usage["prompt_tokens"] * 3e-6 + usage["completion_tokens"] * 15e-6
    assert float(r.headers["x-aiserve-cost"]) == pytest.approx(expected)
    assert float(r.headers["x-aiserve-cost"]) > 0
    assert usage["cost"] == pytest.approx(expected)
    spent = metric(
        app, "aiserve_spend_total", tenant="default", key="none", route="chat",
        model="aiserve_mock",
    )
    assert spent == pytest.approx(expected)


async def test_a_stream_carries_the_cost_in_its_usage_chunk(autojump_clock):
    app = priced_app()
    body = chat_body("echo: streamed", stream=True, stream_options={"include_usage": True})
    r = await Client(app).chat(body)
    assert r.status == 200
    assert "x-aiserve-cost" not in r.headers  # the head left before the usage was known
    last = json.loads(r.events()[-2])
    usage = last["usage"]
    expected = usage["prompt_tokens"] * 3e-6 + usage["completion_tokens"] * 15e-6
    assert usage["cost"] == pytest.approx(expected)
    assert expected > 0


async def test_without_prices_there_is_no_cost(autojump_clock):
    r = await Client(priced_app("")).chat(chat_body("echo: free"))
    assert r.status == 200
    assert "x-aiserve-cost" not in r.headers
    assert "cost" not in r.json()["usage"]


# --- the cache, embeddings, start-up -------------------------------------------------------


async def test_a_cache_hit_costs_nothing_and_the_saving_is_counted(autojump_clock):
    from .cachefakes import ask, cache_config_text
    from .spendcfg import running

    app = App(parse_config(cache_config_text("{}", PRICES), source="<test>"))
    async with running(app) as client:
        miss = await client.chat(ask("echo: cache me"))
        hit = await client.chat(ask("echo: cache me"))
    assert (miss.headers["x-aiserve-cache"], hit.headers["x-aiserve-cache"]) == ("miss", "hit")
    paid = float(miss.headers["x-aiserve-cost"])
    assert paid > 0
    assert float(hit.headers["x-aiserve-cost"]) == 0.0
    assert hit.json()["usage"]["cost"] == 0.0
    labels = {"tenant": "default", "key": "none", "route": "chat", "model": "aiserve_mock"}
    assert metric(app, "aiserve_spend_total", **labels) == pytest.approx(paid)
    assert metric(app, "aiserve_spend_saved_total", **labels) == pytest.approx(paid)


async def test_embeddings_are_priced_and_refused_over_budget_in_the_envelope(autojump_clock):
    from .spendcfg import KEY_CAROL, auth, running, spend_config

    app = App(spend_config())
    async with running(app) as client:
        body = {"model": "aiserve-mock", "input": "a long enough text to cost something"}
        ok = await client.request("POST", "/v1/embeddings", json_body=body, headers=auth(KEY_CAROL))
        assert ok.status == 200
        refused = await client.request(
            "POST", "/v1/embeddings", json_body=body, headers=auth(KEY_CAROL)
        )
    assert refused.status == 429
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("budget_exceeded", "key:carol")
    assert float(ok.headers["x-aiserve-cost"]) > 0
    spent = metric(app, "aiserve_spend_total", tenant="shop", key="carol", route="embeddings",
                   model="aiserve_mock")
    assert spent > 0


async def test_start_up_warns_about_served_models_without_a_price(caplog):
    from .spendcfg import running

    app = priced_app(PRICES.replace('"aiserve-mock"', '"gpt-unused"'))
    with caplog.at_level("WARNING", logger="aiserve_trio"):
        async with running(app):
            pass
    assert "no price in [pricing] (these cost 0): aiserve-mock" in caplog.text


def test_the_recording_keeps_the_cost():
    from aiserve_trio.record.line import recorded_outcome
    from aiserve_trio.stages.outcome import Outcome

    def ended(cost: float) -> Outcome:
        return Outcome(request_id="r", route="chat", channel="api", arrival=0.0, ended=1.0,
                       status="ok", cost=cost)

    assert recorded_outcome(ended(0.25)).cost == 0.25
    assert recorded_outcome(ended(0.0)).cost is None  # no prices: left out of the line
