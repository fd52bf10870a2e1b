"""Deployment groups on Trio's virtual clock, with fake members: failover, fallbacks
inside the deadline, the too-slow cut-off, hedging, ejection and probing, who served,
and the group through the app (headers, /v1/models, /metrics)."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from aiserve_trio.adapters import build_adapters
from aiserve_trio.adapters.base import (
    Adapter,
    Capabilities,
    Delta,
    DeltaSink,
    InferenceRequest,
    Message,
    Usage,
)
from aiserve_trio.adapters.group import GroupAdapter, Member, carries
from aiserve_trio.adapters.health import State
from aiserve_trio.adapters.retry import Progress
from aiserve_trio.adapters.sidecalls import SIDE_CALLS, SideCalls
from aiserve_trio.config import ConfigError, GroupAdapterConfig, GroupDeployment
from aiserve_trio.core.errors import (
    BadRequest,
    NoFallbackFits,
    NoHealthyDeployment,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
)
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client, chat_body
from .conftest import make_config
from .fakes import RecordingHook


@dataclass
class Script:
    """What a fake member does on each try (the last entry repeats)."""

    #: Seconds to the first token; None: fail before any token.
    ttft: float | None = 0.05
    tokens: int = 3
    gap: float = 0.01
    #: Raised before the first token when ttft is None, or after ``fail_after`` tokens.
    error: UpstreamError = field(default_factory=lambda: UpstreamConnectError("down"))
    fail_after: int | None = None
    #: Seconds before a failure before the first token (a slow refusal).
    fail_delay: float = 0.0
    #: Stream a token every ``gap`` after the first, then break off with ``error`` as
    #: the deadline passes (a backend keeping the budget it was sent), seen before the
    #: deadline's cancel: this clock jumps past it with no checkpoint.
    keeps_budget: trio.testing.MockClock | None = None


class Fake(Adapter):
    """A member whose tries follow scripts; records what it was asked and when."""

    def __init__(self, name: str, *scripts: Script, models: list[str] | None = None) -> None:
        super().__init__(name, models or ["m"])
        self.scripts = list(scripts) or [Script()]
        self.calls: list[tuple[float, InferenceRequest]] = []
        self.cancelled = 0
        self.probe_ok = True
        self.trim = 0

    async def prepare(self, request: InferenceRequest) -> InferenceRequest:
        if self.trim < 0:
            raise BadRequest(f"{self.name}: too long", code="context_length_exceeded")
        if self.trim:
            return msgspec.structs.replace(request, trimmed=self.trim)
        return request

    async def probe(self) -> bool:
        return self.probe_ok

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        script = self.scripts[min(len(self.calls), len(self.scripts) - 1)]
        self.calls.append((trio.current_time(), request))
        try:
            if script.ttft is None:
                await trio.sleep(script.fail_delay)
                raise script.error
            await trio.sleep(script.ttft)
            for i in range(script.tokens):
                if script.fail_after is not None and i == script.fail_after:
                    raise script.error
                if i:
                    await trio.sleep(script.gap)
                await send.send(Delta(text=f"{self.name}{i} "))
                if script.keeps_budget is not None:
                    # Still generating (a token every gap) when the budget runs out.
                    while trio.current_time() + script.gap < request.deadline - 0.001:
                        await trio.sleep(script.gap)
                        await send.send(Delta(text="."))
                    await trio.sleep_until(request.deadline - 0.001)
                    script.keeps_budget.jump(0.002)
                    raise script.error
            await send.send(
                Delta(finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=1))
            )
        except trio.Cancelled:
            self.cancelled += 1
            raise


def group(
    *deployments: Fake,
    fallbacks: tuple[Fake | GroupAdapter, ...] = (),
    hook: RecordingHook | None = None,
    priors: dict[str, float] | None = None,
    **settings: Any,
) -> GroupAdapter:
    cfg = GroupAdapterConfig(
        models=["m"],
        deployments=[GroupDeployment(adapter=d.name) for d in deployments],
        fallbacks=[f.name for f in fallbacks],
        **settings,
    )
    prior = priors or {}
    members = [Member(d, 0, 1.0, prior.get(d.name, 0.1)) for d in deployments]
    members += [Member(f, i, 1.0, prior.get(f.name, 0.1)) for i, f in enumerate(fallbacks, 1)]
    return GroupAdapter("g", cfg, members, hook=hook or RecordingHook(), rng=random.Random(3))


def request(budget: float, model: str = "m") -> InferenceRequest:
    return InferenceRequest(
        request_id="r1",
        model=model,
        messages=[Message(role="user", content="hi")],
        deadline=trio.current_time() + budget,
    )


async def serve(g: Adapter, budget: float = 1.0, **kw: Any) -> tuple[list[Delta], float]:
    """The deltas of one request, and how long it took (virtual seconds)."""
    t0 = trio.current_time()
    send, recv = trio.open_memory_channel[Delta](100)
    async with send:
        await g.stream(request(budget, **kw), send)
    return [d async for d in recv], trio.current_time() - t0


async def refused(g: Adapter, budget: float = 1.0) -> tuple[UpstreamError, float]:
    t0 = trio.current_time()
    send, _recv = trio.open_memory_channel[Delta](100)
    with pytest.raises(UpstreamError) as info:
        async with send:
            await g.stream(request(budget), send)
    return info.value, trio.current_time() - t0


def text(deltas: list[Delta]) -> str:
    return "".join(d.text for d in deltas)


# --- failover and fallbacks --------------------------------------------------------------


async def test_a_failed_try_moves_to_the_next_deployment(autojump_clock: Any) -> None:
    hook = RecordingHook()
    a, b = Fake("a", Script(ttft=None)), Fake("b")
    g = group(a, b, hook=hook, balance="weighted")
    g.rng = random.Random(0)
    served = set()
    for _ in range(6):
        deltas, _ = await serve(g)
        assert deltas[0].served is not None
        assert deltas[-1].finish_reason == "stop"
        assert text(deltas) == "b0 b1 b2 "
        served.add(deltas[0].served.deployment)
        assert deltas[0].served.fallback == 0
        assert all(d.served is None for d in deltas[1:])
    assert served == {"b"}
    assert a.calls  # it was tried, and failed over each time
    # Each try was reported once, under the deployment's name (never the group's).
    assert hook.adapters == {"a", "b"}
    assert all(isinstance(e, UpstreamConnectError) for e in hook.errors)


async def test_every_deployment_down_the_fallback_serves(autojump_clock: Any) -> None:
    a, b = Fake("a", Script(ttft=None)), Fake("b", Script(ttft=None))
    sorry = Fake("sorry", models=["small"])
    g = group(a, b, fallbacks=(sorry,))
    deltas, _ = await serve(g)
    assert text(deltas) == "sorry0 sorry1 sorry2 "
    assert deltas[0].served is not None
    assert (deltas[0].served.deployment, deltas[0].served.fallback) == ("sorry", 1)
    # The fallback serves another model: it is asked for its own.
    assert sorry.calls[0][1].model == "small"
    assert a.calls[0][1].model == "m"


async def test_a_fallback_never_starts_when_the_budget_cannot_fit_it(autojump_clock: Any) -> None:
    # The deployment fails slowly, at 0.8 s of a 1 s budget; the fallback expects 0.5 s.
    # a's own P95 (600 ms) is not over when the fallback's room would run out (at
    # 500 ms): the request committed to a, so the fallback no longer fits.
    a = Fake("a", Script(ttft=None, fail_delay=0.8))
    sorry = Fake("sorry")
    g = group(a, fallbacks=(sorry,), priors={"a": 0.6, "sorry": 0.5})
    err, took = await refused(g, budget=1.0)
    assert isinstance(err, NoFallbackFits)
    assert (err.status, err.type, err.code) == (504, "timeout", "no_fallback_fits")
    assert "no fallback fits the remaining budget: 200 ms left" in err.message
    assert "sorry expects 500 ms" in err.message
    assert "a: down" in err.message
    assert sorry.calls == []
    assert took == pytest.approx(0.8)  # at once, not at the deadline


async def test_the_last_error_when_every_candidate_was_tried(autojump_clock: Any) -> None:
    a = Fake("a", Script(ttft=None, error=UpstreamStatusError("a: 503", upstream_status=503)))
    b = Fake("b", Script(ttft=None))
    err, _ = await refused(group(a, b, balance="lowest_ttft", priors={"b": 0.2}))
    assert isinstance(err, UpstreamConnectError)


async def test_after_the_first_token_nothing_moves(autojump_clock: Any) -> None:
    a = Fake("a", Script(fail_after=2))
    b = Fake("b")
    g = group(a, b, priors={"b": 0.2}, balance="lowest_ttft")
    send, recv = trio.open_memory_channel[Delta](100)
    with pytest.raises(UpstreamConnectError):
        async with send:
            await g.stream(request(1.0), send)
    got = [d async for d in recv]
    assert text(got) == "a0 a1 "
    assert b.calls == []


async def test_a_slow_failure_is_cut_while_the_fallback_still_fits(autojump_clock: Any) -> None:
    # Same failure, but a is overdue (P95 100 ms) long before the fallback's room runs out.
    a = Fake("a", Script(ttft=None, fail_delay=0.8))
    sorry = Fake("sorry")
    g = group(a, fallbacks=(sorry,), priors={"a": 0.1, "sorry": 0.5})
    deltas, took = await serve(g, budget=1.0)
    assert text(deltas) == "sorry0 sorry1 sorry2 "
    assert sorry.calls[0][0] - a.calls[0][0] == pytest.approx(0.5)
    assert took < 1.0


async def test_a_too_slow_try_is_cut_while_the_next_still_fits(autojump_clock: Any) -> None:
    # a would answer after 5 s; b expects 0.1 s: a gets until deadline - 0.1 s.
    a, b = Fake("a", Script(ttft=5.0)), Fake("b")
    g = group(a, b, balance="lowest_ttft", priors={"a": 0.05, "b": 0.1})
    deltas, took = await serve(g, budget=1.0)
    assert text(deltas) == "b0 b1 b2 "
    assert a.cancelled == 1
    assert b.calls[0][0] == pytest.approx(a.calls[0][0] + 0.9)
    assert took <= 1.0
    # The cut counts as a timeout of a, with what it waited as a lower bound of its TTFT.
    stats = g.health.window("a").stats(trio.current_time())
    assert (stats.timeouts, stats.errors) == (1, 0)
    assert g.health.expected_ttft("a") > 0.05


async def test_the_cut_leaves_the_next_one_its_usual_reply(autojump_clock: Any) -> None:
    # b begins in 100 ms but its replies take 300 ms: a is given up 300 ms before
    # the deadline, so that b's answer ends in time rather than being cut.
    a, b = Fake("a", Script(ttft=5.0)), Fake("b", Script(ttft=0.1, tokens=11, gap=0.02))
    g = group(a, b, balance="lowest_ttft", priors={"a": 0.05, "b": 0.1})
    g.health.window("b").expected_reply = 0.3
    deltas, took = await serve(g, budget=1.0)
    assert deltas[-1].finish_reason == "stop"
    assert b.calls[0][0] - a.calls[0][0] == pytest.approx(0.7)
    assert took == pytest.approx(0.7 + 0.1 + 10 * 0.02)


async def test_a_deployment_that_cannot_fit_is_skipped(autojump_clock: Any) -> None:
    a, b = Fake("a"), Fake("b")
    g = group(a, b, balance="lowest_ttft", priors={"a": 0.01, "b": 0.1})
    g.health.window("a").expected_ttft = 2.0  # learned: a is slow
    deltas, _ = await serve(g, budget=1.0)
    assert text(deltas) == "b0 b1 b2 "
    assert a.calls == []


async def test_the_members_prepare_applies_to_the_member_that_serves(autojump_clock: Any) -> None:
    a, b = Fake("a"), Fake("b")
    a.trim = -1  # its window cannot take the prompt
    b.trim = 2
    deltas, _ = await serve(group(a, b, balance="lowest_ttft", priors={"b": 0.2}))
    assert deltas[0].served is not None
    assert (deltas[0].served.deployment, deltas[0].served.trimmed) == ("b", 2)
    assert a.calls == []
    b.trim = -1
    send, _recv = trio.open_memory_channel[Delta](10)
    with pytest.raises(BadRequest):
        async with send:
            await group(a, b).stream(request(1.0), send)


def test_a_fallback_that_carries_less_is_skipped() -> None:
    text_only = Capabilities(fields=frozenset({"temperature"}), parts=frozenset({"text"}))
    req = InferenceRequest(
        request_id="r", model="m", messages=[Message(role="user", content="hi")], deadline=1.0
    )
    assert carries(text_only, req)
    assert not carries(text_only, msgspec.structs.replace(req, extra={"tools": msgspec.Raw(b"[]")}))


# --- hedging -------------------------------------------------------------------------------


async def test_hedge_after_the_p95_the_first_token_wins(autojump_clock: Any) -> None:
    hook = RecordingHook()
    a, b = Fake("a", Script(ttft=2.0)), Fake("b", Script(ttft=0.1))
    g = group(a, b, hook=hook, hedge=True, balance="lowest_ttft", priors={"a": 0.2, "b": 0.3})
    for t in (0.05, 0.1, 0.2):  # a's recent TTFTs: P95 200 ms
        g.health.record("a", 0.0, True, t)
    g.health.window("a").expected_ttft = 0.2
    deltas, took = await serve(g, budget=3.0)
    assert text(deltas) == "b0 b1 b2 "  # only the winner's deltas
    assert deltas[0].served is not None
    assert deltas[0].served.deployment == "b"
    assert b.calls[0][0] - a.calls[0][0] == pytest.approx(0.2)  # hedged at a's P95
    assert a.cancelled == 1  # the loser, cancelled
    assert took == pytest.approx(0.2 + 0.1 + 0.02)
    # The loser is not held against a: cancelled is not failed.
    assert g.health.window("a").stats(trio.current_time()).consecutive_failures == 0
    assert [e for e in hook.events if e[0] == "attempt"] == [("attempt", 1), ("attempt", 2)]


async def test_hedge_loser_after_its_own_first_token_is_cancelled(autojump_clock: Any) -> None:
    # a answers at 0.35, b (hedged at 0.2) at 0.3: b wins, a's token never reaches the client.
    a, b = Fake("a", Script(ttft=0.35)), Fake("b", Script(ttft=0.1))
    g = group(a, b, hedge=True, balance="lowest_ttft", priors={"a": 0.2, "b": 0.3})
    deltas, _ = await serve(g, budget=3.0)
    assert text(deltas) == "b0 b1 b2 "
    assert a.cancelled == 1


async def test_no_hedge_when_the_first_token_comes_in_time(autojump_clock: Any) -> None:
    a, b = Fake("a", Script(ttft=0.1)), Fake("b")
    g = group(a, b, hedge=True, balance="lowest_ttft", priors={"a": 0.2, "b": 0.3})
    deltas, _ = await serve(g, budget=3.0)
    assert text(deltas) == "a0 a1 a2 "
    assert b.calls == []


async def test_a_hedge_that_fails_leaves_the_first_try_running(autojump_clock: Any) -> None:
    a, b = Fake("a", Script(ttft=0.5)), Fake("b", Script(ttft=None))
    g = group(a, b, hedge=True, balance="lowest_ttft", priors={"a": 0.2, "b": 0.3})
    deltas, _ = await serve(g, budget=3.0)
    assert text(deltas) == "a0 a1 a2 "
    assert len(b.calls) == 1


async def test_one_hedge_per_request(autojump_clock: Any) -> None:
    # The hedge fails at once; the first try goes on alone, and no third one starts
    # until it ends.
    a, b, c = Fake("a", Script(ttft=1.0)), Fake("b", Script(ttft=None)), Fake("c")
    g = group(a, b, c, hedge=True, balance="lowest_ttft", priors={"a": 0.2, "b": 0.3, "c": 0.4})
    deltas, _ = await serve(g, budget=3.0)
    assert text(deltas) == "a0 a1 a2 "
    assert (len(b.calls), len(c.calls)) == (1, 0)


# --- health on the clock ---------------------------------------------------------------------


async def test_a_failing_deployment_is_ejected_then_probed(autojump_clock: Any) -> None:
    a = Fake("a", Script(ttft=None))
    b = Fake("b")
    g = group(a, b, consecutive_failures=2, base_ejection_ms=5000, balance="lowest_ttft",
              priors={"a": 0.05, "b": 0.1})  # fmt: skip
    for _ in range(5):
        await serve(g)
    assert len(a.calls) == 2  # ejected after two failures in a row
    assert dict(g.states(trio.current_time()))["a"] == State.EJECTED
    await trio.sleep(5.0)
    assert dict(g.states(trio.current_time()))["a"] == State.PROBING
    a.scripts = [Script()]  # it came back
    deltas, _ = await serve(g)
    assert text(deltas) == "a0 a1 a2 "  # the one trial request
    assert dict(g.states(trio.current_time()))["a"] == State.HEALTHY


async def test_a_deployment_keeping_the_budget_it_was_sent_is_not_ejected(
    autojump_clock: Any,
) -> None:
    # Its reply broken off as the deadline passes is the deadline's doing, judged as
    # the gateway's own cut at the deadline would be -- not a failure, whichever of
    # the two the busy loop saw first.
    drop = UpstreamProtocolError("closed before the end")
    a = Fake("a", Script(error=drop, keeps_budget=autojump_clock))
    g = group(a, Fake("b"), consecutive_failures=1, balance="lowest_ttft",
              priors={"a": 0.05, "b": 0.1})  # fmt: skip
    for _ in range(3):
        err, _ = await refused(g)
        assert err is drop
    assert dict(g.states(trio.current_time()))["a"] == State.HEALTHY
    assert len(a.calls) == 3
    a.scripts = [Script(error=drop, fail_after=1)]  # a real drop, before the deadline
    await refused(g)
    assert dict(g.states(trio.current_time()))["a"] == State.EJECTED


# --- after the first token: stalls (issue 55, item 4) -----------------------------------------

#: A hung worker: its first token at 50 ms, then nothing for 100 s.
HUNG = Script(tokens=2, gap=100.0)


async def test_a_reply_that_stalls_after_its_first_token_is_cut_and_ejects(
    autojump_clock: Any,
) -> None:
    a, b = Fake("a", HUNG), Fake("b")
    g = group(a, b, consecutive_failures=2, balance="lowest_ttft", priors={"a": 0.05, "b": 0.1})
    for _ in range(2):
        err, took = await refused(g, budget=10.0)
        assert isinstance(err, UpstreamTimeout)
        assert "a: stalled, no token for 2000 ms after the first" in err.message
        assert took == pytest.approx(0.05 + 2.0)  # the stall watch (stall_ms), not the deadline
    now = trio.current_time()
    assert dict(g.states(now))["a"] == State.EJECTED
    stats = g.health.window("a").stats(now)
    assert (stats.stalls, stats.timeouts, stats.errors) == (2, 2, 0)
    assert stats.ttft_p95 == pytest.approx(0.05)  # its first tokens were real
    deltas, _ = await serve(g, budget=10.0)
    assert text(deltas) == "b0 b1 b2 "


async def cut_at_deadline(g: GroupAdapter, budget: float, leaves: float | None = None) -> None:
    """One request whose stage cut (or whose client, at ``leaves``) cancels it."""
    send, _recv = trio.open_memory_channel[Delta](10_000)
    with trio.move_on_after(budget if leaves is None else leaves):
        async with send:
            await g.stream(request(budget), send)


async def test_a_try_cut_by_the_deadline_is_judged_by_its_backends_silence(
    autojump_clock: Any,
) -> None:
    # The stall watch is longer than the budget: the deadline's cut judges.
    a = Fake("a", Script(tokens=1000, gap=0.01))  # still flowing at the cut
    g = group(a, Fake("b"), consecutive_failures=1, stall_ms=60_000, balance="lowest_ttft",
              priors={"a": 0.05, "b": 0.1})  # fmt: skip
    await cut_at_deadline(g, 1.0)
    now = trio.current_time()
    assert dict(g.states(now))["a"] == State.HEALTHY
    assert g.health.window("a").stats(now).requests == 0  # the budget's doing: no verdict
    a.scripts = [HUNG]
    await cut_at_deadline(g, 1.0, leaves=0.9)  # the client left: not a's doing either
    assert g.health.window("a").stats(trio.current_time()).requests == 0
    await cut_at_deadline(g, 1.0)  # silent 950 ms of the 950 since its first token
    now = trio.current_time()
    assert dict(g.states(now))["a"] == State.EJECTED
    assert g.health.window("a").stats(now).stalls == 1


async def test_a_slow_client_is_not_a_stalled_backend(autojump_clock: Any) -> None:
    a = Fake("a", Script(tokens=3, gap=0.01))
    g = group(a, consecutive_failures=1, max_ejected_percent=100)
    send, recv = trio.open_memory_channel[Delta](0)
    got: list[Delta] = []

    async def reader() -> None:
        async for d in recv:
            got.append(d)
            await trio.sleep(3.0)  # takes each delta 3 s after the last: past stall_ms

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        async with send:
            await g.stream(request(30.0), send)
    assert text(got) == "a0 a1 a2 "
    stats = g.health.window("a").stats(trio.current_time())
    assert (stats.requests, stats.stalls, stats.consecutive_failures) == (1, 0, 0)


async def test_timeouts_do_not_push_a_deployments_cut_off_later(autojump_clock: Any) -> None:
    # a streams at a byte a second: no token for 100 s. Its try in a 3 s request is cut
    # after 2.9 s; had that wait become its P95, its next try in a 1 s request would be
    # "not overdue" until 2.9 s, past the time b needs: the request would commit to a
    # and die at the deadline. A timeout is no latency sample: it is cut where b fits.
    a, b = Fake("a", Script(ttft=100.0)), Fake("b")
    g = group(a, b, consecutive_failures=1000, min_requests=1000, priors={"a": 0.1, "b": 0.1})
    served = []
    for budget in (3.0, 1.0, 1.0, 1.0):
        send, recv = trio.open_memory_channel[Delta](100)
        with trio.move_on_after(budget):  # the stage's cut
            async with send:
                await g.stream(request(budget), send)
        deltas = [d async for d in recv]
        served.append(deltas[0].served.deployment if deltas and deltas[0].served else None)
    assert served == ["b"] * 4
    assert len(a.calls) == 2  # first in its turns, and cut in time both times
    assert g.health.window("a").ttft_p95(trio.current_time()) == pytest.approx(0.1)


@pytest.mark.parametrize(
    "script",
    [Script(ttft=100.0), HUNG],
    ids=["a byte a second (no token for 100 s)", "first token then nothing"],
)
async def test_the_completion_probe_keeps_out_what_lists_its_models_but_does_not_stream(
    autojump_clock: Any, script: Script
) -> None:
    a, b = Fake("a", script), Fake("b")  # a.probe_ok: GET /v1/models answers at once
    g = group(a, b, probe_interval_ms=1000, consecutive_failures=2, base_ejection_ms=2000)
    seen = []
    async with trio.open_nursery() as nursery:
        await g.aopen(nursery)
        for _ in range(40):
            await trio.sleep(0.5)
            seen.append(dict(g.states(trio.current_time())))
        await g.aclose()
    a_seen = [s["a"] for s in seen]
    out = a_seen.index(State.EJECTED)
    # Probes at 1 s and 3 s, each timed out after probe_timeout_ms: out at 4 s
    # (seen by the sample at 4 s or the next, as the two wake-ups fall).
    assert 4.0 <= out * 0.5 + 0.5 <= 4.5
    assert State.HEALTHY not in a_seen[out:]  # every probe after a cool-down fails it again
    assert all(s["b"] == State.HEALTHY for s in seen)  # b finishes its token in time
    assert a.calls
    assert all(r.max_tokens == 2 for _, r in a.calls + b.calls)


async def test_it_stays_out_longer_while_it_keeps_failing(autojump_clock: Any) -> None:
    a, b = Fake("a", Script(ttft=None)), Fake("b")
    g = group(a, b, consecutive_failures=1, base_ejection_ms=1000, balance="lowest_ttft",
              priors={"a": 0.05, "b": 0.1})  # fmt: skip
    seen = []
    for _ in range(40):
        await serve(g)
        seen.append(len(a.calls))
        await trio.sleep(0.25)
    tried_at = [i for i in range(1, len(seen)) if seen[i] > seen[i - 1]]
    gaps = [j - i for i, j in itertools.pairwise(tried_at)]
    # Out for 1 s, then 2 s, then 3 s...: the trials come further apart.
    assert gaps == sorted(gaps)
    assert gaps[-1] > gaps[0]


async def test_active_probe_ejects_and_readmits(autojump_clock: Any) -> None:
    a, b = Fake("a"), Fake("b")
    g = group(a, b, probe_interval_ms=1000, consecutive_failures=2, base_ejection_ms=2000,
              probe="models")  # fmt: skip
    async with trio.open_nursery() as nursery:
        await g.aopen(nursery)
        a.probe_ok = False
        await trio.sleep(2.5)
        assert dict(g.states(trio.current_time()))["a"] == State.EJECTED
        a.probe_ok = True
        await trio.sleep(2.0)
        assert dict(g.states(trio.current_time()))["a"] == State.HEALTHY
        assert a.calls == []  # probes only, no request
        await g.aclose()  # ends the probe: the nursery can close


async def test_a_cancelled_trial_lets_the_next_request_try(autojump_clock: Any) -> None:
    a, b = Fake("a", Script(ttft=None)), Fake("b")
    g = group(a, b, consecutive_failures=1, balance="lowest_ttft", priors={"a": 0.05, "b": 0.1})
    await serve(g)
    await trio.sleep(5.0)
    a.scripts = [Script(ttft=2.0)]
    with trio.move_on_after(0.5):  # the client leaves during a's trial
        await serve(g, budget=10.0)
    assert len(a.calls) == 2
    a.scripts = [Script()]
    deltas, _ = await serve(g)
    assert text(deltas) == "a0 a1 a2 "  # a new trial, not "trial still out"


async def test_a_fallback_that_cannot_carry_the_request_is_skipped(autojump_clock: Any) -> None:
    a = Fake("a", Script(ttft=None))
    plain = Fake("plain")
    plain.capabilities = Capabilities(fields=frozenset(), parts=frozenset({"text"}))
    last = Fake("last")
    g = group(a, fallbacks=(plain, last))
    req = msgspec.structs.replace(request(1.0), extra={"tools": msgspec.Raw(b"[]")})
    send, recv = trio.open_memory_channel[Delta](100)
    async with send:
        await g.stream(req, send)
    assert text([d async for d in recv]) == "last0 last1 last2 "
    assert plain.calls == []


async def test_nothing_available_is_a_503(autojump_clock: Any) -> None:
    a = Fake("a", Script(ttft=None))
    g = group(a, consecutive_failures=1, max_ejected_percent=100)
    await refused(g)
    err, _ = await refused(g)
    assert isinstance(err, NoHealthyDeployment)
    assert (err.status, err.code) == (503, "no_healthy_deployment")
    assert not await g.ready()


async def test_a_cancelled_request_leaves_nothing_outstanding(autojump_clock: Any) -> None:
    a = Fake("a", Script(ttft=5.0))
    g = group(a)
    with trio.move_on_after(0.5):
        await serve(g, budget=10.0)
    assert g.outstanding == {"a": 0}
    assert a.cancelled == 1
    assert g.health.window("a").stats(trio.current_time()).requests == 0


async def test_a_group_as_a_fallback_keeps_its_leaf_name(autojump_clock: Any) -> None:
    inner = group(Fake("c"))
    inner.name = "small"
    a = Fake("a", Script(ttft=None))
    deltas, _ = await serve(group(a, fallbacks=(inner,)))
    assert deltas[0].served is not None
    assert (deltas[0].served.deployment, deltas[0].served.fallback) == ("c", 1)


# --- configuration ---------------------------------------------------------------------------

GROUP_TOML = """
[adapters.a]
kind = "mock"
ttft_ms = 10
[adapters.b]
kind = "mock"
ttft_ms = 10
[adapters.sorry]
kind = "mock"
models = ["sorry-model"]
ttft_ms = 5
default_reply = "Sorry, please try again in a minute."
[adapters.pool]
kind = "group"
models = ["pooled"]
deployments = [{ adapter = "a", weight = 2 }, { adapter = "b" }]
fallbacks = ["sorry"]

