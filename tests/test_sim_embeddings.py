"""aiserve-sim's ``POST /v1/embeddings``: OpenAI's shape, deterministic unit vectors, faults."""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

import pytest
import trio
import trio.testing

from aiserve_trio.sim import SimApp, SimSettings, Timing
from aiserve_trio.util.vectors import DEFAULT_DIMENSIONS, cosine, vector

from .asgi_client import Client, Response


def sim() -> SimApp:
    t = Timing(prefill_overhead_ms=20, prefill_per_token_ms=1)
    return SimApp(SimSettings(timing=t, seed=1))


async def embed(app: SimApp, headers: dict[str, str] | None = None, **payload: Any) -> Response:
    payload.setdefault("model", "sim-embed")
    return await Client(app).request("POST", "/v1/embeddings", json_body=payload, headers=headers)


def norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


async def test_one_text(autojump_clock: trio.testing.MockClock) -> None:
    t0 = trio.current_time()
    r = await embed(sim(), input="hello world")
    assert r.status == 200
    obj = r.json()
    assert obj["object"] == "list"
    assert obj["model"] == "sim-embed"
    [item] = obj["data"]
    assert item["object"] == "embedding"
    assert item["index"] == 0
    assert len(item["embedding"]) == DEFAULT_DIMENSIONS
    assert norm(item["embedding"]) == pytest.approx(1.0)
    assert obj["usage"] == {"prompt_tokens": 2, "total_tokens": 2}
    # The prefill model: overhead + per prompt token.
    assert trio.current_time() - t0 == pytest.approx(0.022)


async def test_inputs_of_every_shape_in_order(autojump_clock: trio.testing.MockClock) -> None:
    app = sim()
    texts = (await embed(app, input=["a", "b", "a"])).json()
    assert [d["index"] for d in texts["data"]] == [0, 1, 2]
    vecs = [d["embedding"] for d in texts["data"]]
    assert vecs[0] == vecs[2] != vecs[1]
    tokens = (await embed(app, input=[1, 2, 3])).json()
    assert len(tokens["data"]) == 1
    assert tokens["usage"]["prompt_tokens"] == 3
    many = (await embed(app, input=[[1, 2], [3]])).json()
    assert [d["index"] for d in many["data"]] == [0, 1]
    assert many["usage"]["prompt_tokens"] == 3
    assert many["data"][0]["embedding"] == vector([1, 2], DEFAULT_DIMENSIONS)


async def test_vectors_are_the_same_in_every_process_and_seed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = (await embed(sim(), input="same")).json()["data"][0]["embedding"]
    other = SimApp(SimSettings(seed=99))
    b = (await embed(other, input="same")).json()["data"][0]["embedding"]
    assert a == b == vector("same", DEFAULT_DIMENSIONS)


async def test_dimensions_and_base64(autojump_clock: trio.testing.MockClock) -> None:
    app = sim()
    floats = (await embed(app, input="x", dimensions=3)).json()["data"][0]["embedding"]
    b64 = (await embed(app, input="x", dimensions=3, encoding_format="base64")).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert list(struct.unpack("<3f", raw)) == pytest.approx(floats, rel=1e-6)
    assert norm(floats) == pytest.approx(1.0)
    assert floats == pytest.approx(vector("x", 3))


async def test_texts_sharing_their_words_are_near(autojump_clock: trio.testing.MockClock) -> None:
    texts = ["What is the 20-year mortgage rate?", "what is the 20 year MORTGAGE rate", "hello"]
    data = (await embed(sim(), input=texts)).json()["data"]
    a, b, c = (d["embedding"] for d in data)
    assert cosine(a, b) == pytest.approx(1.0)
    assert cosine(a, c) < 0.3


@pytest.mark.parametrize(
    "payload",
    [
        {"input": []},
        {"input": ["a", 1]},
        {"input": [[1], []]},
        {"input": [True]},
        {"input": 5},
        {"input": "a", "dimensions": 0},
        {"input": "a", "encoding_format": "int8"},
        {"model": "m"},
    ],
)
async def test_bad_requests_are_400(
    autojump_clock: trio.testing.MockClock, payload: dict[str, Any]
) -> None:
    r = await Client(sim()).request("POST", "/v1/embeddings", json_body=payload)
    assert r.status == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


async def test_faults_apply_as_for_chat(autojump_clock: trio.testing.MockClock) -> None:
    app = sim()
    r = await embed(app, {"x-sim-fault": "429:2"}, input="a")
    assert r.status == 429
    assert r.headers["retry-after"] == "2"
    hdrs = {"x-sim-fault": "503", "x-sim-fault-times": "1", "x-request-id": "e1"}
    assert (await embed(app, hdrs, input="a")).status == 503
    assert (await embed(app, hdrs, input="a")).status == 200
    malformed = await embed(app, {"x-sim-fault": "malformed:0"}, input="a")
    assert malformed.status == 200
    assert not malformed.body.startswith(b"{")
    assert app.stats.faults == {"429": 1, "503": 1, "malformed": 1}
    assert app.stats.requests == 4
    assert app.stats.completed == 1


async def test_the_budget_header_bounds_a_stalled_reply(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = sim()
    hdrs = {"x-sim-fault": "stall:0", "x-request-timeout-ms": "300"}
    t0 = trio.current_time()
    async with Client(app).open(
        "POST", "/v1/embeddings", json_body={"input": "a"}, headers=hdrs
    ) as ex:
        await trio.sleep(1)
        assert trio.current_time() - t0 == pytest.approx(1)
        ex.disconnect()
    assert app.stats.expired == 1
    assert app.stats.open_streams == 0
