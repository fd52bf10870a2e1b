"""What a Trio task is doing for whom, and what a request read from its upstream.

Two context variables, the Python counterpart of Go's ``trace.Log`` annotations:

- :data:`TASK_LABEL` says which request, route and stage a task works for. The
  request entry sets it (route only: the request id is made later), the pipeline
  sets it again once the request id is known, and each stage's shell sets it
  with the stage's name. Every Trio task runs in its own copy of the context it
  was spawned from, so a stage's label never leaks into another task. The run
  trace (``runtrace.py``) and the profile (``profile.py``) read it from
  ``task.context``, from outside the task: nothing on the request path asks for it.
- :data:`UPSTREAM_IO` holds one request's upstream read counter. The pipeline
  sets it before the stage tasks start (they inherit the same object); an adapter
  calls :func:`upstream_read` for each chunk it hands its decoder. Counting is two
  integer additions; the totals go into the request's ``Outcome``.

Setting a context variable costs about as much as a dict store, once per task;
reading it happens only while a trace or profile runs.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import NamedTuple


class TaskLabel(NamedTuple):
    """Who a task works for. Immutable: a task that changes role sets a new one."""

    #: The gateway's request id (``chatcmpl-...``); None before the pipeline knows it.
    request_id: str | None
    #: The route's label, or the endpoint's name (``models``, ``debug_profile``...).
    route: str | None
    #: ``parse``, ``context``, ``inference``, ``sse``; None outside a stage.
    stage: str | None = None


TASK_LABEL: ContextVar[TaskLabel | None] = ContextVar("aiserve_task_label", default=None)


class UpstreamReads:
    """How often one request read from its upstream and how many bytes it got.

    "A read" is one chunk the adapter received from its HTTP client or WebSocket
    and handed to its decoder; with a plain HTTP/1.1 upstream that is close to
    one ``recv`` system call each.
    """

    __slots__ = ("bytes", "reads")

    def __init__(self) -> None:
        self.reads = 0
        self.bytes = 0


UPSTREAM_IO: ContextVar[UpstreamReads | None] = ContextVar("aiserve_upstream_io", default=None)


def upstream_read(nbytes: int) -> None:
    """Count one upstream read of ``nbytes`` for the current request (nothing outside one)."""
    counter = UPSTREAM_IO.get()
    if counter is not None:
        counter.reads += 1
        counter.bytes += nbytes
