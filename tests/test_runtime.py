"""A runtime and its generations, directly (``runtime/generation.py``): which adapters a reload
reuses, when a retired runtime is drained, and what is closed then -- only what no live
runtime still holds. The app-level reload tests (``test_reload.py``) see the same through
requests; here each rule is one small case."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from aiserve_trio.adapters import build_adapters
from aiserve_trio.config import Config
from aiserve_trio.observability.events import NULL_HOOK
from aiserve_trio.runtime.gateway import build_gateway
from aiserve_trio.runtime.generation import Generations, Held, Runtime, carry_adapters

from .conftest import make_config

TWO_AND_A_GROUP = """
[adapters.spare]
kind = "mock"
models = ["spare-model"]
ttft_ms = {spare_ttft}

[adapters.pair]
kind = "group"
models = ["aiserve-mock"]
deployments = [{{ adapter = "mock" }}, {{ adapter = "spare" }}]
"""


def config(spare_ttft: int = 0, **mock: str) -> Config:
    return make_config(TWO_AND_A_GROUP.format(spare_ttft=spare_ttft), **mock)


def test_a_reload_reuses_every_adapter_whose_settings_did_not_change() -> None:
    before = config()
    previous = build_adapters(before.adapters, NULL_HOOK)
    same, fresh = carry_adapters(config().adapters, previous, before.adapters, NULL_HOOK)
    assert fresh == []
    assert all(same[name] is previous[name] for name in previous)


def test_a_changed_member_rebuilds_its_group_and_keeps_the_others() -> None:
    before = config()
    previous = build_adapters(before.adapters, NULL_HOOK)
    after = config(spare_ttft=5)
    out, fresh = carry_adapters(after.adapters, previous, before.adapters, NULL_HOOK)
    assert out["mock"] is previous["mock"]  # unchanged: its pool carries on
    assert out["spare"] is not previous["spare"]
    assert out["pair"] is not previous["pair"]  # holds the new member, not the old one
    assert {a.name for a in fresh} == {"spare", "pair"}


def runtimes(first: Config, second: Config) -> tuple[Generations, Runtime, Runtime]:
    """A gateway's first runtime (current) and a second one built from ``second``."""
    gw = build_gateway(first)
    old = gw.generations.current
    adapters, _ = carry_adapters(second.adapters, old.adapters, old.config.adapters, NULL_HOOK)
    return gw.generations, old, gw.builder.build(second, adapters, old)


async def test_a_retired_runtime_drains_when_its_last_request_leaves() -> None:
    generations, old, new = runtimes(config(), config())
    old.enter()  # a request that took the old runtime before the swap
    assert generations.swap(new) is old
    assert old.closing.is_set()  # its session streams end and reconnect to the new one
    assert not old.drained.is_set()
    old.leave()
    assert old.drained.is_set()
    assert generations.current is new
    assert not new.closing.is_set()


async def test_a_drained_runtime_closes_only_what_no_live_runtime_holds() -> None:
    generations, old, new = runtimes(config(), config(spare_ttft=5))
    generations.swap(new)
    closed: list[str] = []
    for adapter in old.adapters.values():

        async def note(name: str = adapter.name) -> None:
            closed.append(name)

        adapter.aclose = note  # type: ignore[method-assign]
    await generations.drain(old)  # nobody used it: drained when retired
    assert sorted(closed) == ["pair", "spare"]  # "mock" serves on in the new runtime
    assert generations.live == [new]


async def test_a_held_resource_that_fails_to_open_says_so_at_start() -> None:
    closed = trio.Event()

    async def fail() -> None:
        raise OSError("no such host")

    async def close() -> None:
        closed.set()

    async with trio.open_nursery() as nursery:
        held = Held(fail, close)
        with pytest.raises(OSError, match="no such host"):
            await held.start(nursery)
        await trio.testing.wait_all_tasks_blocked()
        assert closed.is_set()  # what the opening entered is closed in its own task


async def test_a_held_resource_is_closed_in_the_task_that_opened_it() -> None:
    tasks: list[object] = []

    async def open_() -> None:
        tasks.append(trio.lowlevel.current_task())

    async def close() -> None:
        tasks.append(trio.lowlevel.current_task())

    async with trio.open_nursery() as nursery:
        held = Held(open_, close)
        await held.start(nursery)
        assert len(tasks) == 1
        await held.aclose()
    assert len(tasks) == 2
    assert tasks[0] is tasks[1]
    assert tasks[0] is not trio.lowlevel.current_task()
