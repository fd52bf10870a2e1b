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
from collections.abc import Iterable, Mapping
from typing import Any

import trio

from .annotate import TASK_LABEL, TaskLabel

#: Events kept by default; each is a small tuple while recording and ~150 bytes of JSON.
DEFAULT_MAX_EVENTS = 200_000

# Record kinds (the first item of each record tuple); the second is the task's key.
STEP = 0  # (STEP, key, t0, t1[, label as of the step])
SCHED = 1  # (SCHED, key, t, waker)  waker: a task's key, WOKEN_BY_IO or WOKEN_BY_LOOP
SPAWN = 2  # (SPAWN, key, t)
EXIT = 3  # (EXIT, key, t, name, label)
IO_WAIT = 4  # (IO_WAIT, 0, t0, t1, timeout)

#: ``waker`` of a task scheduled while the run loop processed I/O readiness.
WOKEN_BY_IO = -1
#: ``waker`` of a task scheduled by the run loop itself (a timer, a deadline, a spawn).
WOKEN_BY_LOOP = 0
#: The run loop's own track (its I/O waits).
LOOP_TID = 0

Record = tuple[Any, ...]
#: A task's name and label.
TaskInfo = tuple[str, TaskLabel | None]

_STAGE_ORDER = {"parse": 0, "context": 1, "inference": 2, "sse": 3}
_now = time.perf_counter


class RunTracer(trio.abc.Instrument):
    """Records what the run loop does, as tuples; see the module docstring.

    Every callback runs on every task step, so each does the least it can: read
    the clock and append a tuple of numbers. A task is keyed by ``id(task)``,
    not held: tuples of numbers only are untracked by Python's cyclic garbage
    collector, while tuples holding tasks made every collection walk the whole
    trace (it tripled the cost of a callback). A task's name and label are read
    when it exits (into its EXIT record; a stage task's label is set at its start
    and then stays) or, for tasks still alive, when the trace ends
    (:meth:`live_tasks`). An id can be reused once its task is gone; the EXIT
    record tells the builder that the key's next task is another one.
    Trio runs one step at a time on one thread, so a step's start and the task
    running now are single attributes, not maps.
    """

    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        self.max_events = max_events
        self.records: list[Record] = []
        self.dropped = 0
        self.started = _now()
        self.ended: float | None = None
        #: Tasks seen and not exited, by key (to name them at the end).
        self._live: dict[int, trio.lowlevel.Task] = {}
        # The step that installs the instrument is under way: it ends with the
        # first after_task_step, which then records only its part since now.
        self._step_t0 = self.started
        self._io_t0 = self.started
        #: The key of the task running now, WOKEN_BY_IO during the I/O wait, else WOKEN_BY_LOOP.
        self._current = WOKEN_BY_LOOP
        try:  # made in a task step (trace_run's): that step is the first to end
            task = trio.lowlevel.current_task()
        except RuntimeError:
            return
        self._current = id(task)
        self._live[self._current] = task

    def live_tasks(self) -> dict[int, TaskInfo]:
        """Name and label of the tasks seen and still alive (on the Trio thread, at the end)."""
        return {key: (t.name, t.context.get(TASK_LABEL)) for key, t in self._live.items()}

    # --- trio.abc.Instrument (the hot path) ------------------------------------------

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        key = id(task)
        self._live[key] = task
        if len(self.records) < self.max_events:
            self.records.append((SPAWN, key, _now()))
        else:
            self.dropped += 1

    def task_scheduled(self, task: trio.lowlevel.Task) -> None:
        if len(self.records) < self.max_events:
            self.records.append((SCHED, id(task), _now(), self._current))
        else:
            self.dropped += 1

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        key = self._current = id(task)
        if key not in self._live:  # a task spawned before the trace started
            self._live[key] = task
        self._step_t0 = _now()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        t1 = _now()
        if len(self.records) < self.max_events:
            # The label as of this step: a task may serve several stages in turn
            # (the request's task runs the last one).
            label = task.context.get(TASK_LABEL)
            self.records.append((STEP, self._current, self._step_t0, t1, label))
        else:
            self.dropped += 1
        self._current = WOKEN_BY_LOOP

    def task_exited(self, task: trio.lowlevel.Task) -> None:
        key = id(task)
        self._live.pop(key, None)
        if len(self.records) < self.max_events:
            self.records.append((EXIT, key, _now(), task.name, task.context.get(TASK_LABEL)))
        else:
            self.dropped += 1

    def before_io_wait(self, timeout: float) -> None:
        self._current = WOKEN_BY_IO
        self._io_t0 = _now()

    def after_io_wait(self, timeout: float) -> None:
        self._current = WOKEN_BY_LOOP
        if len(self.records) < self.max_events:
            self.records.append((IO_WAIT, 0, self._io_t0, _now(), timeout))
        else:
            self.dropped += 1