[[routes]]
path = "/v1/pool"
name = "pool"
adapter = "pool"
default_model = "pooled"
"""


@pytest.mark.parametrize(
    ("change", "key", "why"),
    [
        (('{ adapter = "b" }]', '{ adapter = "nope" }]'), "adapters.pool.deployments[1].adapter", "unknown adapter 'nope'"),
        (('fallbacks = ["sorry"]', 'fallbacks = ["pool"]'), "adapters.pool.fallbacks", "loop"),
        (('fallbacks = ["sorry"]', 'fallbacks = ["a"]'), "adapters.pool.deployments", "more than once"),
        (('{ adapter = "b" }]', '{ adapter = "b", weight = 0 }]'), "weight", "positive"),
        (('deployments = [{ adapter = "a", weight = 2 }, { adapter = "b" }]', "deployments = []"), "deployments", "at least one"),
    ],
)
def test_bad_group_configs_are_refused(change: tuple[str, str], key: str, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_config(GROUP_TOML.replace(*change))
    assert key in str(info.value)
    assert why in str(info.value)


def test_groups_fall_back_to_groups_but_never_in_a_loop() -> None:
    loop = GROUP_TOML + """
[adapters.other]
kind = "group"
models = ["pooled"]
deployments = [{ adapter = "b" }]
fallbacks = ["pool"]
"""
    cfg = make_config(loop)
    built = build_adapters(cfg.adapters)
    other = built["other"]
    assert isinstance(other, GroupAdapter)
    assert other.fallbacks[0].adapter is built["pool"]
    with pytest.raises(ConfigError, match="fallbacks loop: pool -> other -> pool"):
        make_config(loop.replace('fallbacks = ["sorry"]', 'fallbacks = ["other"]'))
    with pytest.raises(ConfigError, match="groups go in `fallbacks`"):
        make_config(loop.replace('deployments = [{ adapter = "b" }]\nfallbacks = ["pool"]', 'deployments = [{ adapter = "pool" }]'))


def test_a_mocks_ttft_is_its_prior() -> None:
    g = build_adapters(make_config(GROUP_TOML).adapters)["pool"]
    assert isinstance(g, GroupAdapter)
    assert g.health.expected_ttft("sorry") == pytest.approx(0.005)
    assert g.health.expected_ttft("b") == pytest.approx(0.01)


# --- through the app -------------------------------------------------------------------------


def _app(**fakes: Fake) -> App:
    return App(make_config(GROUP_TOML), adapters=dict(fakes))


async def test_the_response_says_who_served(autojump_clock: Any) -> None:
    app = App(make_config(GROUP_TOML + "\n[observability]\ndebug_requests = true\n"),
              adapters={"a": Fake("a", Script(ttft=None)), "b": Fake("b", Script(ttft=None))})
    client = Client(app)
    for stream in (True, False):
        body = chat_body("hi", model="pooled", stream=stream, stream_options={"include_usage": True} if stream else None)
        r = await client.request("POST", "/v1/pool", json_body={k: v for k, v in body.items() if v is not None})
        assert r.status == 200, r.body
        assert r.headers["x-aiserve-deployment"] == "sorry"
        assert r.headers["x-aiserve-fallback"] == "1"
        # The reply names the model that answered, not the one asked for: every chunk,
        # the usage chunk included, and the whole reply.
        if stream:
            chunks = [json.loads(e) for e in r.events()[:-1]]
            assert len(chunks) > 3
            assert {c["model"] for c in chunks} == {"sorry-model"}
            assert chunks[-1]["usage"] is not None
        else:
            assert r.json()["model"] == "sorry-model"
    recent = (await client.request("GET", "/debug/requests/recent")).json()
    assert {row["model"] for row in recent["requests"] if row["route"] == "pool"} == {"sorry-model"}
    # The default route has one adapter and no group: no such headers.
    r = await client.chat(chat_body("hi"))
    assert "x-aiserve-deployment" not in r.headers


async def test_the_no_fit_error_reaches_the_client_as_an_envelope(autojump_clock: Any) -> None:
    # 1 s: the inference cut is 675 ms. a and b fail at 250 ms each; the fallback
    # expects 500 ms, more than the 175 ms left.
    slow_fail = Script(ttft=None, fail_delay=0.25)
    cfg = make_config(GROUP_TOML.replace('fallbacks = ["sorry"]', 'fallbacks = ["sorry"]\nfallback_ttft_prior_ms = { sorry = 500 }'))
    app = App(cfg, adapters={"a": Fake("a", slow_fail), "b": Fake("b", slow_fail)})
    r = await Client(app).request(
        "POST", "/v1/pool", json_body=chat_body("hi", model="pooled"),
        headers={"x-request-timeout-ms": "1000"},
    )  # fmt: skip
    assert r.status == 504
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("timeout", "no_fallback_fits")
    assert "no fallback fits the remaining budget" in err["message"]
    assert "x-aiserve-deployment" not in r.headers


async def test_models_metrics_and_attempts(autojump_clock: Any) -> None:
    app = _app(a=Fake("a", Script(ttft=None)), b=Fake("b"))
    client = Client(app)
    models = (await client.request("GET", "/v1/models")).json()
    assert ("pooled", "pool") in {(m["id"], m["owned_by"]) for m in models["data"]}
    for _ in range(4):
        r = await client.request("POST", "/v1/pool", json_body=chat_body("hi", model="pooled"))
        assert r.headers["x-aiserve-deployment"] == "b"
    reg = app.metrics.registry
    state = {
        d: reg.get_sample_value("aiserve_upstream_deployment_state", {"group": "pool", "deployment": d})
        for d in ("a", "b", "sorry")
    }
    assert state == {"a": 0.0, "b": 0.0, "sorry": 0.0}
    attempts = reg.get_sample_value("aiserve_upstream_attempts_total", {"adapter": "b", "result": "ok"})
    assert attempts == 4
    assert reg.get_sample_value("aiserve_upstream_attempts_total", {"adapter": "pool", "result": "ok"}) is None
    failed = reg.get_sample_value("aiserve_upstream_attempts_total", {"adapter": "a", "result": "failed"})
    assert failed is not None
    assert failed >= 1
    text_metrics = app.metrics.render().decode()
    assert 'aiserve_upstream_deployment_state{deployment="a",group="pool"}' in text_metrics


def test_metrics_render_outside_trio_still_works() -> None:
    app = _app()
    assert b"aiserve_upstream_deployment_state" in app.metrics.render()



async def test_each_try_is_a_span_naming_its_deployment(autojump_clock: Any) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = App(
        make_config(GROUP_TOML),
        adapters={"a": Fake("a", Script(ttft=None)), "b": Fake("b")},
        tracer_provider=provider,
    )
    g = app.adapters["pool"]
    assert isinstance(g, GroupAdapter)
    g.rng = random.Random(1)  # least_outstanding, a tie: this seed puts a first
    r = await Client(app).request("POST", "/v1/pool", json_body=chat_body("hi", model="pooled"))
    assert r.headers["x-aiserve-deployment"] == "b"
    tries = [dict(s.attributes or {}) for s in exporter.get_finished_spans() if s.name == "upstream_attempt"]
    assert [(t["aiserve.adapter"], t["aiserve.attempt"]) for t in tries] == [("a", 1), ("b", 2)]
    assert tries[0]["aiserve.error_code"] == "upstream_connect_error"
    assert "aiserve.error_code" not in tries[1]


async def test_a_quiet_group_serves_one_at_a_time_requests_from_each_deployment_in_turn(autojump_clock: Any) -> None:
    app = App(make_config(GROUP_TOML.replace("weight = 2", "weight = 1")))
    client = Client(app)
    served = []
    for _ in range(6):
        r = await client.request("POST", "/v1/pool", json_body=chat_body("hi", model="pooled"))
        served.append(r.headers["x-aiserve-deployment"])
    assert served == ["a", "b", "a", "b", "a", "b"]


# --- what the request is billed for (adapters/sidecalls.py) ------------------------------


async def test_a_try_cut_to_move_on_is_recorded_for_the_bill(autojump_clock: Any) -> None:
    # a would answer after 5 s and is cut at 0.9 s for b: its prompt was read upstream.
    a, b = Fake("a", Script(ttft=5.0)), Fake("b")
    g = group(a, b, balance="lowest_ttft", priors={"a": 0.05, "b": 0.1})
    SIDE_CALLS.set(side := SideCalls())
    deltas, _ = await serve(g, budget=1.0)
    assert text(deltas) == "b0 b1 b2 "
    ((model, asked, generated),) = [(c.model, c.request, c.generated) for c in side.calls]
    assert (model, generated) == ("m", 0)
    assert asked is a.calls[0][1]


async def test_a_failed_try_and_the_winner_are_not_recorded(autojump_clock: Any) -> None:
    # a fails (the provider answered an error: nothing to bill); b serves (its own reply).
    a, b = Fake("a", Script(ttft=None)), Fake("b")
    g = group(a, b, balance="weighted")
    SIDE_CALLS.set(side := SideCalls())
    deltas, _ = await serve(g)
    assert text(deltas) == "b0 b1 b2 "
    assert side.calls == []


async def test_a_hedge_that_lost_is_recorded_for_the_bill(autojump_clock: Any) -> None:
    # a answers at 0.35, b (hedged at 0.2) at 0.3: a is cut, its prompt was read.
    a, b = Fake("a", Script(ttft=0.35)), Fake("b", Script(ttft=0.1))
    g = group(a, b, hedge=True, balance="lowest_ttft", priors={"a": 0.2, "b": 0.3})
    SIDE_CALLS.set(side := SideCalls())
    deltas, _ = await serve(g)
    assert text(deltas) == "b0 b1 b2 "
    assert [c.request for c in side.calls] == [a.calls[0][1]]
