"""A task-level trace of the Trio run loop, as Chrome trace-event JSON (``go tool trace`` for Trio).

:class:`RunTracer` is a :class:`trio.abc.Instrument` installed only for the
length of one trace (:func:`trace_run`): with no trace running there is no
instrument at all, so the request path pays nothing (an instrument timing every
step cost 15 % of throughput, docs/architecture.md). While installed, each
callback appends one small tuple to a list, up to a cap; beyond the cap
events are only counted.

:func:`build_trace` turns those records into trace-event JSON and does no I/O
(tested without a server). What a reader gets, in Perfetto or ``chrome://tracing``:

- one track (``tid``) per task, named after the request id and stage it works
  for (``observability/annotate.py``), tracks of one request next to each other;
- a slice per task step (``ph: X``), named after the stage, with the request id,
  route and stage in ``args``, and how the step came about: ``runnable_us``
  (scheduled but not yet running: scheduler delay), ``blocked_us`` (from the
  task's previous step to being scheduled), ``woken_by`` (``io``: the run loop's
  I/O wait saw its socket ready; ``run loop``: a timer or deadline; otherwise
  the task whose step woke it, e.g. the stage that sent it a delta);
- instant events (``ph: i``) when a task is spawned, scheduled or exits;
- a "run loop" track (``tid`` 0) with every I/O wait (``epoll``): the worker
  idle, waiting for the network or a timer.

Timestamps are ``time.perf_counter()`` microseconds from the start of the trace
(real time also under Trio's virtual test clock, so a blocking step shows its
real length).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import trio

from .annotate import TASK_LABEL, TaskLabel

#: Events kept by default; each is a small tuple while recording and ~150 bytes of JSON.
DEFAULT_MAX_EVENTS = 200_000

# Record kinds (the first item of each record tuple).
STEP = 0  # (STEP, t0, t1, tid, label)
SCHED = 1  # (SCHED, t, tid, waker)  waker: a tid, WOKEN_BY_IO, or WOKEN_BY_LOOP
SPAWN = 2  # (SPAWN, t, tid)
EXIT = 3  # (EXIT, t, tid, label)
IO_WAIT = 4  # (IO_WAIT, t0, t1, timeout)

#: ``waker`` of a task scheduled while the run loop processed I/O readiness.
WOKEN_BY_IO = -1
#: ``waker`` of a task scheduled by the run loop itself (timers, deadlines, spawns).
WOKEN_BY_LOOP = 0
#: The run loop's own track (its I/O waits).
LOOP_TID = 0

Record = tuple[Any, ...]

_STAGE_ORDER = {"parse": 0, "context": 1, "inference": 2, "sse": 3}


class RunTracer(trio.abc.Instrument):
    """Records what the run loop does, as tuples; see the module docstring.

    Trio runs one task step at a time on one thread, so a step's start and the
    current waker are single attributes, not maps. Task objects are mapped to
    small integers (``tid``) on first sight; a task's mapping is dropped when it
    exits, so a long trace does not keep finished tasks alive.
    """

    def __init__(
        self, max_events: int = DEFAULT_MAX_EVENTS, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.max_events = max_events
        self.clock = clock
        self.records: list[Record] = []
        self.dropped = 0
        #: Task name by tid.
        self.names: dict[int, str] = {}
        self._tids: dict[trio.lowlevel.Task, int] = {}
        self._next_tid = LOOP_TID + 1
        self.started = clock()
        self.ended: float | None = None
        # The step that installs the instrument is under way: it ends with the
        # first after_task_step, which then records only its part since now.
        self._step_t0 = self.started
        self._io_t0 = self.started
        #: Who is running now: a task's tid, WOKEN_BY_IO during the I/O wait, else the loop.
        self._current = WOKEN_BY_LOOP

    def _tid(self, task: trio.lowlevel.Task) -> int:
        tid = self._tids.get(task)
        if tid is None:
            tid = self._tids[task] = self._next_tid
            self._next_tid += 1
            self.names[tid] = task.name
        return tid

    def _add(self, record: Record) -> None:
        if len(self.records) < self.max_events:
            self.records.append(record)
        else:
            self.dropped += 1

    # --- trio.abc.Instrument -------------------------------------------------------

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self._add((SPAWN, self.clock(), self._tid(task)))

    def task_scheduled(self, task: trio.lowlevel.Task) -> None:
        self._add((SCHED, self.clock(), self._tid(task), self._current))

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._current = self._tid(task)
        self._step_t0 = self.clock()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        t1 = self.clock()
        self._current = WOKEN_BY_LOOP
        # The label is read after the step: a step that set it (a stage starting)
        # is then already shown as that stage.
        self._add((STEP, self._step_t0, t1, self._tid(task), task.context.get(TASK_LABEL)))

    def task_exited(self, task: trio.lowlevel.Task) -> None:
        self._add((EXIT, self.clock(), self._tid(task), task.context.get(TASK_LABEL)))
        self._tids.pop(task, None)

    def before_io_wait(self, timeout: float) -> None:
        self._current = WOKEN_BY_IO
        self._io_t0 = self.clock()

    def after_io_wait(self, timeout: float) -> None:
        self._current = WOKEN_BY_LOOP
        self._add((IO_WAIT, self._io_t0, self.clock(), timeout))


async def trace_run(seconds: float, max_events: int = DEFAULT_MAX_EVENTS) -> RunTracer:
    """Trace the current run loop for ``seconds``; the instrument is removed afterwards.

    Also when cancelled: the instrument never outlives the call.
    """
    tracer = RunTracer(max_events)
    trio.lowlevel.add_instrument(tracer)
    try:
        await trio.sleep(seconds)
    finally:
        tracer.ended = tracer.clock()
        # KeyError: Trio already removed it because a callback raised (and logged why).
        with contextlib.suppress(KeyError):
            trio.lowlevel.remove_instrument(tracer)
    return tracer


# --- the pure part: records -> trace-event JSON ---------------------------------------


def _us(t: float, t0: float) -> float:
    return round((t - t0) * 1e6, 3)


def _label_args(label: TaskLabel | None) -> dict[str, str]:
    if label is None:
        return {}
    args = {}
    if label.request_id is not None:
        args["request_id"] = label.request_id
    if label.route is not None:
        args["route"] = label.route
    if label.stage is not None:
        args["stage"] = label.stage
    return args


def _best(old: TaskLabel | None, new: TaskLabel | None) -> TaskLabel | None:
    """The more telling of two labels of one task (a stage over a request over a route)."""
    if new is None:
        return old
    if old is None:
        return new
    return new if _rank(new) >= _rank(old) else old


def _rank(label: TaskLabel) -> tuple[bool, bool]:
    return (label.stage is not None, label.request_id is not None)


def _track_name(tid: int, name: str, label: TaskLabel | None) -> str:
    if label is None:
        return f"{name} [{tid}]"
    what = label.stage or label.route or name
    return f"{label.request_id} {what}" if label.request_id else f"{what} [{tid}]"


def build_trace(
    records: Iterable[Record],
    names: Mapping[int, str],
    *,
    started: float,
    ended: float | None = None,
    dropped: int = 0,
    max_events: int = DEFAULT_MAX_EVENTS,
    pid: int | None = None,
) -> dict[str, Any]:
    """Chrome trace-event JSON (the object form) from :class:`RunTracer` records.

    Args:
        records: as :attr:`RunTracer.records`, in the order they were made.
        names: task name by tid.
        started: the clock reading the timestamps count from.
        ended: when recording stopped (for the metadata).
        dropped: records refused beyond ``max_events``.
        pid: the worker's process id (default: this process).
    """
    pid = os.getpid() if pid is None else pid
    events: list[dict[str, Any]] = []
    labels: dict[int, TaskLabel | None] = {}
    scheduled: dict[int, tuple[float, int]] = {}  # tid -> (when, waker) since its last step
    last_end: dict[int, float] = {}
    seen: dict[int, float] = {}  # tid -> first timestamp
    for rec in records:
        kind = rec[0]
        if kind == STEP:
            _, t0, t1, tid, label = rec
            labels[tid] = _best(labels.get(tid), label)
            seen.setdefault(tid, t0)
            args: dict[str, Any] = {**_label_args(label), "task": names.get(tid, "?")}
            sched = scheduled.pop(tid, None)
            if sched is not None:
                when, waker = sched
                args["runnable_us"] = _us(t0, when)
                args["woken_by"] = _waker(waker, names, labels)
                if tid in last_end:
                    args["blocked_us"] = _us(when, last_end[tid])
            last_end[tid] = t1
            name = (label.stage or label.route) if label is not None else None
            events.append(
                {
                    "name": name or names.get(tid, "task"),
                    "cat": "step",
                    "ph": "X",
                    "ts": _us(t0, started),
                    "dur": _us(t1, t0),
                    "pid": pid,
                    "tid": tid,
                    "args": args,
                }
            )
        elif kind == SCHED:
            _, t, tid, waker = rec
            scheduled[tid] = (t, waker)
            seen.setdefault(tid, t)
            events.append(_instant("scheduled", "sched", t, started, pid, tid,
                                   {"woken_by": _waker(waker, names, labels)}))
        elif kind == SPAWN:
            _, t, tid = rec
            seen.setdefault(tid, t)
            events.append(_instant("spawned", "task", t, started, pid, tid, {}))
        elif kind == EXIT:
            _, t, tid, label = rec
            labels[tid] = _best(labels.get(tid), label)
            seen.setdefault(tid, t)
            events.append(_instant("exited", "task", t, started, pid, tid, _label_args(label)))
        elif kind == IO_WAIT:
            _, t0, t1, timeout = rec
            events.append(
                {
                    "name": "io_wait",
                    "cat": "io",
                    "ph": "X",
                    "ts": _us(t0, started),
                    "dur": _us(t1, t0),
                    "pid": pid,
                    "tid": LOOP_TID,
                    "args": {"timeout_ms": round(timeout * 1000, 3)},
                }
            )
    events.sort(key=lambda e: e["ts"])
    meta = _metadata(pid, names, labels, seen)
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {
            "source": "aiserve-trio /debug/trace",
            "worker_pid": pid,
            "events": len(events),
            "events_dropped": dropped,
            "max_events": max_events,
            "seconds": round((ended if ended is not None else started) - started, 6),
            "clock": "time.perf_counter, microseconds from the start of the trace",
        },
    }


def _waker(waker: int, names: Mapping[int, str], labels: Mapping[int, TaskLabel | None]) -> str:
    if waker == WOKEN_BY_IO:
        return "io"
    if waker == WOKEN_BY_LOOP:
        return "run loop"
    return _track_name(waker, names.get(waker, "?"), labels.get(waker))


def _instant(
    name: str, cat: str, t: float, started: float, pid: int, tid: int, args: dict[str, Any]
) -> dict[str, Any]:
    # "s": "t" scopes the instant to its task's track.
    return {"name": name, "cat": cat, "ph": "i", "s": "t", "ts": _us(t, started),
            "pid": pid, "tid": tid, "args": args}


def _metadata(
    pid: int,
    names: Mapping[int, str],
    labels: Mapping[int, TaskLabel | None],
    seen: Mapping[int, float],
) -> list[dict[str, Any]]:
    """Process and track names, and an order that puts one request's tasks together."""
    meta: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": LOOP_TID,
         "args": {"name": f"aiserve-trio worker {pid}"}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": LOOP_TID,
         "args": {"name": "run loop (I/O waits)"}},
        {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": LOOP_TID,
         "args": {"sort_index": 0}},
    ]
    first_of_request: dict[str, float] = {}
    for tid, t in seen.items():
        label = labels.get(tid)
        if label is not None and label.request_id is not None:
            rid = label.request_id
            first_of_request[rid] = min(first_of_request.get(rid, t), t)

    def key(tid: int) -> tuple[float, int, int]:
        label = labels.get(tid)
        if label is None or label.request_id is None:
            return (seen[tid], -1, tid)
        return (first_of_request[label.request_id], _STAGE_ORDER.get(label.stage or "", -1), tid)

    for index, tid in enumerate(sorted(seen, key=key), start=1):
        meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                     "args": {"name": _track_name(tid, names.get(tid, "?"), labels.get(tid))}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                     "args": {"sort_index": index}})
    return meta
