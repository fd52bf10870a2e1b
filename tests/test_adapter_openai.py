"""The openai adapter's parts: SSE parsing, retry/backoff on the virtual clock, the
adapter over a fake transport (headers, budget, Retry-After), error translation."""

from __future__ import annotations

import contextlib
import itertools
import json
import random
from collections.abc import AsyncIterator

import httpx2
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from aiserve_trio.adapters.base import Delta, InferenceRequest, Message
from aiserve_trio.adapters.openai import OpenAIAdapter
from aiserve_trio.adapters.retry import Progress, RetryPolicy, is_retryable, run_with_retries
from aiserve_trio.adapters.sse_parser import Event, SSEDecodeError, SSEParser
from aiserve_trio.adapters.transport import ClientPool, parse_retry_after, translate_errors
from aiserve_trio.config import ConfigError, OpenAIAdapterConfig
from aiserve_trio.core.errors import (
    BadRequest,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
)

from .fakes import RecordingHook

# --- SSE parsing -------------------------------------------------------------------

STREAM = (
    b": ping\n\n"
    b'data: {"a": 1}\n\n'
    b"event: note\r\ndata: line one\r\ndata: line two\r\nid: 7\r\n\r\n"
    b"data:no-space\r\r"
    b"data: \xe4\xbd\xa0\xe5\xa5\xbd\n\n"
    b"retry: 10\n\n"
    b"data: [DONE]\n\n"
)
EXPECTED = [
    Event(data='{"a": 1}'),
    Event(data="line one\nline two", event="note", id="7"),
    Event(data="no-space", id="7"),
    Event(data="你好", id="7"),
    Event(data="[DONE]", id="7"),
]


def test_sse_whole_stream() -> None:
    assert SSEParser().feed(STREAM) == EXPECTED


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_sse_any_split_gives_the_same_events(cuts: list[int]) -> None:
    parser = SSEParser()
    points = [0, *sorted(cuts), len(STREAM)]
    events: list[Event] = []
    for a, b in itertools.pairwise(points):
        events += parser.feed(STREAM[a:b])
    assert events == EXPECTED


def test_sse_byte_by_byte() -> None:
    parser = SSEParser()
    events = [e for i in range(len(STREAM)) for e in parser.feed(STREAM[i : i + 1])]
    assert events == EXPECTED


#: What model backends send: every line ends in LF (the parser's fast path).
LF_STREAM = (
    b'data: {"a": 1}\n\n'
    b": ping\n\n"
    b"event: note\ndata: x\ndata:y\nid: 3\n\n"
    b"data: \xe4\xbd\xa0\xe5\xa5\xbd\n\n"
    b"data: [DONE]\n\n"
)
LF_EXPECTED = [
    Event(data='{"a": 1}'),
    Event(data="x\ny", event="note", id="3"),
    Event(data="你好", id="3"),
    Event(data="[DONE]", id="3"),
]


@given(st.lists(st.integers(min_value=0, max_value=len(LF_STREAM)), max_size=12))
def test_sse_lf_stream_any_split_gives_the_same_events(cuts: list[int]) -> None:
    parser = SSEParser()
    points = [0, *sorted(cuts), len(LF_STREAM)]
    events: list[Event] = []
    for a, b in itertools.pairwise(points):
        events += parser.feed(LF_STREAM[a:b])
    assert events == LF_EXPECTED


def test_sse_lf_stream_limits() -> None:
    parser = SSEParser(max_line=10)
    assert parser.feed(b"data: 1\n\ndata: 12") == [Event(data="1")]
    with pytest.raises(SSEDecodeError):
        parser.feed(b"34567")  # the unfinished line passed the limit
    with pytest.raises(SSEDecodeError):
        SSEParser().feed(b"data: ok\n\ndata: \xff\n\n")


def test_sse_incomplete_event_is_held() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: x\n") == []
    assert parser.feed(b"\n") == [Event(data="x")]


def test_sse_refuses_endless_lines_and_bad_utf8() -> None:
    with pytest.raises(SSEDecodeError):
        SSEParser(max_line=10).feed(b"data: " + b"x" * 20)
    with pytest.raises(SSEDecodeError):
        SSEParser().feed(b"data: \xff\n\n")


# --- Retry-After and backoff --------------------------------------------------------


def test_parse_retry_after() -> None:
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(" 0.5 ") == 0.5
    assert parse_retry_after("-4") == 0.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == 10.0
    assert parse_retry_after("soon") is None
    assert parse_retry_after(None) is None
    assert parse_retry_after("nan") is None


