"""Session variables are capped per session at write time (count and bytes), on both
backends and through the gateway; the tokenizer's own limits are a 400, not a 500."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiserve_trio.adapters.base import InferenceRequest, Message
from aiserve_trio.adapters.tokens import fit_request, get_encoding, text_tokens_steps
from aiserve_trio.config import SessionsConfig, parse_config
from aiserve_trio.core.errors import BadRequest
from aiserve_trio.core.slices import finish
from aiserve_trio.observability.metrics import Metrics
from aiserve_trio.runtime.asgi import App
from aiserve_trio.sessions.bus import SessionBus, SessionVarsFull, VarCaps
from aiserve_trio.sessions.memory import MemoryBus
from aiserve_trio.sessions.redis_streams import RedisBus

from .asgi_client import Client, chat_body
from .conftest import config_text
from .redis_server import RedisServer

TTL = 600
SID = "caps-1"


@pytest.fixture(params=["memory", "redis"])
async def bus(request: pytest.FixtureRequest) -> AsyncIterator[SessionBus]:
    b: SessionBus
    if request.param == "memory":
        b = MemoryBus(caps=VarCaps(count=4, bytes=100))
    else:
        server: RedisServer = request.getfixturevalue("redis_up")
        cfg = SessionsConfig(
            backend="redis",
            url=server.url,
            key_prefix=f"t{secrets.token_hex(4)}",
            max_vars_per_session=4,
            max_var_bytes_per_session=100,
        )
        b = RedisBus(cfg, Metrics())
    await b.aopen()
    try:
        yield b
    finally:
        await b.aclose()


async def test_a_write_past_the_count_cap_is_refused_and_writes_nothing(bus: SessionBus) -> None:
    await bus.set_vars("t", SID, {"a": "1", "b": "2", "c": "3"}, TTL)
    with pytest.raises(SessionVarsFull, match="max_vars_per_session = 4") as info:
        await bus.set_vars("t", SID, {"d": "4", "e": "5"}, TTL)
    assert info.value.status == 413
    assert (await bus.load("t", SID, 0, TTL)).variables == {"a": "1", "b": "2", "c": "3"}
    # Overwriting a name it holds is no new variable: still within the cap.
    await bus.set_vars("t", SID, {"a": "one", "d": "4"}, TTL)
    assert len((await bus.load("t", SID, 0, TTL)).variables) == 4


async def test_a_write_past_the_byte_cap_is_refused(bus: SessionBus) -> None:
    await bus.set_vars("t", SID, {"a": "x" * 60}, TTL)
    with pytest.raises(SessionVarsFull, match="max_var_bytes_per_session = 100"):
        await bus.set_vars("t", SID, {"b": "é" * 20}, TTL)  # 41 bytes: 61 + 41 > 100
    # Replacing the big value with a small one frees its bytes.
    await bus.set_vars("t", SID, {"a": "x", "b": "é" * 20}, TTL)
    assert (await bus.load("t", SID, 0, TTL)).variables["b"] == "é" * 20


def test_a_cap_below_one_is_refused_naming_the_key() -> None:
    from aiserve_trio.config import ConfigError

    text = config_text() + "\n"
    text = text.replace("[sessions]\n", "[sessions]\nmax_vars_per_session = 0\n", 1)
    with pytest.raises(ConfigError, match="max_vars_per_session"):
        parse_config(text, source="<t>")


async def test_a_flood_of_puts_stops_at_the_cap_with_a_413_naming_it() -> None:
    app = App(parse_config(config_text(), source="<t>"))
    client = Client(app)
    statuses = []
    for i in range(10):  # 10 x 64 variables: the old code kept all 640
        values = {f"v{i}_{j}": "x" * 10 for j in range(64)}
        r = await client.request("PUT", f"/v1/sessions/{SID}/vars", json_body=values)
        statuses.append(r.status)
        if r.status != 200:
            error = r.json()["error"]
            assert error["code"] == "session_variables_full"
            assert "max_vars_per_session = 128" in error["message"]
    assert statuses == [200, 200] + [413] * 8
    view = (await client.request("GET", f"/v1/sessions/{SID}")).json()
    assert len(view["variables"]) == 128
    # A chat whose metadata would pass the cap is refused the same way.
    r = await client.chat(chat_body("hi", metadata={"one_more": "x"}), {"x-session-id": SID})
    assert r.status == 413
    assert r.json()["error"]["code"] == "session_variables_full"


# --- the tokenizer's limits --------------------------------------------------------


def _request(text: str) -> InferenceRequest:
    return InferenceRequest(
        request_id="r",
        model="gpt-4",
        messages=[Message(role="user", content=text)],
        deadline=1e9,
        max_tokens=16,
    )


async def test_a_prompt_past_the_tokenizers_own_limit_is_counted_not_a_500() -> None:
    text = "hello world 1234 " * 70_000  # 1.19 MB, 350,000 tokens: past one call's limit
    fitted = await fit_request(_request(text), context_window=1_000_000, tokenizer=None)
    assert fitted.prompt_tokens is not None
    assert 340_000 < fitted.prompt_tokens < 360_000
    with pytest.raises(BadRequest) as info:
        await fit_request(_request(text), context_window=100_000, tokenizer=None)
    assert info.value.code == "context_length_exceeded"


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.text(alphabet=st.sampled_from("ab1é中.,!'\n"), min_size=1, max_size=12)
        .filter(lambda w: not w[-1].isspace()),
        max_size=40,
    ).map(" ".join)
)
def test_counting_in_slices_gives_the_whole_texts_count(text: str) -> None:
    """Exact when the text has word breaks (a space after a non-space) to cut at."""
    enc = get_encoding("cl100k_base")
    assert finish(text_tokens_steps(enc, text, step=32)) == len(enc.encode_ordinary(text))
