"""Prompt-cache accounting (issue 44, item 3): the cache reads and writes each provider
reports are read into :class:`Usage` (``prompt_tokens`` counts every input token, those
read from or written to the cache included), priced at the table's own cache rates, and
reported to each API's client in that API's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from aiserve_trio.adapters.anthropic_stream import AnthropicStreamDecoder
from aiserve_trio.adapters.base import Delta, Usage
from aiserve_trio.adapters.bedrock_stream import BedrockStreamDecoder
from aiserve_trio.adapters.chat_stream import ChatStreamDecoder
from aiserve_trio.adapters.gemini_stream import GeminiStreamDecoder
from aiserve_trio.config import Config, ConfigError, parse_config
from aiserve_trio.console.spend import spend_view
from aiserve_trio.runtime.asgi import App
from aiserve_trio.sim.bedrock import event as bedrock_event
from aiserve_trio.sim.prompt_cache import PromptCache
from aiserve_trio.spend.prices import Pricing
from aiserve_trio.spend.settings import ModelPrice, PricingConfig

from . import stream_cases
from .conftest import config_text, make_config
from .sim_gateway import running, sim_reset
from .sim_process import run_sim
from .test_audit import rows as audit_rows

# --- pricing (pure) ----------------------------------------------------------------

#: Anthropic's list prices for Claude Sonnet 4.5 (USD per million tokens): a cache
#: write 1.25x the input rate, a cache read 0.1x.
SONNET = ModelPrice(
    input_per_mtok=3.0, output_per_mtok=15.0, cache_read_per_mtok=0.3, cache_write_per_mtok=3.75
)


def sonnet() -> Pricing:
    return Pricing(PricingConfig(models={"claude": SONNET}))


def test_cache_reads_and_writes_are_priced_at_their_own_rates() -> None:
    usage = Usage(
        prompt_tokens=10_000, completion_tokens=200, cache_read_tokens=8_000, cache_write_tokens=1_500
    )
    uncached = 10_000 - 8_000 - 1_500
    expected = (uncached * 3.0 + 8_000 * 0.3 + 1_500 * 3.75 + 200 * 15.0) / 1e6
    assert sonnet().cost("claude", usage) == pytest.approx(expected)
    assert sonnet().cache_cost("claude", usage) == pytest.approx((8_000 * 0.3 + 1_500 * 3.75) / 1e6)


def test_without_cache_rates_cached_tokens_cost_what_input_costs() -> None:
    p = Pricing(PricingConfig(models={"m": ModelPrice(input_per_mtok=2.0, output_per_mtok=4.0)}))
    usage = Usage(
        prompt_tokens=1_000, completion_tokens=10, cache_read_tokens=600, cache_write_tokens=300
    )
    assert p.cost("m", usage) == pytest.approx((1_000 * 2.0 + 10 * 4.0) / 1e6)


def test_a_miscount_never_makes_the_uncached_part_negative() -> None:
    # More cached tokens reported than prompt tokens: at most the prompt is cached.
    usage = Usage(prompt_tokens=100, completion_tokens=0, cache_read_tokens=80, cache_write_tokens=90)
    assert sonnet().cost("claude", usage) == pytest.approx((80 * 0.3 + 20 * 3.75) / 1e6)


def test_the_table_reads_both_rates_and_the_older_name_of_the_read_rate() -> None:
    def price(lines: str) -> ModelPrice:
        text = config_text() + f'\n[pricing]\n[pricing.models."m"]\ninput_per_mtok = 3.0\n{lines}'
        return parse_config(text, source="<test>").pricing.models["m"]

    p = price("cache_read_per_mtok = 0.3\ncache_write_per_mtok = 3.75\n")
    assert (p.cache_read_per_mtok, p.cache_write_per_mtok) == (0.3, 3.75)
    assert price("cached_input_per_mtok = 0.5\n").cache_read_per_mtok == 0.5
    with pytest.raises(ConfigError, match="cached_input_per_mtok"):
        price("cached_input_per_mtok = 0.5\ncache_read_per_mtok = 0.3\n")
    with pytest.raises(ConfigError, match="cache_write_per_mtok"):
        price("cache_write_per_mtok = -1\n")


# --- each provider's usage, decoded (pure) -----------------------------------------


def _cache(final: Delta) -> tuple[int, int, int]:
    u = final.usage
    assert u is not None
    return u.prompt_tokens, u.cache_read_tokens, u.cache_write_tokens


def _sse(kind: str, **data: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


def test_anthropic_input_tokens_leave_out_the_cache() -> None:
    usage = {
        "input_tokens": 12,
        "cache_read_input_tokens": 2_000,
        "cache_creation_input_tokens": 300,
        "output_tokens": 1,
    }
    stream = (
        _sse("message_start", message={"id": "m", "usage": usage})
        + _sse("content_block_start", index=0, content_block={"type": "text", "text": ""})
        + _sse("content_block_delta", index=0, delta={"type": "text_delta", "text": "hi"})
        + _sse("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 5})
        + _sse("message_stop")
    )
    _, final = stream_cases.decode(AnthropicStreamDecoder("anthropic"), [stream])
    assert _cache(final) == (12 + 2_000 + 300, 2_000, 300)
    assert final.usage is not None
    assert final.usage.completion_tokens == 5


def test_openai_cached_tokens_are_part_of_prompt_tokens() -> None:
    usage = {
        "prompt_tokens": 2_048,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 1_920, "audio_tokens": 0},
    }
    chunk = {"choices": [{"delta": {"content": "hi"}, "finish_reason": "stop"}], "usage": usage}
    raw = b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n"
    _, final = stream_cases.decode(ChatStreamDecoder("openai"), [raw])
    assert _cache(final) == (2_048, 1_920, 0)
    # The details go to a Chat client as the backend sent them.
    assert final.usage is not None
    assert final.usage.prompt_details is not None
    assert json.loads(bytes(final.usage.prompt_details))["audio_tokens"] == 0


def test_gemini_cached_content_is_part_of_the_prompt_count() -> None:
    body = {
        "candidates": [
            {"content": {"parts": [{"text": "hi"}], "role": "model"}, "finishReason": "STOP"}
        ],
        "usageMetadata": {
            "promptTokenCount": 5_000,
            "candidatesTokenCount": 2,
            "cachedContentTokenCount": 4_096,
        },
    }
    raw = b"data: " + json.dumps(body).encode() + b"\r\n\r\n"
    _, final = stream_cases.decode(GeminiStreamDecoder("gemini", "call_x_"), [raw])
    assert _cache(final) == (5_000, 4_096, 0)


def test_bedrock_input_tokens_leave_out_the_cache() -> None:
    usage = {
        "inputTokens": 4,
        "outputTokens": 250,
        "totalTokens": 1_900,
        "cacheReadInputTokens": 0,
        "cacheWriteInputTokens": 1_646,
    }
    raw = (
        bedrock_event("messageStart", {"role": "assistant"})
        + bedrock_event("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": "hi"}})
        + bedrock_event("messageStop", {"stopReason": "end_turn"})
        + bedrock_event("metadata", {"usage": usage})
    )
    _, final = stream_cases.decode(BedrockStreamDecoder("bedrock"), [raw])
    assert _cache(final) == (1_650, 0, 1_646)


def test_the_response_cache_keeps_the_cache_counts() -> None:
    from aiserve_trio.cache.entry import Replayed, decode, encode, new_entry

    usage = Usage(prompt_tokens=50, completion_tokens=2, cache_read_tokens=40, cache_write_tokens=7)
    entry = new_entry([Replayed(text="hi", finish_reason="stop", usage=usage)], "r")
    back = decode(encode(entry))
    assert back is not None
    assert back.pieces[-1].usage == usage


def test_prompt_details_carry_the_counts_to_chat_clients() -> None:
    from aiserve_trio.adapters.base import prompt_details

    usage = Usage(prompt_tokens=50, completion_tokens=2, cache_read_tokens=40, cache_write_tokens=7)
    assert msgspec.json.decode(prompt_details(usage)) == {
        "cached_tokens": 40,
        "cache_write_tokens": 7,
    }


# --- through the gateway, against aiserve-sim (real sockets) ------------------------

#: A system prompt well past the sim's cacheable minimum (1,024 tokens).
LONG_SYSTEM = " ".join(f"Rule {i}: answer in plain words, cite the policy." for i in range(200))


def _gateway_config(sim: str, audit: Path) -> Config:
    extra = f"""
