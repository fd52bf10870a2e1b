"""Conservation through the response cache (issue 50, item 2): one upstream call is paid
exactly once. The request that launched a flight pays for the whole call -- also when it
leaves before the end while the flight goes on for the requests that joined it; those, and
later hits, pay 0 and count as saved what the call cost, never more. On Trio's virtual
clock, with a model that reports its own usage."""

from __future__ import annotations

import trio
import trio.testing

from aiserve_trio.config import parse_config
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client, Response
from .cachefakes import CountingModel, ask, cache_config_text, opened

PRICES = """
[pricing]
currency = "USD"
[pricing.models."aiserve-mock"]
input_per_mtok = 3.0
output_per_mtok = 15.0
"""
QUESTION = "one two three four five six seven eight nine ten eleven twelve"
WORDS = 12  # the model's words: "answer 1:" + ten of the question + "end"
#: What the one upstream call cost, at the usage the model reports (12 prompt tokens).
CALL = 12 * 3.0 / 1e6 + WORDS * 15.0 / 1e6


def spend(app: App, name: str = "aiserve_spend_total") -> float:
    return sum(
        s.value
        for family in app.metrics.registry.collect()
        for s in family.samples
        if s.name == name
    )


def flight_app() -> tuple[App, CountingModel]:
    model = CountingModel(ttft=0.01, gap=0.01, words=11)
    cfg = parse_config(cache_config_text("{}", PRICES), source="<test>")
    return App(cfg, adapters={"mock": model}), model


async def test_a_launcher_that_leaves_pays_the_call_its_joiners_pay_nothing(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    app, model = flight_app()
    await opened(app, nursery)
    client = Client(app)
    body = ask(QUESTION, stream=True)
    joined: list[Response] = []

    async def join() -> None:
        await trio.sleep(0.02)  # the flight is under way
        joined.append(await client.chat(body))

    async with trio.open_nursery() as requests:
        requests.start_soon(join)
        async with client.open("POST", "/v1/chat/completions", json_body=body) as launcher:
            await launcher.wait_for_bytes(1)
            await trio.sleep(0.03)  # the joiner is in
            launcher.disconnect()
    assert model.calls == 1
    assert model.finished == 1
    [member] = joined
    assert member.headers["x-aiserve-cache"] == "coalesced"
    assert float(member.headers.get("x-aiserve-cost", "0")) == 0.0
    # The call, whole, billed once: to the launcher that left after a word or two.
    assert abs(spend(app) - CALL) < 1e-12
    # The joiner saved what the call cost; a later hit too -- each never more.
    assert abs(spend(app, "aiserve_spend_saved_total") - CALL) < 1e-12
    hit = await client.chat(ask(QUESTION))
    assert hit.headers["x-aiserve-cache"] == "hit"
    assert abs(spend(app, "aiserve_spend_saved_total") - 2 * CALL) < 1e-12
    assert abs(spend(app) - CALL) < 1e-12
    assert model.calls == 1


async def test_a_launcher_that_stays_pays_the_call_once(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    app, model = flight_app()
    await opened(app, nursery)
    client = Client(app)
    body = ask(QUESTION, stream=True)
    out: list[Response] = []

    async def one(delay: float) -> None:
        await trio.sleep(delay)
        out.append(await client.chat(body))

    async with trio.open_nursery() as requests:
        for delay in (0.0, 0.02, 0.04):
            requests.start_soon(one, delay)
    assert model.calls == 1
    assert sorted(r.headers["x-aiserve-cache"] for r in out) == ["coalesced"] * 2 + ["miss"]
    assert abs(spend(app) - CALL) < 1e-12
    assert abs(spend(app, "aiserve_spend_saved_total") - 2 * CALL) < 1e-12


async def test_a_launcher_alone_that_leaves_pays_what_the_call_made_before_it_ended(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # Nobody joined: its leaving ends the call; it pays what the call produced, as the
    # gateway counts it (no usage came), and nothing is saved.
    app, model = flight_app()
    await opened(app, nursery)
    client = Client(app)
    async with client.open(
        "POST", "/v1/chat/completions", json_body=ask(QUESTION, stream=True)
    ) as launcher:
        await launcher.wait_for_bytes(1)
        await trio.sleep(0.035)
        launcher.disconnect()
    await trio.testing.wait_all_tasks_blocked()
    assert model.calls == 1
    assert model.cancelled == 1
    assert 0 < spend(app) < CALL
    assert spend(app, "aiserve_spend_saved_total") == 0.0
