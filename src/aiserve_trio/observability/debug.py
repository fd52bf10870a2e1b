"""``GET /debug/profile`` and ``GET /debug/trace``: look inside the worker a request lands on.

- ``/debug/profile?seconds=N&format=speedscope|html``: a sampling CPU profile
  (``profile.py``), as speedscope JSON (default; open it at speedscope's site
  or its offline build) or pyinstrument's self-contained HTML flame graph.
- ``/debug/trace?seconds=N[&max_events=M]``: a task-level trace of the Trio run
  loop (``runtrace.py``) as Chrome trace-event JSON for Perfetto or ``chrome://tracing``.

Both run for ``N`` seconds (0 < N <= 60) while the worker keeps serving, one of
each kind at a time per worker (another gets 409), and stop early, without an
answer, if the client goes away. They are admin endpoints (``Auth.ADMIN`` in
the app's endpoint table); with ``[auth] enabled = false`` the gate lets only
clients on a loopback address through a loopback ``Host`` call them, since anyone
who can reach them can read what the worker is doing (request ids, routes, code
paths). Behind a reverse proxy on the same host every client looks local: turn
auth on there.

Each worker process answers for itself: with several hypercorn workers, the
one the connection landed on is profiled (its pid is in the answer).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import msgspec
import trio

from ..core.errors import BadRequest, Conflict, Overloaded
from .profile import (
    FORMATS,
    HTML_CSP,
    Format,
    ProfilerBusy,
    ProfilerUnavailable,
    profile_worker,
    render,
)
from .runtrace import DEFAULT_MAX_EVENTS, build_trace, trace_run

if TYPE_CHECKING:
    from ..http.endpoints import Request

#: The longest profile or trace one request may ask for.
MAX_SECONDS = 60.0
#: Bounds of ``max_events`` on a trace.
MIN_EVENTS, MAX_EVENTS = 1_000, 1_000_000
_json = msgspec.json.Encoder()


class DebugEndpoints:
    """The profile and trace handlers of one app (one worker)."""

    def __init__(self) -> None:
        # Flags, not locks: a second caller is refused at once rather than queued.
        self._profiling = False
        self._tracing = False

    async def profile(self, request: Request) -> None:
        """``GET /debug/profile``: see the module docstring.

        Raises:
            BadRequest: ``seconds`` or ``format`` is missing or out of range.
            Conflict: a profile is already running on this worker.
        """
        query = query_params(request)
        seconds = _seconds(query)
        fmt = query.get("format", "speedscope")
        if fmt not in FORMATS:
            raise BadRequest(
                f"`format` must be one of {', '.join(FORMATS)}",
                param="format",
                code="invalid_format",
            )
        if self._profiling:
            raise Conflict(
                "a profile is already running on this worker; try again when it ends",
                code="profile_in_progress",
            )
        self._profiling = True
        try:
            session = await _unless_disconnected(request, profile_worker(seconds))
        except ProfilerBusy as exc:  # another profiler holds SIGPROF in this process
            raise Conflict(str(exc), code="profile_in_progress") from exc
        except ProfilerUnavailable as exc:
            raise Overloaded(str(exc), code="profile_unavailable") from exc
        finally:
            self._profiling = False
        if session is None:
            return
        body = await trio.to_thread.run_sync(render, session, _format(fmt))
        await request.responder.complete(200, _headers(fmt, "profile"), body)

    async def trace(self, request: Request) -> None:
        """``GET /debug/trace``: see the module docstring.

        Raises:
            BadRequest: ``seconds`` or ``max_events`` is missing or out of range.
            Conflict: a trace is already running on this worker.
        """
        query = query_params(request)
        seconds = _seconds(query)
        max_events = _int(query, "max_events", DEFAULT_MAX_EVENTS, MIN_EVENTS, MAX_EVENTS)
        if self._tracing:
            raise Conflict(
                "a trace is already running on this worker; try again when it ends",
                code="trace_in_progress",
            )
        self._tracing = True
        try:
            tracer = await _unless_disconnected(request, trace_run(seconds, max_events))
        finally:
            self._tracing = False
        if tracer is None:
            return
        live = tracer.live_tasks()  # from the tasks' contexts, on the Trio thread

        def encode() -> bytes:
            doc = build_trace(
                tracer.records,
                live,
                started=tracer.started,
                ended=tracer.ended,
                dropped=tracer.dropped,
                max_events=tracer.max_events,
            )
            return _json.encode(doc)

        body = await trio.to_thread.run_sync(encode)
        await request.responder.complete(200, _headers("trace", "trace"), body)


async def _unless_disconnected(request: Request, work: Any) -> Any:
    """Await the coroutine ``work``; None if the client went away first (``work`` is cancelled)."""
    result: list[Any] = []

    async def run(cancel: trio.CancelScope) -> None:
        result.append(await work)
        cancel.cancel(reason="profile or trace done")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, nursery.cancel_scope)
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                nursery.cancel_scope.cancel(reason="client disconnected")
                break
    return result[0] if result else None


def query_params(request: Request) -> dict[str, str]:
    """The request's query string, the last value of each name (at most 8 names).

    Raises:
        BadRequest: a query string that is not ASCII or has too many fields.
    """
    raw = request.scope.get("query_string", b"")
    try:
        parsed = parse_qs(raw.decode("ascii"), max_num_fields=8, strict_parsing=False)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest("the query string is not valid", code="invalid_query") from exc
    return {k: v[-1] for k, v in parsed.items()}


def _seconds(query: dict[str, str]) -> float:
    raw = query.get("seconds")
    try:
        value = float(raw) if raw is not None else -1.0
    except ValueError:
        value = -1.0
    if not 0 < value <= MAX_SECONDS:  # also NaN
        raise BadRequest(
            f"`seconds` must be a number above 0 and at most {MAX_SECONDS:g}",
            param="seconds",
            code="invalid_seconds",
        )
    return value


def _int(query: dict[str, str], name: str, default: int, low: int, high: int) -> int:
    raw = query.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise BadRequest(
            f"`{name}` must be an integer from {low} to {high}", param=name, code=f"invalid_{name}"
        )
    return int(raw)


def _format(fmt: str) -> Format:
    return "html" if fmt == "html" else "speedscope"


def _headers(kind: str, what: str) -> list[tuple[bytes, bytes]]:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    name = f"aiserve-{what}-{os.getpid()}-{stamp}"
    if kind == "html":
        return [
            (b"content-type", b"text/html; charset=utf-8"),
            (b"content-security-policy", HTML_CSP.encode()),
            (b"content-disposition", f'inline; filename="{name}.html"'.encode()),
            (b"x-worker-pid", str(os.getpid()).encode()),
        ]
    suffix = "speedscope.json" if kind == "speedscope" else "trace.json"
    return [
        (b"content-type", b"application/json"),
        (b"content-disposition", f'attachment; filename="{name}.{suffix}"'.encode()),
        (b"x-worker-pid", str(os.getpid()).encode()),
    ]