def test_full_jitter_stays_under_the_exponential_cap() -> None:
    policy = RetryPolicy(max_retries=5, base=0.1, cap=0.5)
    rng = random.Random(0)
    for retry, bound in [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.5), (6, 0.5)]:
        delays = [policy.delay(retry, None, rng) for _ in range(200)]
        assert max(delays) <= bound
        assert max(delays) > bound * 0.8  # the range is used, not a fixed value
    assert policy.delay(0, 7.0, rng) == 7.0  # Retry-After wins, even above the cap


@pytest.mark.parametrize(
    ("err", "retry"),
    [
        (UpstreamStatusError("x", upstream_status=429), True),
        (UpstreamStatusError("x", upstream_status=503), True),
        (UpstreamStatusError("x", upstream_status=400), False),
        (UpstreamStatusError("x", upstream_status=401), False),
        (UpstreamConnectError("x"), True),
        (UpstreamTimeout("x"), True),
        (UpstreamProtocolError("x"), False),
    ],
)
def test_what_is_retried(err: UpstreamError, retry: bool) -> None:
    assert is_retryable(err) is retry


class Flaky:
    """Fails with the given errors in turn, then succeeds; records when it was called."""

    def __init__(self, *errors: UpstreamError, start_first: bool = False) -> None:
        self.errors = list(errors)
        self.calls: list[float] = []
        self.start_first = start_first

    async def __call__(self, progress: Progress) -> None:
        self.calls.append(trio.current_time())
        if self.start_first:
            progress.started = True
        if self.errors:
            raise self.errors.pop(0)


async def test_backoff_timing_on_the_virtual_clock(autojump_clock: trio.testing.MockClock) -> None:
    policy = RetryPolicy(max_retries=3, base=0.1, cap=2.0)
    rng = random.Random(42)
    expect = random.Random(42)
    waits = [expect.uniform(0, 0.1), expect.uniform(0, 0.2)]
    attempt = Flaky(UpstreamConnectError("a"), UpstreamStatusError("b", upstream_status=502))
    t0 = trio.current_time()
    n = await run_with_retries(attempt, policy=policy, deadline=t0 + 10, rng=rng)
    assert n == 3
    gaps = [b - a for a, b in zip([t0, *attempt.calls], attempt.calls, strict=False)][1:]
    assert gaps == pytest.approx(waits)


async def test_retry_after_is_honoured(autojump_clock: trio.testing.MockClock) -> None:
    attempt = Flaky(UpstreamStatusError("busy", upstream_status=429, retry_after=2.5))
    hook = RecordingHook()
    t0 = trio.current_time()
    await run_with_retries(
        attempt,
        policy=RetryPolicy(2, 0.1, 0.2),
        deadline=t0 + 10,
        rng=random.Random(0),
        adapter="up",
        hook=hook,
    )
    assert attempt.calls[1] - attempt.calls[0] == pytest.approx(2.5)
    assert len(hook.retried) == 1


async def test_no_retry_after_the_first_token(autojump_clock: trio.testing.MockClock) -> None:
    attempt = Flaky(UpstreamConnectError("dropped"), start_first=True)
    with pytest.raises(UpstreamConnectError):
        await run_with_retries(
            attempt,
            policy=RetryPolicy(5, 0.1, 1),
            deadline=trio.current_time() + 10,
            rng=random.Random(0),
        )
    assert len(attempt.calls) == 1


async def test_no_wait_past_the_deadline(autojump_clock: trio.testing.MockClock) -> None:
    attempt = Flaky(UpstreamStatusError("busy", upstream_status=429, retry_after=5))
    t0 = trio.current_time()
    with pytest.raises(UpstreamStatusError):
        await run_with_retries(
            attempt, policy=RetryPolicy(3, 0.1, 1), deadline=t0 + 1, rng=random.Random(0)
        )
    assert trio.current_time() == t0  # failed at once instead of sleeping into the deadline


async def test_retries_run_out(autojump_clock: trio.testing.MockClock) -> None:
    attempt = Flaky(*[UpstreamConnectError(str(i)) for i in range(5)])
    with pytest.raises(UpstreamConnectError, match="2"):
        await run_with_retries(
            attempt,
            policy=RetryPolicy(2, 0.01, 0.01),
            deadline=trio.current_time() + 10,
            rng=random.Random(0),
        )
    assert len(attempt.calls) == 3


# --- the adapter over a fake transport ---------------------------------------------


