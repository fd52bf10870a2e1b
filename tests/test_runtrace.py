"""The run-loop trace: the pure trace-event builder, then the instrument on a live run loop."""

from __future__ import annotations

import time
from typing import Any

import pytest
import trio
import trio.testing

from aiserve_trio.adapters.base import DeltaSink, InferenceRequest
from aiserve_trio.adapters.mock import MockAdapter
from aiserve_trio.adapters.retry import Progress
from aiserve_trio.config import MockAdapterConfig
from aiserve_trio.observability import runtrace
from aiserve_trio.observability.annotate import TaskLabel
from aiserve_trio.observability.runtrace import (
    EXIT,
    IO_WAIT,
    SCHED,
    SPAWN,
    STEP,
    WOKEN_BY_IO,
    WOKEN_BY_LOOP,
    build_trace,
    trace_run,
)
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client, chat_body
from .conftest import make_config
from .fakes import RecordingAdapter
from .trace_events import check_trace_events

REQ = "chatcmpl-1"
INF = TaskLabel(REQ, "chat", "inference")
SSE = TaskLabel(REQ, "chat", "sse")
STAGE_TASK = "aiserve_trio.stages.pipeline.Pipeline._stage"
# Task keys (the tracer uses id(task)).
REQ_T, INF_T, SSE_T, OTHER_T, MODELS_T = 101, 102, 103, 104, 105
LIVE = {REQ_T: ("hypercorn.app", TaskLabel(REQ, "chat")), INF_T: (STAGE_TASK, INF), SSE_T: (STAGE_TASK, SSE),
        OTHER_T: (STAGE_TASK, TaskLabel("chatcmpl-2", "chat", "parse")), MODELS_T: ("m", TaskLabel(None, "models"))}


