"""The adapter base's template: the out-of-time guard, retries reported to the hook,
and the guarantee that a reply ends with exactly one final delta or raises."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable

import msgspec
import pytest
import trio
import trio.testing

from aiserve_trio.adapters import build_adapter
from aiserve_trio.adapters.base import (
    Adapter,
    Delta,
    DeltaSink,
    InferenceRequest,
    Message,
    Usage,
    budget_ms,
)
from aiserve_trio.adapters.retry import NO_RETRIES, Progress, RetryPolicy
from aiserve_trio.config import MockAdapterConfig, OpenAIAdapterConfig, VllmWsAdapterConfig
from aiserve_trio.core.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
)

from .fakes import RecordingHook

Try = Callable[[DeltaSink, Progress], Awaitable[None]]
FINAL = Delta(finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=1))


class Scripted(Adapter):
    """Runs one scripted function per try, in turn."""

    def __init__(self, *tries: Try, policy: RetryPolicy = NO_RETRIES) -> None:
        self.hook_log = RecordingHook()
        super().__init__("scripted", ["m"], policy=policy, hook=self.hook_log, rng=random.Random(0))
        self.tries = list(tries)
        self.calls = 0

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        self.calls += 1
        await self.tries.pop(0)(send, progress)


async def ok(send: DeltaSink, progress: Progress) -> None:
    await send.send(Delta(text="hi"))
    await send.send(FINAL)


def failing(err: UpstreamError, *, after_text: bool = False) -> Try:
    async def run(send: DeltaSink, progress: Progress) -> None:
        if after_text:
            await send.send(Delta(text="partial"))
        raise err

    return run


def request(deadline: float) -> InferenceRequest:
    return InferenceRequest(
        request_id="r1",
        model="m",
        messages=[Message(role="user", content="hi")],
        deadline=deadline,
        forward_headers={"traceparent": "00-a-b-01"},
    )


async def run(adapter: Adapter, req: InferenceRequest) -> list[Delta]:
    send, recv = trio.open_memory_channel[Delta](100)
    async with send:
        await adapter.stream(req, send)
    return [d async for d in recv]


async def run_failing(adapter: Adapter, req: InferenceRequest) -> tuple[list[Delta], UpstreamError]:
    send, recv = trio.open_memory_channel[Delta](100)
    with pytest.raises(UpstreamError) as info:
        async with send:
            await adapter.stream(req, send)
    return [d async for d in recv], info.value


async def test_a_reply_that_finishes_is_passed_on_and_the_try_reported() -> None:
    adapter = Scripted(ok)
    req = request(trio.current_time() + 5)
    before = msgspec.to_builtins(req)
    assert await run(adapter, req) == [Delta(text="hi", model="m"), FINAL]  # the first names the model
    assert adapter.hook_log.events == [("attempt", 1)]
    assert adapter.hook_log.adapters == {"scripted"}
    assert msgspec.to_builtins(req) == before  # stream() leaves the request alone


async def test_a_try_that_returns_without_finishing_is_a_protocol_error() -> None:
    async def unfinished(send: DeltaSink, progress: Progress) -> None:
        await send.send(Delta(text="half a"))

    adapter = Scripted(unfinished, policy=RetryPolicy(3, 0.01, 0.01))
    deltas, err = await run_failing(adapter, request(trio.current_time() + 5))
    assert type(err) is UpstreamProtocolError
    assert str(err) == "scripted: the model backend ended the reply without finishing it"
    assert deltas == [Delta(text="half a", model="m")]
    assert adapter.calls == 1
    assert adapter.hook_log.events == [("attempt", 1), ("attempt failed", 1), ("failed", err)]


async def test_an_empty_try_is_a_protocol_error_too() -> None:
    async def nothing(send: DeltaSink, progress: Progress) -> None:
        pass

    deltas, err = await run_failing(Scripted(nothing), request(trio.current_time() + 5))
    assert isinstance(err, UpstreamProtocolError)
    assert deltas == []


async def test_nothing_may_follow_the_final_delta() -> None:
    async def twice(send: DeltaSink, progress: Progress) -> None:
        await send.send(FINAL)
        await send.send(Delta(text="more"))

    deltas, err = await run_failing(Scripted(twice), request(trio.current_time() + 5))
    assert isinstance(err, UpstreamProtocolError)
    assert "after its final delta" in str(err)
    assert deltas == [msgspec.structs.replace(FINAL, model="m")]


async def test_progress_is_kept_by_send() -> None:
    seen: list[tuple[bool, bool]] = []

    async def watch(send: DeltaSink, progress: Progress) -> None:
        seen.append((progress.started, progress.finished))
        await send.send(Delta(text="a"))
        seen.append((progress.started, progress.finished))
        await send.send(FINAL)
        seen.append((progress.started, progress.finished))

    await run(Scripted(watch), request(trio.current_time() + 5))
    assert seen == [(False, False), (True, False), (True, True)]


async def test_out_of_time_fails_before_any_try(autojump_clock: trio.testing.MockClock) -> None:
    adapter = Scripted(ok)
    for deadline in (trio.current_time(), trio.current_time() - 1):
        deltas, err = await run_failing(adapter, request(deadline))
        assert type(err) is UpstreamTimeout
        assert str(err) == "no inference budget left for the upstream call"
        assert deltas == []
    assert adapter.calls == 0
    # No try was made, but the call failed: counted once per call.
    assert [kind for kind, _ in adapter.hook_log.events] == ["failed", "failed"]


async def test_retries_are_reported_around_each_try(autojump_clock: trio.testing.MockClock) -> None:
    busy = UpstreamStatusError("busy", upstream_status=503)
    refused = UpstreamConnectError("refused")
    adapter = Scripted(failing(busy), failing(refused), ok, policy=RetryPolicy(3, 0.1, 1.0))
    assert await run(adapter, request(trio.current_time() + 10)) == [Delta(text="hi", model="m"), FINAL]
    assert adapter.hook_log.events == [
        ("attempt", 1),
        ("attempt failed", 1),
        ("retrying", busy),
        ("attempt", 2),
        ("attempt failed", 2),
        ("retrying", refused),
        ("attempt", 3),
    ]


async def test_the_error_that_ends_the_call_is_reported_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    errors = [UpstreamConnectError(str(i)) for i in range(3)]
    adapter = Scripted(*map(failing, errors), policy=RetryPolicy(2, 0.1, 1.0))
    _, err = await run_failing(adapter, request(trio.current_time() + 10))
    assert err is errors[2]
    assert adapter.hook_log.retried == errors[:2]
    assert adapter.hook_log.errors == [errors[2]]


async def test_no_retry_once_text_has_been_sent(autojump_clock: trio.testing.MockClock) -> None:
    dropped = UpstreamConnectError("dropped")
    adapter = Scripted(failing(dropped, after_text=True), ok, policy=RetryPolicy(3, 0.1, 1.0))
    deltas, err = await run_failing(adapter, request(trio.current_time() + 10))
    assert err is dropped
    assert deltas == [Delta(text="partial", model="m")]
    assert adapter.calls == 1
    assert adapter.hook_log.retried == []
    assert adapter.hook_log.errors == [dropped]


async def test_prepare_returns_the_request_unchanged_by_default() -> None:
    req = request(1e9)
    assert await Scripted(ok).prepare(req) is req


# --- build_adapter: everything at construction -------------------------------------


def test_build_adapter_gives_every_kind_the_hook_and_its_retry_policy() -> None:
    hook = RecordingHook()
    openai_cfg = OpenAIAdapterConfig(
        base_url="http://x.test/v1", models=["m"], max_retries=4, backoff_base_ms=50, backoff_max_ms=800
    )
    ws_cfg = VllmWsAdapterConfig(
        url="ws://x.test/ws", models=["m"], max_retries=4, backoff_base_ms=50, backoff_max_ms=800
    )
    openai = build_adapter("a", openai_cfg, hook)
    ws = build_adapter("b", ws_cfg, hook)
    mock = build_adapter("c", MockAdapterConfig(), hook)
    for adapter in (openai, ws):
        assert adapter.policy == RetryPolicy(max_retries=4, base=0.05, cap=0.8)
    assert mock.policy == NO_RETRIES
    assert all(a.hook is hook for a in (openai, ws, mock))
    assert [a.name for a in (openai, ws, mock)] == ["a", "b", "c"]


async def test_the_budget_sent_upstream_is_never_shorter_than_the_gateways(autojump_clock):
    # Rounded down, a backend keeping the budget it is told would stop up to 1 ms
    # before the gateway's cut, and the deadline would reach the client as a drop.
    now = trio.current_time()
    assert budget_ms(now + 0.5001) == 501
    assert budget_ms(now - 0.2) == 1  # the clock passed it since the check: still a budget