def sse(*texts: str, finish: str = "stop", done: bool = True) -> bytes:
    out = b""
    for t in texts:
        out += b"data: " + json.dumps({"choices": [{"delta": {"content": t}}]}).encode() + b"\n\n"
    out += (
        b"data: "
        + json.dumps({"choices": [{"delta": {}, "finish_reason": finish}]}).encode()
        + b"\n\n"
    )
    out += b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}\n\n'
    return out + (b"data: [DONE]\n\n" if done else b"")


def config(**kw: object) -> OpenAIAdapterConfig:
    base = {"base_url": "http://upstream.test/v1", "models": ["gpt-4o"], "backoff_base_ms": 100}
    return OpenAIAdapterConfig(**{**base, **kw})  # type: ignore[arg-type]


def request(deadline: float, **kw: object) -> InferenceRequest:
    return InferenceRequest(
        request_id="req-1",
        model="gpt-4o",
        messages=[Message(role="user", content="hi")],
        deadline=deadline,
        forward_headers={"traceparent": "00-abc-def-01"},
        **kw,  # type: ignore[arg-type]
    )


async def collect(adapter: OpenAIAdapter, req: InferenceRequest) -> list[Delta]:
    send, recv = trio.open_memory_channel[Delta](100)
    async with send:
        await adapter.stream(req, send)
    return [d async for d in recv]


@contextlib.asynccontextmanager
async def opened(adapter: OpenAIAdapter) -> AsyncIterator[OpenAIAdapter]:
    """The adapter with its pool open (as the app's lifespan does), closed at the end."""
    async with trio.open_nursery() as nursery:
        await adapter.aopen(nursery)
        try:
            yield adapter
        finally:
            await adapter.aclose()


