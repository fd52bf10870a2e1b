"""``POST {messages route}/count_tokens`` (count_tokens.py): relayed to Anthropic as the
client sent it when the route's adapter is ``anthropic`` (here: a real aiserve-sim), the
gateway's own estimate on other backends, said in ``X-Aiserve-Token-Count``; the route's
auth; errors in Anthropic's shape; and ``?beta=true`` (as Claude Code sends it) reaches
the route."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import pytest

from aiserve_trio.config import parse_config
from aiserve_trio.runtime.asgi import App
from aiserve_trio.security.auth import hash_key

from .asgi_client import Client
from .authcfg import KEY_A, KEY_B, auth_app, auth_toml
from .conftest import config_text
from .servers import hypercorn_gateway
from .sim_gateway import running, sim_reset
from .sim_process import run_sim

pytestmark = pytest.mark.slow

ASK: Any = {
    "model": "claude-public",
    "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
    "messages": [{"role": "user", "content": "How many tokens does this take?"}],
    "tools": [
        {
            "name": "Read",
            "description": "Read a file",
            "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}},
        }
    ],
}
BETA = "claude-code-20250219,context-management-2025-06-27"


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with run_sim() as addr:
        yield addr


def anthropic_app(sim: str) -> App:
    return App(
        parse_config(
            f"""
[auth]
enabled = false

[adapters.claude]
kind = "anthropic"
base_url = "http://{sim}"
models = {{ "claude-public" = "claude-sonnet-4-5" }}
api_key_env = "AISERVE_TEST_ANTHROPIC_KEY"

