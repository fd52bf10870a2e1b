"""The vllm_ws adapter: close-code and error-message mapping, and connection reuse."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest
import trio

from aiserve_trio.adapters.base import Delta, InferenceRequest, Message
from aiserve_trio.adapters.vllm_ws import VllmWsAdapter, close_error
from aiserve_trio.adapters.ws_reply import message_error
from aiserve_trio.config import VllmWsAdapterConfig
from aiserve_trio.core.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
)

from .sim_gateway import sim_reset, sim_stats
from .sim_process import run_sim


@pytest.mark.parametrize(
    ("code", "ours", "status"),
    [
        (1013, UpstreamStatusError, 503),
        (1011, UpstreamStatusError, 500),
        (1008, UpstreamProtocolError, None),
        (1002, UpstreamProtocolError, None),
        (1000, UpstreamConnectError, None),
        (1001, UpstreamConnectError, None),
        (1006, UpstreamConnectError, None),
        (None, UpstreamConnectError, None),
    ],
)
def test_close_codes(code: int | None, ours: type[UpstreamError], status: int | None) -> None:
    err = close_error("up", code, "bye")
    assert type(err) is ours
    if status is not None:
        assert isinstance(err, UpstreamStatusError)
        assert err.upstream_status == status


def test_error_messages() -> None:
    err = message_error("up", 429, "slow down", 1.5)
    assert isinstance(err, UpstreamStatusError)
    assert (err.upstream_status, err.retry_after) == (429, 1.5)
    assert type(message_error("up", 504, "late", None)) is UpstreamTimeout
    assert message_error("up", 0, "?", None).status == 502


@pytest.fixture(scope="module")
def sim_addr() -> Iterator[str]:
    with run_sim() as addr:
        yield addr


def adapter_for(addr: str, **kw: object) -> VllmWsAdapter:
    cfg = VllmWsAdapterConfig(url=f"ws://{addr}/v1/ws", models=["sim-model"], **kw)  # type: ignore[arg-type]
    return VllmWsAdapter("up", cfg)


@asynccontextmanager
async def opened(adapter: VllmWsAdapter) -> AsyncIterator[VllmWsAdapter]:
    """The adapter with its pool running in a nursery (as the app's lifespan does)."""
    async with trio.open_nursery() as nursery:
        await adapter.aopen(nursery)
        try:
            yield adapter
        finally:
            await adapter.aclose()


async def one(adapter: VllmWsAdapter, rid: str, max_tokens: int = 3) -> list[Delta]:
    send, recv = trio.open_memory_channel[Delta](100)
    req = InferenceRequest(
        request_id=rid,
        model="sim-model",
        messages=[Message(role="user", content="hi")],
        deadline=trio.current_time() + 5,
        max_tokens=max_tokens,
    )
    async with send:
        await adapter.stream(req, send)
    return [d async for d in recv]


@pytest.mark.slow
async def test_connections_are_reused(sim_addr: str) -> None:
    await sim_reset(sim_addr)
    adapter = adapter_for(sim_addr, pool_size=2)
    async with opened(adapter):
        for i in range(5):
            deltas = await one(adapter, f"seq-{i}")
            assert deltas[-1].finish_reason == "length"
        assert adapter.handshakes == 1
        # Concurrent requests open more connections; only pool_size stay idle.
        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, adapter, f"par-{i}", 20)
        assert adapter.handshakes == 4
        assert len(adapter._idle) == 2
    stats = await sim_stats(sim_addr)
    assert stats["ws_connections"] == 4
    assert stats["completed"] == 9


@pytest.mark.slow
async def test_an_error_message_leaves_the_connection_usable(sim_addr: str) -> None:
    await sim_reset(sim_addr)
    adapter = adapter_for(
        sim_addr, max_retries=0, headers={"x-sim-fault": "503", "x-sim-fault-times": "1"}
    )
    async with opened(adapter):
        with pytest.raises(UpstreamStatusError):
            await one(adapter, "e-1")
        deltas = await one(adapter, "e-1")  # same key: attempt 2 succeeds
        assert deltas[-1].finish_reason == "length"
        assert adapter.handshakes == 1


@pytest.mark.slow
async def test_a_connection_the_server_closed_while_idle_is_replaced(sim_addr: str) -> None:
    adapter = adapter_for(sim_addr, max_retries=0)
    async with opened(adapter):
        await one(adapter, "i-1")
        (idle,) = adapter._idle
        await idle.aclose()  # as if the server had closed it
        deltas = await one(adapter, "i-2")
        assert deltas[-1].finish_reason == "length"
        assert adapter.handshakes == 2


async def test_the_pool_runs_in_the_nursery_it_is_given() -> None:
    adapter = adapter_for("127.0.0.1:9")  # never connected to
    assert not await adapter.ready()
    async with trio.open_nursery() as nursery:
        await adapter.aopen(nursery)
        assert await adapter.ready()
        assert len(nursery.child_tasks) == 1  # the task holding the readers' nursery
        await adapter.aclose()
        assert not await adapter.ready()
        assert len(nursery.child_tasks) == 0


async def test_closing_an_adapter_never_opened_returns() -> None:
    with trio.fail_after(1):
        await adapter_for("127.0.0.1:9").aclose()


@pytest.mark.slow
async def test_closing_after_the_nursery_ended_drops_idle_sockets(sim_addr: str) -> None:
    adapter = adapter_for(sim_addr, max_retries=0)
    async with trio.open_nursery() as nursery:
        await adapter.aopen(nursery)
        await one(adapter, "n-1")
        (idle,) = adapter._idle
        nursery.cancel_scope.cancel()  # the app's nursery ends before shutdown closes the pool
    assert not await adapter.ready()
    with trio.fail_after(0.5):  # no close handshake to wait for: the readers are gone
        await adapter.aclose()
    assert idle.closed is not None
    assert adapter._idle == []
