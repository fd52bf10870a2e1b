"""The response cache in front of a real aiserve-sim process (the openai adapter, real
sockets): the sim's own request count (``GET /sim/stats``) shows what reached the model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import trio

from aiserve_trio.config import parse_config
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client, Response
from .cachefakes import reply_text, scrubbed
from .conftest import config_text
from .sim_gateway import PATH, chat, running, sim_reset, sim_stats
from .sim_process import run_sim

pytestmark = [
    pytest.mark.slow,
    # httpx2 nests async generators and closes only the outer one when left early.
    pytest.mark.filterwarnings("ignore:Async generator .httpcore2:ResourceWarning"),
]
#: Slow enough that 50 requests sent together all arrive while the first is answered.
SLOW = ["--prefill-overhead-ms", "300", "--prefill-per-token-ms", "0", "--itl-ms", "5",
        "--output-tokens-mean", "12", "--seed", "7"]  # fmt: skip


@pytest.fixture(scope="module")
def sim_addr() -> Iterator[str]:
    with run_sim(SLOW) as addr:
        yield addr


@pytest.fixture
async def sim(sim_addr: str) -> str:
    await sim_reset(sim_addr)
    return sim_addr


async def _post(client: Client, body: dict[str, object]) -> Response:
    return await client.request("POST", PATH, json_body=body)


async def test_the_same_request_twice_reaches_the_model_once(sim: str) -> None:
    async with running(_app(sim)) as client:
        first = await _post(client, chat("hello", temperature=0, stream=True))
        second = await _post(client, chat("hello", temperature=0))
    assert (first.status, second.status) == (200, 200)
    assert (first.headers["x-aiserve-cache"], second.headers["x-aiserve-cache"]) == ("miss", "hit")
    assert reply_text(first) == reply_text(second) != ""
    assert (await sim_stats(sim))["requests"] == 1


async def test_fifty_identical_streams_reach_the_model_once(sim: str) -> None:
    body = chat("tell me", temperature=0, stream=True, stream_options={"include_usage": True})
    replies: list[Response] = []
    async with running(_app(sim)) as client:

        async def one() -> None:
            replies.append(await _post(client, body))

        async with trio.open_nursery() as nursery:
            for _ in range(50):
                nursery.start_soon(one)
    stats = await sim_stats(sim)
    assert stats["requests"] == 1
    assert stats["completed"] == 1
    assert len(replies) == 50
    assert all(r.status == 200 and r.events()[-1] == "[DONE]" for r in replies)
    assert len({scrubbed(r) for r in replies}) == 1
    assert sorted(r.headers["x-aiserve-cache"] for r in replies) == ["coalesced"] * 49 + ["miss"]


def _app(addr: str) -> App:
    """The default config with route ``/v1/up`` on the sim (the openai adapter), cached."""
    extra = f"""
[adapters.up]
kind = "openai"
base_url = "http://{addr}/v1"
models = ["sim-model"]

[[routes]]
path = "{PATH}"
name = "up"
adapter = "up"
default_model = "sim-model"
cache = {{}}
"""
    return App(parse_config(config_text() + extra, source="<t>"))