async def test_adapter_streams_and_sends_budget_and_headers(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SECRET_KEY_FOR_TEST", "sk-test-123")
    seen: list[httpx2.Request] = []

    def handler(req: httpx2.Request) -> httpx2.Response:
        seen.append(req)
        return httpx2.Response(200, content=sse("Hel", "lo"))

    adapter = OpenAIAdapter(
        "up",
        config(api_key_env="SECRET_KEY_FOR_TEST", upstream_model="gpt-4o-2024"),
        transport=httpx2.MockTransport(handler),
    )
    async with opened(adapter):
        deltas = await collect(adapter, request(trio.current_time() + 2.0, max_tokens=10))
    # Both events came in one read, so they go on as one delta.
    assert [d.text for d in deltas] == ["Hello", ""]
    assert deltas[-1].finish_reason == "stop"
    assert deltas[-1].usage is not None
    assert deltas[-1].usage.completion_tokens == 2
    (req,) = seen
    assert str(req.url) == "http://upstream.test/v1/chat/completions"
    assert req.headers["authorization"] == "Bearer sk-test-123"
    assert req.headers["x-request-id"] == "req-1"
    assert req.headers["traceparent"] == "00-abc-def-01"
    assert int(req.headers["x-request-timeout-ms"]) == 2000
    timeouts = req.extensions["timeout"]
    assert max(v for v in timeouts.values() if v is not None) <= 2.0
    body = json.loads(req.content)
    assert body["model"] == "gpt-4o-2024"
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 10


async def test_adapter_retries_429_with_retry_after_then_streams(
    autojump_clock: trio.testing.MockClock,
) -> None:
    calls: list[float] = []

    def handler(req: httpx2.Request) -> httpx2.Response:
        calls.append(trio.current_time())
        if len(calls) == 1:
            return httpx2.Response(429, headers={"Retry-After": "2"}, content=b'{"error": {}}')
        return httpx2.Response(200, content=sse("ok"))

    hook = RecordingHook()
    adapter = OpenAIAdapter("up", config(), hook=hook, transport=httpx2.MockTransport(handler))
    async with opened(adapter):
        deltas = await collect(adapter, request(trio.current_time() + 10))
    assert [d.text for d in deltas if d.text] == ["ok"]
    assert calls[1] - calls[0] == pytest.approx(2.0)
    assert len(hook.retried) == 1


async def test_adapter_missing_done_is_a_protocol_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    def handler(req: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, content=sse("a", done=False))

    hook = RecordingHook()
    adapter = OpenAIAdapter("up", config(), hook=hook, transport=httpx2.MockTransport(handler))
    async with opened(adapter):
        with pytest.raises(UpstreamProtocolError, match="without \\[DONE\\]"):
            await collect(adapter, request(trio.current_time() + 10))
    assert len(hook.errors) == 1


async def test_adapter_needs_its_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    adapter = OpenAIAdapter("up", config(api_key_env="NO_SUCH_KEY_VAR"))
    async with trio.open_nursery() as nursery:
        with pytest.raises(ConfigError, match="NO_SUCH_KEY_VAR"):
            await adapter.aopen(nursery)


@pytest.mark.parametrize(
    ("exc", "ours"),
    [
        (httpx2.ConnectError("refused"), UpstreamConnectError),
        (httpx2.ConnectTimeout("slow"), UpstreamTimeout),
        (httpx2.ReadTimeout("slow"), UpstreamTimeout),
        (httpx2.ReadError("reset"), UpstreamConnectError),
        (httpx2.RemoteProtocolError("incomplete chunked read"), UpstreamProtocolError),
        (SSEDecodeError("bad"), UpstreamProtocolError),
        (httpx2.TooManyRedirects("loop"), UpstreamError),
    ],
)
def test_translate_errors(exc: Exception, ours: type[UpstreamError]) -> None:
    with pytest.raises(ours) as info, translate_errors("up"):
        raise exc
    assert type(info.value) is ours
    assert info.value.__cause__ is exc


async def test_without_upstream_usage_the_prompt_is_counted_here(
    autojump_clock: trio.testing.MockClock,
) -> None:
    no_usage = b'data: {"choices": [{"delta": {"content": "ok"}, "finish_reason": "stop"}]}\n\n'
    adapter = OpenAIAdapter(
        "up",
        config(),
        transport=httpx2.MockTransport(
            lambda req: httpx2.Response(200, content=no_usage + b"data: [DONE]\n\n")
        ),
    )
    async with opened(adapter):
        deltas = await collect(adapter, request(trio.current_time() + 2.0))
    usage = deltas[-1].usage
    assert usage is not None
    # o200k (gpt-4o): 3 framing + "user" + "hi" + 3 priming.
    assert (usage.prompt_tokens, usage.completion_tokens) == (8, 1)


# --- the client pool -------------------------------------------------------------


def test_client_pool_fills_the_first_client_with_room_before_opening_another() -> None:
    made: list[httpx2.AsyncClient] = []

    def make() -> httpx2.AsyncClient:
        made.append(httpx2.AsyncClient())
        return made[-1]

    pool = ClientPool(make, per_client=2, max_streams=5)  # at most 3 clients
    with contextlib.ExitStack() as held:
        got = [held.enter_context(pool.lease()) for _ in range(5)]
        assert got == [made[0], made[0], made[1], made[1], made[2]]
        # All full and no more clients allowed: the least loaded one takes it.
        assert held.enter_context(pool.lease()) is made[2]
    # Freed slots are reused first, by the first client.
    with pool.lease() as c:
        assert c is made[0]
    assert len(made) == 3


async def test_prepare_fits_the_window_and_its_count_becomes_the_usage(
    autojump_clock: trio.testing.MockClock,
) -> None:
    calls: list[httpx2.Request] = []
    no_usage = b'data: {"choices": [{"delta": {"content": "ok"}, "finish_reason": "stop"}]}\n\n'

    def handler(req: httpx2.Request) -> httpx2.Response:
        calls.append(req)
        return httpx2.Response(200, content=no_usage + b"data: [DONE]\n\n")

    adapter = OpenAIAdapter(
        "up", config(context_window=300), transport=httpx2.MockTransport(handler)
    )
    history = [
        Message(role="user" if i % 2 == 0 else "assistant", content="tell me more " * 10)
        for i in range(12)
    ]
    req = InferenceRequest(
        request_id="req-1",
        model="gpt-4o",
        messages=[*history, Message(role="user", content="and?")],
        deadline=trio.current_time() + 2.0,
        max_tokens=20,
    )
    prepared = await adapter.prepare(req)
    assert prepared.trimmed > 0
    assert prepared.prompt_tokens is not None
    assert (req.trimmed, req.prompt_tokens, len(req.messages)) == (0, None, 13)
    async with opened(adapter):
        deltas = await collect(adapter, prepared)
    usage = deltas[-1].usage
    assert usage is not None
    assert usage.prompt_tokens == prepared.prompt_tokens  # counted once, while fitting
    assert len(json.loads(calls[0].content)["messages"]) == len(prepared.messages)
    # A prompt that cannot fit is refused before any upstream call.
    with pytest.raises(BadRequest) as info:
        await adapter.prepare(request(trio.current_time() + 2.0, max_tokens=299))
    assert info.value.code == "context_length_exceeded"
    assert len(calls) == 1