async def trace_run(seconds: float, max_events: int = DEFAULT_MAX_EVENTS) -> RunTracer:
    """Trace the current run loop for ``seconds``; the instrument is removed afterwards.

    Also when cancelled: the instrument never outlives the call.
    """
    tracer = RunTracer(max_events)
    trio.lowlevel.add_instrument(tracer)
    try:
        await trio.sleep(seconds)
    finally:
        tracer.ended = _now()
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


def _track_name(tid: int, name: str, label: TaskLabel | None) -> str:
    if label is None:
        return f"{name} [{tid}]"
    what = label.stage or label.route or name
    return f"{label.request_id} {what}" if label.request_id else f"{what} [{tid}]"


def build_trace(
    records: Iterable[Record],
    live: Mapping[int, TaskInfo],
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
        live: name and label of the tasks that had not exited when recording
            stopped (:meth:`RunTracer.live_tasks`); the others' are in their EXIT records.
        started: the clock reading the timestamps count from.
        ended: when recording stopped (for the metadata).
        dropped: records refused beyond ``max_events``.
        pid: the worker's process id (default: this process).
    """
    pid = os.getpid() if pid is None else pid
    records = list(records)
    tracks = _Tracks(records, live)
    events = _Events(tracks, started, pid).of(records)
    return {
        "traceEvents": _metadata(pid, tracks.info, events.seen) + events.events,
        "displayTimeUnit": "ms",
        "otherData": {
            "source": "aiserve-trio /debug/trace",
            "worker_pid": pid,
            "events": len(events.events),
            "events_dropped": dropped,
            "max_events": max_events,
            "seconds": round((ended if ended is not None else started) - started, 6),
            "clock": "time.perf_counter, microseconds from the start of the trace",
        },
    }


class _Tracks:
    """Pass 1 over the records: a track (tid) per task -- a key's next task after its
    EXIT is another one -- and each task's name and label, known only at its exit or at
    the end."""

    def __init__(self, records: list[Record], live: Mapping[int, TaskInfo]) -> None:
        self._generation: dict[int, int] = {}
        self._tids: dict[tuple[int, int], int] = {}
        #: tid -> the task's name and label
        self.info: dict[int, TaskInfo] = {}
        #: the track of each record, by index
        self.of_record: list[int] = []
        #: index of a SCHED record -> its waker's tid
        self._wakers: dict[int, int] = {}
        for i, rec in enumerate(records):
            kind = rec[0]
            if kind == IO_WAIT:
                self.of_record.append(LOOP_TID)
                continue
            tid = self._tid_of(rec[1])
            self.of_record.append(tid)
            if kind == SCHED and rec[3] not in (WOKEN_BY_IO, WOKEN_BY_LOOP):
                self._wakers[i] = self._tid_of(rec[3])
            elif kind == EXIT:
                self.info[tid] = (rec[3], rec[4])
                self._generation[rec[1]] = self._generation.get(rec[1], 0) + 1
        for (key, gen), tid in self._tids.items():
            if tid not in self.info:
                current = gen == self._generation.get(key, 0)
                self.info[tid] = live.get(key, ("?", None)) if current else ("?", None)

    def _tid_of(self, key: int) -> int:
        k = (key, self._generation.get(key, 0))
        tid = self._tids.get(k)
        if tid is None:
            tid = self._tids[k] = len(self._tids) + LOOP_TID + 1
        return tid

    def waker_name(self, i: int, waker: int) -> str:
        """Who scheduled the task of SCHED record ``i``."""
        if waker == WOKEN_BY_IO:
            return "io"
        if waker == WOKEN_BY_LOOP:
            return "run loop"
        wtid = self._wakers[i]
        return _track_name(wtid, *self.info[wtid])


class _Events:
    """Pass 2: the trace's events, in record order (sorted by time at the end)."""

    def __init__(self, tracks: _Tracks, started: float, pid: int) -> None:
        self._tracks, self._started, self._pid = tracks, started, pid
        self.events: list[dict[str, Any]] = []
        #: tid -> (when, woken by) since its last step; a second entry is made during
        #: the step
        self._scheduled: dict[int, list[tuple[float, str]]] = {}
        self._last_end: dict[int, float] = {}
        #: tid -> its first timestamp
        self.seen: dict[int, float] = {}

    def of(self, records: list[Record]) -> _Events:
        started, pid = self._started, self._pid
        for i, rec in enumerate(records):
            kind = rec[0]
            tid = self._tracks.of_record[i]
            if kind == IO_WAIT:
                self.events.append(_io_wait(rec, started, pid))
                continue
            self.seen.setdefault(tid, rec[2])
            if kind == STEP:
                self.events.append(self._step(rec, tid))
            elif kind == SCHED:
                woken = {"woken_by": self._tracks.waker_name(i, rec[3])}
                self._scheduled.setdefault(tid, []).append((rec[2], woken["woken_by"]))
                self.events.append(_instant("scheduled", "sched", rec[2], started, pid, tid, woken))
            elif kind == SPAWN:
                self.events.append(_instant("spawned", "task", rec[2], started, pid, tid, {}))
            elif kind == EXIT:
                self.events.append(_instant("exited", "task", rec[2], started, pid, tid, {}))
        self.events.sort(key=lambda e: e["ts"])
        return self

    def _step(self, rec: Record, tid: int) -> dict[str, Any]:
        name, label = self._tracks.info[tid]
        _, _, t0, t1, *step_label = rec
        if step_label and step_label[0] is not None:
            label = step_label[0]
        args: dict[str, Any] = {**_label_args(label), "task": name}
        # A task that reschedules itself (a checkpoint) is scheduled *during* its
        # step, and that SCHED record precedes the STEP record, appended at the
        # step's end: it belongs to the task's next step, not to this one.
        pending = self._scheduled.pop(tid, [])
        if pending and pending[-1][0] >= t0:
            self._scheduled[tid] = [pending.pop()]
        if pending:
            when, woken_by = pending[-1]
            previous = self._last_end.get(tid)
            # Scheduled before its previous step ended: runnable from that end on,
            # never blocked in between.
            ready = when if previous is None else max(when, previous)
            args["runnable_us"] = _us(t0, ready)
            args["woken_by"] = woken_by
            if previous is not None:
                args["blocked_us"] = _us(ready, previous)
        self._last_end[tid] = t1
        return {
            "name": (label.stage or label.route or name) if label is not None else name,
            "cat": "step",
            "ph": "X",
            "ts": _us(t0, self._started),
            "dur": _us(t1, t0),
            "pid": self._pid,
            "tid": tid,
            "args": args,
        }


def _io_wait(rec: Record, started: float, pid: int) -> dict[str, Any]:
    _, _, t0, t1, timeout = rec
    return {
        "name": "io_wait",
        "cat": "io",
        "ph": "X",
        "ts": _us(t0, started),
        "dur": _us(t1, t0),
        "pid": pid,
        "tid": LOOP_TID,
        "args": {"timeout_ms": round(timeout * 1000, 3)},
    }


def _instant(
    name: str, cat: str, t: float, started: float, pid: int, tid: int, args: dict[str, Any]
) -> dict[str, Any]:
    # "s": "t" scopes the instant to its task's track.
    return {"name": name, "cat": cat, "ph": "i", "s": "t", "ts": _us(t, started),
            "pid": pid, "tid": tid, "args": args}


def _metadata(
    pid: int, info: Mapping[int, TaskInfo], seen: Mapping[int, float]
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
        label = info[tid][1]
        if label is not None and label.request_id is not None:
            rid = label.request_id
            first_of_request[rid] = min(first_of_request.get(rid, t), t)

    def key(tid: int) -> tuple[float, int, int]:
        label = info[tid][1]
        if label is None or label.request_id is None:
            return (seen.get(tid, 0.0), -1, tid)
        order = _STAGE_ORDER.get(label.stage or "", -1)
        return (first_of_request.get(label.request_id, 0.0), order, tid)

    for index, tid in enumerate(sorted(seen, key=key), start=1):
        meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                     "args": {"name": _track_name(tid, *info[tid])}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                     "args": {"sort_index": index}})
    return meta
