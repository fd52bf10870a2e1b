"""Property tests: hostile, near-valid and valid request bodies against the parse stage
and the whole app in-process -- only documented 4xx errors (or a 200) may come out."""

from __future__ import annotations

import json
from typing import Any

import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiserve_trio.config import LimitsConfig
from aiserve_trio.core.errors import GatewayError
from aiserve_trio.stages.parse import decode_request

from .asgi_client import Client
from .conftest import make_config

DOCUMENTED = {400, 404, 413, 415, 422}
LIMITS = LimitsConfig()
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=40),
    st.sampled_from(
        [
            "\x00",
            "\uff4d\uff4f\uff44\uff45\uff4c",
            "\u0430iserve-mock",
            "\ud7ff",
            "user",
            "assistant",
        ]
    ),
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "tool", "x", ""]),
        "content": st.one_of(st.text(max_size=50), json_values),
    }
)
near_valid = st.fixed_dictionaries(
    {
        "model": st.one_of(st.just("aiserve-mock"), st.text(max_size=20), json_values),
        "messages": st.one_of(st.lists(message, max_size=4), json_values),
    },
    optional={
        "stream": json_values,
        "max_tokens": json_values,
        "temperature": json_values,
        "n": json_values,
        "stop": json_values,
        "stream_options": json_values,
    },
)


def hostile_bytes() -> st.SearchStrategy[bytes]:
    deep = st.integers(1, 5000).map(lambda n: b"[" * n + b"]" * n)
    deep_obj = st.integers(1, 3000).map(lambda n: b'{"messages":' + b"[" * n + b"]" * n + b"}")
    huge_num = st.integers(1, 5000).map(
        lambda n: b'{"model":"m","messages":[],"max_tokens":1' + b"0" * n + b"}"
    )
    return st.one_of(
        st.binary(max_size=200),
        deep,
        deep_obj,
        huge_num,
        st.binary(max_size=50).map(
            lambda b: b'{"model":"' + b + b'","messages":[{"role":"user","content":"x"}]}'
        ),
        near_valid.map(lambda d: json.dumps(d).encode()),
    )


@settings(max_examples=400, deadline=None)
@given(hostile_bytes())
def test_decoder_only_raises_documented_errors(body: bytes) -> None:
    status = 200
    try:
        decode_request(body, LIMITS, "aiserve-mock")
    except GatewayError as err:
        status = err.status
    assert status == 200 or status in DOCUMENTED


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    body=hostile_bytes(),
    ctype=st.sampled_from(["application/json", "text/plain", "application/x+json"]),
)
def test_app_answers_hostile_bodies_with_documented_statuses(body: bytes, ctype: str) -> None:
    app_cfg = make_config("", ttft_ms="0", inter_token_ms="0")

    async def one() -> Any:
        from aiserve_trio.runtime.asgi import App

        client = Client(App(app_cfg))
        with trio.fail_after(10):
            return await client.request(
                "POST", "/v1/chat/completions", body=body, headers={"content-type": ctype}
            )

    r = trio.run(one)
    assert r.status == 200 or r.status in DOCUMENTED, (r.status, r.body[:200])
    if r.status != 200:
        assert set(json.loads(r.body)) == {"error"}