[adapters.claude]
kind = "anthropic"
base_url = "http://{sim}"
models = ["claude-sonnet-4-5"]
api_key_env = "AISERVE_TEST_ANTHROPIC_KEY"
max_retries = 0

[adapters.gpt]
kind = "openai"
base_url = "http://{sim}/v1"
models = ["gpt-4o"]

[[routes]]
path = "/t/messages"
name = "t_messages"
kind = "messages"
adapter = "claude"

[[routes]]
path = "/t/chat"
name = "t_chat"
adapter = "claude"

[[routes]]
path = "/t/responses"
name = "t_responses"
kind = "responses"
adapter = "claude"

[[routes]]
path = "/t/openai"
name = "t_openai"
adapter = "gpt"

[[routes]]
path = "/t/openai-messages"
name = "t_openai_messages"
kind = "messages"
adapter = "gpt"

[pricing]
currency = "USD"
[pricing.models."claude-sonnet-4-5"]
input_per_mtok = 3.0
output_per_mtok = 15.0
cache_read_per_mtok = 0.3
cache_write_per_mtok = 3.75
[pricing.models."gpt-4o"]
input_per_mtok = 2.5
output_per_mtok = 10.0
cache_read_per_mtok = 1.25

[audit]
path = "{audit}"
"""
    return make_config(extra)


@pytest.fixture(scope="module")
def sim_addr() -> Iterator[str]:
    with run_sim() as addr:
        yield addr


def _ask(question: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 64,
        "system": LONG_SYSTEM,
        "messages": [{"role": "user", "content": question}],
        **extra,
    }


def _row(path: Path, request_id: str) -> dict[str, Any]:
    (row,) = audit_rows(path, f"request_id = '{request_id}'")
    return row


@pytest.mark.slow
async def test_a_cache_read_is_priced_at_the_read_rate_end_to_end(
    sim_addr: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await sim_reset(sim_addr)
    monkeypatch.setenv("AISERVE_TEST_ANTHROPIC_KEY", "sim-anthropic-key")
    db = tmp_path / "audit.db"
    app = App(_gateway_config(sim_addr, db))
    async with running(app) as client:
        first = await client.request("POST", "/t/messages", json_body=_ask("What is rule 3?"))
        second = await client.request("POST", "/t/messages", json_body=_ask("And rule 4?"))
        # The same prefix through Chat Completions, streamed with usage.
        chat = {
            "model": "claude-sonnet-4-5",
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [
                {"role": "system", "content": LONG_SYSTEM},
                {"role": "user", "content": "And rule 5?"},
            ],
        }
        third = await client.request("POST", "/t/chat", json_body=chat)
        own = await client.request("GET", "/v1/usage?group_by=model")
        console = await spend_view(app.console.usage, app.gate)
    assert (first.status, second.status, third.status) == (200, 200, 200)

    # Anthropic's shape to a Messages client: input_tokens is the uncached part.
    u1, u2 = first.json()["usage"], second.json()["usage"]
    cached = u1["cache_creation_input_tokens"]
    assert cached > 1_024
    assert u1["cache_read_input_tokens"] == 0
    assert (u2["cache_read_input_tokens"], u2["cache_creation_input_tokens"]) == (cached, 0)
    assert 0 < u2["input_tokens"] < 50

    # X-Aiserve-Cost of the cache read: the read rate on the cached tokens.
    def price(u: dict[str, int]) -> float:
        return (
            u["input_tokens"] * 3.0
            + u["cache_read_input_tokens"] * 0.3
            + u["cache_creation_input_tokens"] * 3.75
            + u["output_tokens"] * 15.0
        ) / 1e6

    cost2 = float(second.headers["x-aiserve-cost"])
    assert cost2 == pytest.approx(price(u2), abs=1e-9)
    uncached = (u2["input_tokens"] + cached) * 3.0e-6 + u2["output_tokens"] * 15e-6
    assert cost2 < uncached / 5
    assert float(first.headers["x-aiserve-cost"]) == pytest.approx(price(u1), abs=1e-9)

    # The audit rows: the counts, and the part of the cost the cache took.
    row1 = _row(db, first.headers["x-request-id"])
    row2 = _row(db, second.headers["x-request-id"])
    assert (row1["cache_read_tokens"], row1["cache_write_tokens"]) == (0, cached)
    assert row1["cache_cost"] == pytest.approx(cached * 3.75e-6)
    assert (row2["cache_read_tokens"], row2["cache_write_tokens"]) == (cached, 0)
    assert row2["cache_cost"] == pytest.approx(cached * 0.3e-6)
    assert row2["cost"] == pytest.approx(cost2)
    assert row2["prompt_tokens"] == u2["input_tokens"] + cached

    # Chat Completions: prompt_tokens counts every input token, cached_tokens the reads.
    usage3 = json.loads(third.events()[-2])["usage"]
    assert usage3["prompt_tokens_details"]["cached_tokens"] == cached
    assert usage3["prompt_tokens"] > cached
    # A stream's cost is in its final usage (its head went out before the usage came).
    expected3 = (
        (usage3["prompt_tokens"] - cached) * 3.0 + cached * 0.3 + usage3["completion_tokens"] * 15
    ) / 1e6
    assert usage3["cost"] == pytest.approx(expected3, abs=1e-9)

    # /v1/usage and the console's spend tables sum them.
    (group,) = own.json()["groups"]
    assert group["group"] == "claude-sonnet-4-5"
    assert (group["cache_read_tokens"], group["cache_write_tokens"]) == (2 * cached, cached)
    assert group["cache_cost"] == pytest.approx(cached * (3.75 + 2 * 0.3) * 1e-6)
    (model,) = console.models
    assert (model.cache_read_tokens, model.cache_cost) == (2 * cached, group["cache_cost"])


@pytest.mark.slow
async def test_openais_cached_tokens_are_priced_at_the_read_rate_end_to_end(
    sim_addr: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await sim_reset(sim_addr)
    monkeypatch.setenv("AISERVE_TEST_ANTHROPIC_KEY", "sim-anthropic-key")
    db = tmp_path / "audit.db"
    app = App(_gateway_config(sim_addr, db))

    def ask(question: str) -> dict[str, Any]:
        return {
            "model": "gpt-4o",
            "messages": [
                {"role": "system", "content": LONG_SYSTEM},
                {"role": "user", "content": question},
            ],
        }

    async with running(app) as client:
        first = await client.request("POST", "/t/openai", json_body=ask("What is rule 3?"))
        second = await client.request("POST", "/t/openai", json_body=ask("And rule 4?"))
        # A Messages client of the same backend: Anthropic's shape, made from OpenAI's.
        claude_form = _ask("And rule 5?", model="gpt-4o")
        third = await client.request("POST", "/t/openai-messages", json_body=claude_form)
    u1, u2 = first.json()["usage"], second.json()["usage"]
    assert u1["prompt_tokens_details"]["cached_tokens"] == 0  # OpenAI reports no writes
    cached = u2["prompt_tokens_details"]["cached_tokens"]
    assert cached > 1_024
    expected = (
        (u2["prompt_tokens"] - cached) * 2.5 + cached * 1.25 + u2["completion_tokens"] * 10.0
    ) / 1e6
    assert float(second.headers["x-aiserve-cost"]) == pytest.approx(expected, abs=1e-9)
    row = _row(db, second.headers["x-request-id"])
    assert (row["cache_read_tokens"], row["cache_write_tokens"]) == (cached, 0)
    assert row["cache_cost"] == pytest.approx(cached * 1.25e-6)
    u3 = third.json()["usage"]
    assert (u3["cache_read_input_tokens"], u3["cache_creation_input_tokens"]) == (cached, 0)
    assert u3["input_tokens"] == _row(db, third.headers["x-request-id"])["prompt_tokens"] - cached
    assert 0 < u3["input_tokens"] < 50


@pytest.mark.slow
async def test_a_responses_client_gets_the_reads_and_writes_in_its_details(
    sim_addr: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await sim_reset(sim_addr)
    monkeypatch.setenv("AISERVE_TEST_ANTHROPIC_KEY", "sim-anthropic-key")
    app = App(_gateway_config(sim_addr, tmp_path / "audit.db"))
    ask = {"model": "claude-sonnet-4-5", "instructions": LONG_SYSTEM, "max_output_tokens": 64}
    async with running(app) as client:
        first = await client.request("POST", "/t/responses", json_body={**ask, "input": "Rule 3?"})
        second = await client.request("POST", "/t/responses", json_body={**ask, "input": "Rule 4?"})
    d1, d2 = first.json()["usage"], second.json()["usage"]
    written = d1["input_tokens_details"]["cache_write_tokens"]
    assert written > 1_024
    assert d1["input_tokens_details"]["cached_tokens"] == 0
    assert d2["input_tokens_details"] == {"cached_tokens": written, "cache_write_tokens": 0}
    assert d2["input_tokens"] > written  # every input token, the cached ones included


def test_the_sims_cache_reads_the_longest_earlier_prefix_and_writes_the_rest() -> None:
    cache = PromptCache(max_prefixes=2)
    system, u1, a1 = (b"system", 1_500), (b"u1", 10), (b"a1", 20)
    assert cache.account("m", [system, u1]) == (0, 1_500)  # first seen: written
    assert cache.account("m", [system, (b"u2", 7)]) == (1_500, 0)  # a new question: read
    # The next turn of the conversation reads the system prompt, writes the turns since.
    assert cache.account("m", [system, u1, a1, (b"u3", 5)]) == (1_500, 30)
    assert cache.account("m", [(b"short", 1_000), u1]) == (0, 0)  # under 1,024 tokens
    # Per model; and past two prefixes the least recently used one is forgotten.
    assert cache.account("other", [system, u1]) == (0, 1_500)
    assert cache.account("m", [system, u1]) == (0, 1_500)