[[routes]]
path = "/claude/v1/messages"
name = "claude"
kind = "messages"
adapter = "claude"
""",
            source="<test>",
        )
    )


async def sim_log(sim: str) -> list[dict[str, Any]]:
    async with httpx2.AsyncClient() as c:
        return list((await c.get(f"http://{sim}/sim/requests")).json()["requests"])


async def test_on_an_anthropic_route_the_count_is_anthropics(
    sim: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AISERVE_TEST_ANTHROPIC_KEY", "sk-provider")
    await sim_reset(sim)
    sent = json.dumps(ASK, separators=(",", ":")).encode()
    async with running(anthropic_app(sim)) as client:
        r = await client.request(
            "POST",
            "/claude/v1/messages/count_tokens?beta=true",
            body=sent,
            headers={
                "content-type": "application/json",
                "x-api-key": "sk-client",
                "anthropic-version": "2023-06-01",
                "anthropic-beta": BETA,
            },
        )
    assert r.status == 200, r.body
    assert r.headers["x-aiserve-token-count"] == "native"
    (seen,) = await sim_log(sim)
    assert seen["path"] == "/v1/messages/count_tokens"
    # The provider's key, Anthropic's version and the client's betas went with it ...
    assert seen["headers"]["x-api-key"] == "sk-provider"
    assert seen["headers"]["anthropic-beta"] == BETA
    assert seen["headers"]["anthropic-version"] == "2023-06-01"
    # ... and the body as sent, but for the provider's name of the model.
    assert json.loads(seen["body"]) == {**ASK, "model": "claude-sonnet-4-5"}
    async with httpx2.AsyncClient() as c:
        direct = await c.post(
            f"http://{sim}/v1/messages/count_tokens",
            content=seen["body"],
            headers={"x-api-key": "k", "anthropic-version": "2023-06-01"},
        )
    assert r.json() == direct.json()  # the provider's own count, not the gateway's
    assert r.json()["input_tokens"] > 0


async def test_the_providers_refusal_comes_back_as_it_said_it(
    sim: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AISERVE_TEST_ANTHROPIC_KEY", "sk-provider")
    no_messages = {"model": "claude-public"}
    async with running(anthropic_app(sim)) as client:
        r = await client.request("POST", "/claude/v1/messages/count_tokens", json_body=no_messages)
    assert r.status == 400
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "messages" in r.json()["error"]["message"]


async def test_on_another_backend_the_gateway_estimates_and_says_so() -> None:
    client = Client(auth_app())
    short = await client.request(
        "POST", "/v1/messages/count_tokens", json_body=ASK, headers=_key(KEY_B)
    )
    assert short.status == 200, short.body
    assert short.headers["x-aiserve-token-count"] == "estimated"
    longer = {**ASK, "messages": [*ASK["messages"], {"role": "assistant", "content": "x " * 500}]}
    long = await client.request(
        "POST", "/v1/messages/count_tokens", json_body=longer, headers=_key(KEY_B)
    )
    bare = {"model": ASK["model"], "messages": ASK["messages"]}
    alone = await client.request(
        "POST", "/v1/messages/count_tokens", json_body=bare, headers=_key(KEY_B)
    )
    n, m = short.json()["input_tokens"], long.json()["input_tokens"]
    assert n < m  # 500 words more
    assert m - n >= 500
    # The system prompt and the tool's definition count as Anthropic counts them.
    assert alone.json()["input_tokens"] + 25 < n


#: A key for the Messages route only.
KEY_C = "aik_carol_" + "c" * 32
CAROL = f"""
[[auth.keys]]
id = "carol"
hash = "{hash_key(KEY_C)}"
tenant = "bank-c"
routes = ["/v1/messages"]
"""


async def test_count_tokens_takes_the_routes_auth() -> None:
    client = Client(auth_app(auth_toml() + CAROL))
    path = "/v1/messages/count_tokens"
    # carol's key may call the Messages route, so its count too (not a route of its own).
    carol = await client.request("POST", path, json_body=ASK, headers=_key(KEY_C))
    assert carol.status == 200, carol.body
    nobody = await client.request("POST", path, json_body=ASK)
    assert nobody.status == 401
    assert nobody.json()["error"]["type"] == "authentication_error"
    # alice's key may call /v1/chat/completions only: not this route, so not its count.
    alice = await client.request("POST", path, json_body=ASK, headers=_key(KEY_A))
    assert alice.status == 403
    assert alice.json()["error"]["type"] == "permission_error"
    bob = await client.request("POST", path, json_body=ASK, headers=_key(KEY_B))
    assert bob.status == 200


async def test_bad_bodies_are_refused_in_anthropics_shape() -> None:
    client = Client(auth_app())
    path = "/v1/messages/count_tokens"
    for body, where in [
        (b"{", "JSON"),
        (b'{"model": "aiserve-mock", "messages": "hi"}', "messages"),
        (b'{"model": 7, "messages": []}', "model"),
    ]:
        r = await client.request(
            "POST", path, body=body, headers={**_key(KEY_B), "content-type": "application/json"}
        )
        assert r.status == 400, body
        assert r.json()["type"] == "error"
        assert where in r.json()["error"]["message"]
    wrong = await client.request("GET", path, headers={"authorization": f"Bearer {KEY_B}"})
    assert wrong.status == 405


async def test_the_query_string_claude_code_sends_reaches_the_messages_route() -> None:
    ask = {"model": "aiserve-mock", "max_tokens": 64, "messages": ASK["messages"]}
    r = await Client(auth_app()).request(
        "POST", "/v1/messages?beta=true", json_body=ask, headers=_key(KEY_B)
    )
    assert r.status == 200, r.body
    assert r.json()["type"] == "message"


def _key(key: str) -> dict[str, str]:
    # Anthropic's clients send the key as x-api-key.
    return {"x-api-key": key, "anthropic-version": "2023-06-01"}


def test_the_sdks_count_tokens_through_the_gateway_under_hypercorn(
    sim: str, tmp_path: Path
) -> None:
    """Anthropic's SDK (``messages.count_tokens``, as Claude Code calls it) at the gateway:
    on the anthropic route Anthropic's count, on the mock's Messages route the estimate."""
    cfg = tmp_path / "gateway.toml"
    cfg.write_text(
        config_text()
        + f"""
[adapters.claude]
kind = "anthropic"
base_url = "http://{sim}"
models = ["claude-sonnet-4-5"]
api_key_env = "AISERVE_TEST_ANTHROPIC_KEY"

[[routes]]
path = "/claude/v1/messages"
name = "claude"
kind = "messages"
adapter = "claude"
"""
    )
    ask: Any = {**ASK, "model": "claude-sonnet-4-5"}
    env = {"AISERVE_TEST_ANTHROPIC_KEY": "sk-provider"}
    with hypercorn_gateway(cfg, env=env) as (base, _):
        with anthropic.Anthropic(api_key="k", base_url=f"{base}/claude", max_retries=0) as sdk:
            native = sdk.messages.with_raw_response.count_tokens(**ask)
        with anthropic.Anthropic(api_key="k", base_url=base, max_retries=0) as sdk:
            estimated = sdk.messages.with_raw_response.count_tokens(**ask)
    with anthropic.Anthropic(api_key="k", base_url=f"http://{sim}", max_retries=0) as sdk:
        direct = sdk.messages.count_tokens(**ask)
    assert native.headers["x-aiserve-token-count"] == "native"
    assert native.parse().input_tokens == direct.input_tokens
    assert estimated.headers["x-aiserve-token-count"] == "estimated"
    assert estimated.parse().input_tokens > 0
