"""One request, end to end: a nursery per request, four stages, one deadline.

::

    receive() --body--> parse --ChatRequest--> context --InferenceRequest-->
        inference --Delta--> sse --> send()

The stages run as tasks joined by memory channels with buffers of 0 or 1, so a
slow client's backpressure reaches the upstream. Each stage runs in its own
cancel scope whose deadline is its cumulative cut point (see ``budgets.py``).
A watcher task owns ``receive()``: it forwards the body to the parse stage and
then waits for ``http.disconnect``, which cancels the whole request. (hypercorn's
``send()`` does not raise after a disconnect, so a loop that only sends would
never notice.)

Failures are reported, not raised, by the stages: the first one in pipeline
order wins and is written once at the end -- an HTTP error with the OpenAI
envelope before the first byte, a final SSE error event and ``[DONE]`` after.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING

import trio

from .adapters.base import Delta, InferenceRequest
from .errors import GatewayError, InternalError, NotFound, StageDeadlineExceeded
from .observability.metrics import STAGES, Metrics, label_value, status_label
from .security.admission import Admission, BodyReadTimeout, WriteTimeout
from .sessions.outbox import TurnRecord
from .stages.context import context_stage
from .stages.inference import inference_stage
from .stages.parse import ChatRequest, check_content_type, decode_request, read_body
from .stages.request import Receive, RequestState, Responder
from .stages.sse import DONE, SSEFramer, sse_stage

if TYPE_CHECKING:
    from .config import Config
    from .observability.observer import RequestObserver
    from .sessions.bus import SessionBus
    from .sessions.outbox import WriteBack

log = logging.getLogger("aiserve_trio.pipeline")
_STAGE_ORDER = {name: i for i, name in enumerate(STAGES)}


class Pipeline:
    """Runs chat requests; built once per app with what every request shares."""

    def __init__(
        self,
        config: Config,
        metrics: Metrics,
        bus: SessionBus | None,
        writeback: WriteBack | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.bus = bus
        self.writeback = writeback
        #: Set by the app: open-stream cap (checked once a request asks to stream).
        self.admission: Admission | None = None
        #: Set by the app: SLA metrics, baseline, trace and debug list per request.
        self.observer: RequestObserver | None = None

    async def run(self, state: RequestState, receive: Receive, responder: Responder) -> None:
        """Serve one chat request, then write its turns to the session bus.

        Never raises a GatewayError: it is written instead.
        """
        record = TurnRecord()
        try:
            await self._run(state, receive, responder, record)
        finally:
            if state.stream_slot and self.admission is not None:
                self.admission.close_stream()
        if self.writeback is not None and state.session_id is not None:
            await self.writeback.after_request(state, record)

    async def _run(
        self, state: RequestState, receive: Receive, responder: Responder, record: TurnRecord
    ) -> None:
        body_send, body_recv = trio.open_memory_channel[bytes](0)
        req_send, req_recv = trio.open_memory_channel[ChatRequest](0)
        inf_send, inf_recv = trio.open_memory_channel[InferenceRequest](0)
        delta_send, delta_recv = trio.open_memory_channel[Delta](1)
        sessions = self.config.sessions

        bus, hist, tmpl = self.bus, sessions.history_turns, sessions.system_template
        context = partial(context_stage, state, req_recv, inf_send, bus, tmpl, hist, record)
        work: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("parse", partial(self._parse, state, body_recv, req_send)),
            ("context", context),
            ("inference", partial(inference_stage, state, inf_recv, delta_send)),
            ("sse", partial(self._sse, state, delta_recv, responder)),
        ]
        try:
            async with trio.open_nursery() as request_nursery:
                request_nursery.start_soon(
                    self._watch, state, receive, body_send, responder, request_nursery.cancel_scope
                )
                state.on_stream_start = partial(
                    request_nursery.start_soon,
                    self._keepalive,
                    state,
                    responder,
                    request_nursery.cancel_scope,
                )
                async with trio.open_nursery() as stages:
                    for name, fn in work:
                        stages.start_soon(self._stage, state, name, fn, stages.cancel_scope)
                request_nursery.cancel_scope.cancel(reason="request finished")
        except Exception as exc:  # a bug in a stage: log it, tell the client nothing of it
            log.exception("request %s failed inside the gateway", state.request_id, exc_info=exc)
            state.fail("sse", InternalError("the gateway failed while serving this request"))

        if state.disconnected:
            self._count(state, "client_closed")
            return
        if state.error is None and not responder.finished:
            state.fail("sse", InternalError("the request ended without a response"))
        if state.error is not None:
            await self._write_error(state, responder, state.error)
            # Counted by the error's status even when the stream had started with 200.
            self._count(state, status_label(state.error.status))
            return
        self._count(state, "ok")

    # --- the stages' shells --------------------------------------------------

    async def _stage(
        self,
        state: RequestState,
        name: str,
        work: Callable[[], Awaitable[None]],
        cancel: trio.CancelScope,
    ) -> None:
        """Run one stage: count it, time it, report its failure and stop the others."""
        m = self.metrics
        gauge = m.task_count.labels(name)
        gauge.inc()
        try:
            await work()
        except GatewayError as exc:
            if isinstance(exc, StageDeadlineExceeded):
                m.stage_expiries.labels(exc.stage).inc()
            if state.fail(name, exc):
                cancel.cancel(reason=f"{name} stage failed")
        finally:
            gauge.dec()
            started = state.stage_started.get(name)
            if started is not None:
                ended = state.stage_ended[name] = trio.current_time()
                m.stage_latency.labels(name).observe(ended - started)

    async def _parse(
        self,
        state: RequestState,
        body: trio.MemoryReceiveChannel[bytes],
        out: trio.MemorySendChannel[ChatRequest],
    ) -> None:
        limits = self.config.limits
        route = state.route
        async with out, body:
            state.mark("parse")
            with trio.move_on_at(state.budget.context_end) as scope:
                check_content_type(state.headers.get("content-type"))
                raw = await read_body(body, limits.max_body_bytes)
                req = decode_request(raw, limits, route.config.default_model)
                if req.model not in route.adapter.models:
                    raise NotFound(
                        f"the model {req.model!r} is not served on this route "
                        f"(models: {', '.join(route.adapter.models)})",
                        param="model",
                        code="model_not_found",
                    )
                state.model = req.model
                if req.stream and self.admission is not None:
                    self.admission.open_stream()  # 503 before the head if at the cap
                    state.stream_slot = True
                state.stream = req.stream
                state.include_usage = req.include_usage
                await out.send(req)
            if scope.cancelled_caught:
                raise StageDeadlineExceeded(
                    "parse", "the request body did not arrive within the context budget"
                )

    async def _sse(
        self,
        state: RequestState,
        deltas: trio.MemoryReceiveChannel[Delta],
        responder: Responder,
    ) -> None:
        with trio.move_on_at(state.budget.deadline) as scope:
            await sse_stage(state, deltas, responder)
        if scope.cancelled_caught:
            raise StageDeadlineExceeded("sse")

    async def _keepalive(
        self, state: RequestState, responder: Responder, request_scope: trio.CancelScope
    ) -> None:
        """Heartbeats and the write deadline of one event stream, in one task.

        ``: ping`` goes out when the stream has been idle ``heartbeat_s``; a write
        the client has not taken within ``write_timeout_ms`` ends the request.
        One watchdog per stream costs less than a cancel scope per write, and
        it only starts once a response is actually streaming.
        """
        limits = self.config.limits
        every = limits.heartbeat_s or math.inf
        stall = limits.write_timeout_ms / 1000.0
        while not responder.finished:
            now = trio.current_time()
            since = responder.writing_since
            # Compare with the very sum slept until: `now - last >= every` can
            # miss by a rounding error and spin at the same instant.
            if since is None and now >= responder.last_write + every:
                with trio.move_on_after(stall):
                    await responder.ping()
                since = responder.writing_since  # still set: the ping did not go out
                now = trio.current_time()
            if since is not None and now >= since + stall:
                responder.finished = True  # nothing more can usefully be sent
                state.fail("sse", WriteTimeout("the client stopped reading the response"))
                request_scope.cancel(reason="write deadline")
                return
            wake = now + stall if since is None else since + stall
            await trio.sleep_until(min(wake, responder.last_write + every))

    async def _watch(
        self,
        state: RequestState,
        receive: Receive,
        body: trio.MemorySendChannel[bytes],
        responder: Responder,
        request_scope: trio.CancelScope,
    ) -> None:
        """Own ``receive()``: forward the body, then wait for a disconnect."""
        idle = self.config.limits.body_read_timeout_ms / 1000.0
        async with body:
            while True:
                with trio.move_on_after(idle) as wait:
                    msg = await receive()
                if wait.cancelled_caught:  # a slowloris body: refuse it, free the slot
                    if state.fail("parse", BodyReadTimeout("the request body stopped arriving")):
                        request_scope.cancel(reason="request body stalled")
                    return
                kind = msg["type"]
                if kind == "http.disconnect":
                    self._disconnected(state, request_scope)
                    return
                if kind != "http.request":
                    continue
                chunk = msg.get("body", b"")
                if chunk:
                    try:
                        await body.send(chunk)
                    except trio.BrokenResourceError:
                        # The parse stage refused the body and ends the request:
                        # reading the rest would only buffer what was refused.
                        return
                if not msg.get("more_body", False):
                    break
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                # hypercorn also reports the end of a completed response this way.
                if not responder.finished:
                    self._disconnected(state, request_scope)
                return

    def _disconnected(self, state: RequestState, request_scope: trio.CancelScope) -> None:
        state.disconnected = True
        self.metrics.disconnects.labels(state.current_stage()).inc()
        request_scope.cancel(reason="client disconnected")

    # --- the end -------------------------------------------------------------

    async def _write_error(
        self, state: RequestState, responder: Responder, err: GatewayError
    ) -> None:
        budget = state.budget
        # The reserve is what is kept back for exactly this write.
        limit = max(budget.deadline, trio.current_time()) + budget.reserve
        with trio.move_on_at(limit):
            if not responder.started:
                await responder.error(err, state.response_headers())
            elif not responder.finished:
                framer = state.framer or SSEFramer(state.request_id, state.model, state.created)
                await responder.body(framer.error(err) + DONE, more=False)

    def _count(self, state: RequestState, status: str) -> None:
        m = self.metrics
        m.child(m.requests, state.route.label, state.model_label(), state.channel, status).inc()
        if state.policy_context is not None:  # policy names like "gdpr-redact" are folded
            for policy, action in state.policy_context.actions:
                m.child(m.policy_actions, label_value(policy), action).inc()
        if self.observer is not None:
            self.observer.finish(state, status)