def by(events: list[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    return [e for e in events if all(e.get(k) == v for k, v in match.items())]


# --- the pure builder ---------------------------------------------------------------


def test_records_become_trace_events_with_delays_and_wakers() -> None:
    records = [
        (SPAWN, REQ_T, 1.000),
        (SCHED, REQ_T, 1.000, WOKEN_BY_LOOP),
        (STEP, REQ_T, 1.001, 1.002),
        (IO_WAIT, 0, 1.002, 1.010, 0.5),
        (SCHED, INF_T, 1.009, WOKEN_BY_IO),  # its socket was ready
        (STEP, INF_T, 1.012, 1.062),  # a 50 ms step, 3 ms after it became runnable
        (SCHED, SSE_T, 1.050, INF_T),  # woken by the inference task (a delta sent)
        (STEP, SSE_T, 1.070, 1.071),
        (SCHED, INF_T, 1.090, WOKEN_BY_LOOP),
        (STEP, INF_T, 1.091, 1.092),
        (EXIT, SSE_T, 1.100, STAGE_TASK, SSE),
    ]
    live = {k: v for k, v in LIVE.items() if k != SSE_T}  # the sse task has exited
    doc = build_trace(records, live, started=1.0, ended=2.0, dropped=5, max_events=11, pid=42)
    assert check_trace_events(doc) == []
    events = doc["traceEvents"]
    assert doc["otherData"]["events_dropped"] == 5
    assert doc["otherData"]["max_events"] == 11
    assert doc["otherData"]["seconds"] == pytest.approx(1.0)
    assert {e["pid"] for e in events} == {42}

    # tracks are numbered in order of first appearance: req 1, inf 2, sse 3
    first, second = by(events, ph="X", tid=2)
    assert first["name"] == "inference"
    assert first["ts"] == pytest.approx(12_000)
    assert first["dur"] == pytest.approx(50_000)
    assert first["args"]["request_id"] == REQ
    assert first["args"]["stage"] == "inference"
    assert first["args"]["route"] == "chat"
    assert first["args"]["runnable_us"] == pytest.approx(3_000)
    assert first["args"]["woken_by"] == "io"
    assert "blocked_us" not in first["args"]  # no step of it before the trace
    assert second["args"]["blocked_us"] == pytest.approx(28_000)  # 1.062 -> 1.090
    assert second["args"]["woken_by"] == "run loop"

    (sse,) = by(events, ph="X", tid=3)
    assert sse["args"]["woken_by"] == f"{REQ} inference"
    assert sse["args"]["runnable_us"] == pytest.approx(20_000)

    (io,) = by(events, ph="X", tid=0)
    assert io["name"] == "io_wait"
    assert io["dur"] == pytest.approx(8_000)
    assert io["args"]["timeout_ms"] == 500

    instants = by(events, ph="i")
    assert {e["name"] for e in instants} == {"spawned", "scheduled", "exited"}
    assert all(e["s"] == "t" for e in instants)
    timed = [e["ts"] for e in events if e["ph"] != "M"]
    assert timed == sorted(timed)


def test_a_task_that_wakes_itself_is_runnable_from_its_next_step_not_before_its_own() -> None:
    # A checkpoint reschedules the running task: its SCHED record is made during the
    # step, before the STEP record the step's end appends.
    records = [
        (SCHED, INF_T, 1.000, WOKEN_BY_LOOP),
        (SCHED, INF_T, 1.0015, INF_T),  # made during the step below
        (STEP, INF_T, 1.001, 1.002),
        (STEP, INF_T, 1.004, 1.005),  # runnable since its previous step ended
        (SCHED, INF_T, 1.007, WOKEN_BY_IO),
        (STEP, INF_T, 1.008, 1.009),
    ]
    doc = build_trace(records, LIVE, started=1.0, ended=2.0, pid=42)
    assert check_trace_events(doc) == []
    first, second, third = by(doc["traceEvents"], ph="X", tid=1)
    assert first["args"]["runnable_us"] == pytest.approx(1_000)
    assert first["args"]["woken_by"] == "run loop"
    assert second["args"]["runnable_us"] == pytest.approx(2_000)  # 1.002 -> 1.004
    assert second["args"]["blocked_us"] == 0
    assert second["args"]["woken_by"] == f"{REQ} inference"
    assert third["args"]["runnable_us"] == pytest.approx(1_000)
    assert third["args"]["blocked_us"] == pytest.approx(2_000)


async def test_a_live_trace_of_tasks_that_checkpoint_has_no_negative_delay() -> None:
    async def spin() -> None:
        for _ in range(200):
            await trio.lowlevel.checkpoint()

    traced: list[runtrace.RunTracer] = []

    async def trace() -> None:
        traced.append(await trace_run(0.05))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trace)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(spin)
        nursery.start_soon(spin)
    (tracer,) = traced
    doc = build_trace(tracer.records, tracer.live_tasks(), started=tracer.started, ended=tracer.ended)
    assert check_trace_events(doc) == []
    woken_by_self = [
        e for e in doc["traceEvents"]
        if e["ph"] == "X" and e["cat"] == "step" and ".spin [" in e["args"].get("woken_by", "")
    ]
    assert len(woken_by_self) > 100


def test_tracks_are_named_after_request_and_stage_and_kept_together() -> None:
    records = [
        (STEP, SSE_T, 1.0, 1.001),  # tid 1
        (STEP, OTHER_T, 1.002, 1.003),  # tid 2
        (STEP, INF_T, 1.004, 1.005),  # tid 3
        (STEP, MODELS_T, 1.006, 1.007),  # tid 4
    ]
    doc = build_trace(records, LIVE, started=1.0)
    names = {e["tid"]: e["args"]["name"] for e in by(doc["traceEvents"], name="thread_name")}
    assert names[3] == f"{REQ} inference"
    assert names[1] == f"{REQ} sse"
    assert names[4] == "models [4]"
    assert names[0].startswith("run loop")
    order = {e["tid"]: e["args"]["sort_index"] for e in by(doc["traceEvents"], name="thread_sort_index")}
    # chatcmpl-1 appeared first: its inference track, then its sse track, then chatcmpl-2.
    assert order[0] < order[3] < order[1] < order[2]


def test_a_reused_task_id_after_an_exit_is_another_task() -> None:
    records = [
        (STEP, SSE_T, 1.0, 1.001),
        (EXIT, SSE_T, 1.002, STAGE_TASK, SSE),
        (STEP, SSE_T, 1.003, 1.004),  # id(task) reused by a new task, still alive at the end
    ]
    doc = build_trace(records, {SSE_T: ("later", TaskLabel("chatcmpl-9", "chat", "parse"))}, started=1.0)
    first, second = by(doc["traceEvents"], ph="X")
    assert (first["tid"], first["name"], first["args"]["request_id"]) == (1, "sse", REQ)
    assert (second["tid"], second["name"], second["args"]["request_id"]) == (2, "parse", "chatcmpl-9")


def test_an_empty_trace_is_still_a_trace() -> None:
    doc = build_trace([], {}, started=5.0, ended=5.5)
    assert check_trace_events(doc) == []
    assert doc["otherData"]["events"] == 0
    assert doc["otherData"]["seconds"] == pytest.approx(0.5)


def test_the_checker_finds_bad_shapes() -> None:
    assert check_trace_events({}) == ["`traceEvents` is not a list"]
    bad = {"traceEvents": [{"name": 1, "ph": "Q", "pid": "1", "tid": True, "ts": "0"},
                           {"name": "a", "ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": -1, "args": []}]}
    problems = check_trace_events(bad)
    assert len(problems) == 7, problems


# --- the instrument on a live run loop ------------------------------------------------


class BlockingAdapter(RecordingAdapter):
    """The mock adapter, but each try first blocks the whole worker for 50 ms."""

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        time.sleep(0.05)  # noqa: ASYNC251 - the point: a step that blocks the run loop
        await super().attempt(request, send, progress)


def blocking_app() -> App:
    cfg = make_config()
    mock = cfg.adapters["mock"]
    assert isinstance(mock, MockAdapterConfig)
    return App(cfg, adapters={"mock": BlockingAdapter(MockAdapter("mock", mock))})


@pytest.fixture
def instrument_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every add_instrument / remove_instrument call, by name."""
    calls: list[str] = []
    add, remove = trio.lowlevel.add_instrument, trio.lowlevel.remove_instrument

    def adding(instrument: trio.abc.Instrument) -> None:
        calls.append("add")
        add(instrument)

    def removing(instrument: trio.abc.Instrument) -> None:
        calls.append("remove")
        remove(instrument)

    monkeypatch.setattr(trio.lowlevel, "add_instrument", adding)
    monkeypatch.setattr(trio.lowlevel, "remove_instrument", removing)
    return calls


async def test_a_blocking_stage_shows_as_a_long_step_with_its_request_id(
    autojump_clock: trio.testing.MockClock, instrument_calls: list[str]
) -> None:
    app = blocking_app()
    client = Client(app)
    traced: list[runtrace.RunTracer] = []

    async def trace() -> None:
        traced.append(await trace_run(1.0))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trace)
        await trio.sleep(0.01)
        r = await client.chat(chat_body("echo: a b c", stream=True))
    assert r.status == 200
    request_id = r.headers["x-request-id"]
    (tracer,) = traced
    assert instrument_calls == ["add", "remove"]
    with pytest.raises(KeyError):  # really gone
        trio.lowlevel.remove_instrument(tracer)

    doc = build_trace(tracer.records, tracer.live_tasks(), started=tracer.started, ended=tracer.ended)
    assert check_trace_events(doc) == []
    steps = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "step"]
    mine = [e for e in steps if e["args"].get("request_id") == request_id]
    assert {e["args"].get("stage") for e in mine} >= {"parse", "context", "inference", "sse"}
    (long,) = [e for e in steps if e["dur"] >= 50_000]
    assert long["name"] == "inference"
    assert long["args"]["request_id"] == request_id
    assert long["dur"] < 1_000_000
    # The sse stage was woken by the inference stage's delta at least once.
    woken = {e["args"].get("woken_by") for e in mine if e["args"].get("stage") == "sse"}
    assert f"{request_id} inference" in woken
    tracks = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert f"{request_id} inference" in tracks


async def test_no_instrument_is_installed_without_a_trace(
    autojump_clock: trio.testing.MockClock, instrument_calls: list[str]
) -> None:
    app = App(make_config("[observability]\ndebug_requests = true\n"))
    client = Client(app)
    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(client.chat, chat_body("echo: a b", stream=True))
    assert (await client.request("GET", "/debug/requests/recent")).status == 200
    assert (await client.request("GET", "/healthz")).status == 200
    assert instrument_calls == []


async def test_beyond_the_cap_events_are_counted_not_kept(
    autojump_clock: trio.testing.MockClock,
) -> None:
    client = Client(App(make_config()))
    traced: list[runtrace.RunTracer] = []

    async def trace() -> None:
        traced.append(await trace_run(1.0, max_events=300))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trace)
        for _ in range(10):
            nursery.start_soon(client.chat, chat_body("echo: a b c d", stream=True))
    (tracer,) = traced
    assert len(tracer.records) == 300
    assert tracer.dropped > 0
    doc = build_trace(tracer.records, tracer.live_tasks(), started=tracer.started,
                      dropped=tracer.dropped, max_events=300)
    assert doc["otherData"]["events_dropped"] == tracer.dropped
    assert check_trace_events(doc) == []


async def test_a_cancelled_trace_removes_its_instrument(
    autojump_clock: trio.testing.MockClock, instrument_calls: list[str]
) -> None:
    with trio.move_on_after(0.5):
        await trace_run(10.0)
    assert instrument_calls == ["add", "remove"]
