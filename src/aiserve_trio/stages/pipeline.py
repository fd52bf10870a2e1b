"""One request, end to end: a nursery per request, four stages, one deadline.

::

    receive() --body--> parse --ParsedRequest--> context --Prepared--> inference
        --Delta--> sse --> send()        (context also hands its Prepared to sse)

The stages run as tasks joined by channels (``stages/channel.py``) with buffers of 0 or 1, so a
slow client's backpressure reaches the upstream. Every stage runs in the same
shell (:meth:`Pipeline._stage`): it waits for the stage's input, runs the
stage inside a cancel scope whose deadline is the stage's cumulative cut point
(``Budget.cut``), reports its start, end and expiry to the event hook, closes
the stage's channels when it ends (so end-of-stream needs no sentinel), and
records its failure. A body still arriving is forwarded to the parse stage by a
task that owns ``receive()``. A disconnect cancels the whole request; the pipeline
hears of it through one interface (``server/disconnect.py``): the server's call where
the server makes one (hypercorn through the gateway's seam), a task waiting in
``receive()`` for ``http.disconnect`` anywhere else. (hypercorn's ``send()`` does not
raise after a disconnect, so a loop that only sends would never notice.)

The first failure in pipeline order wins and is written once at the end -- an
HTTP error with the OpenAI envelope before the first byte, the assembler's
final error event and ``[DONE]`` after. The pipeline then returns one
immutable :class:`~.stages.outcome.Outcome`.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import trio

from ..adapters.base import Delta
from ..adapters.sidecalls import SIDE_CALLS, SideCall, SideCalls
from ..cache.service import Cache
from ..core.errors import (
    BodyReadTimeout,
    GatewayError,
    InternalError,
    StageDeadlineExceeded,
    UpstreamError,
)
from ..observability.annotate import TASK_LABEL, UPSTREAM_IO, TaskLabel, UpstreamReads
from ..security.admission import BodyPace
from ..server import Disconnect, ReceiveWatcher, queued
from .billing import local_completion, local_prompt, settle_calls
from .channel import Inbox, Receiver, Sender, open_channel
from .context import ContextStage
from .handoff import hand_on
from .inference import InferenceStage
from .outcome import NULL_REQUEST_HOOK, Outcome, RequestHook
from .parse import ParseStage
from .report import (
    ContextReport,
    InferenceReport,
    ParseReport,
    RequestEnd,
    SSEReport,
    StageReport,
    cache_result,
    needs_local_count,
    needs_local_prompt,
    outcome_of,
    reply_text,
)
from .sse import SSEStage
from .types import STAGES, ParsedRequest, Prepared, RequestInfo, response_headers

if TYPE_CHECKING:
    from ..config import Config
    from ..http.responder import Responder
    from ..http.types import Message, Receive
    from ..security.admission import Admission, BodySlot
    from ..server import ServerCall
    from ..sessions.bus import SessionBus
    from ..sessions.outbox import WriteBack

log = logging.getLogger("aiserve_trio.stages.pipeline")
_ORDER = {name: i for i, name in enumerate(STAGES)}
_In = TypeVar("_In", contravariant=True)


class _Stage(Protocol[_In]):
    name: str
    info: RequestInfo
    #: Channels the stage owns: closed when it ends, whatever happened.
    owned: tuple[Any, ...]

    async def run(self, item: _In, /) -> bool | None:
        """Do the stage's work; True: the reply is complete, stop the other stages."""
        ...

    async def expired(self, item: _In, /) -> None: ...

    def report(self) -> StageReport:
        """What the stage did, as a value (asked once, when it has ended)."""
        ...


class _Run:
    """What the shells and the watcher of one request found out (read after they join)."""

    __slots__ = (
        "capped",
        "context",
        "disconnect_stage",
        "disconnected",
        "error",
        "error_stage",
        "inference",
        "parse",
        "sse",
        "started",
        "times",
    )

    def __init__(self) -> None:
        self.capped = False
        self.error: GatewayError | None = None
        self.error_stage: str | None = None
        self.disconnected = False
        self.disconnect_stage: str | None = None
        #: When each stage got its input; (got input, ended) once it ended.
        self.started: dict[str, float] = {}
        self.times: dict[str, tuple[float, float]] = {}
        #: What each stage reported when it ended (None: it never ran).
        self.parse: ParseReport | None = None
        self.context: ContextReport | None = None
        self.inference: InferenceReport | None = None
        self.sse: SSEReport | None = None

    def keep(self, report: StageReport) -> None:
        """File the report a stage handed back when it ended."""
        if isinstance(report, SSEReport):
            self.sse = report
        elif isinstance(report, InferenceReport):
            self.inference = report
        elif isinstance(report, ContextReport):
            self.context = report
        else:
            self.parse = report

    def fail(self, stage: str, err: GatewayError) -> bool:
        """Record a failure; the earliest stage in pipeline order wins.

        Returns whether ``err`` is now the request's error.
        """
        if self.error_stage is not None and _ORDER[self.error_stage] <= _ORDER[stage]:
            return False
        self.error, self.error_stage = err, stage
        return True

    def furthest(self) -> str:
        return max(self.started, key=_ORDER.__getitem__, default="parse")


class Pipeline:
    """Runs chat requests; built once per app with what every request shares."""

    def __init__(
        self,
        config: Config,
        bus: SessionBus | None,
        *,
        writeback: WriteBack | None = None,
        admission: Admission | None = None,
        hook: RequestHook = NULL_REQUEST_HOOK,
        cache: Cache | None = None,
    ) -> None:
        self.config = config
        self.bus = bus
        self.cache = cache
        self.writeback = writeback
        self.admission = admission
        self.hook = hook
        self._clear_vars = frozenset(config.sessions.clear_vars)

    async def run(
        self,
        info: RequestInfo,
        receive: Receive,
        responder: Responder,
        disconnect: ServerCall | None = None,
    ) -> Outcome:
        """Serve one chat request, report it, and write its turns to the session bus.

        ``disconnect``: when the server calls a function on the client's disconnect
        (``server/disconnect.py``), a request whose body is all there needs no task
        waiting in ``receive()``; None: a watcher task waits there. Never raises a
        GatewayError: it is written instead.
        """
        # The slots a request takes as it goes (a body still arriving, an open
        # stream), all given back when it ends.
        with ExitStack() as slots:
            try:
                outcome = await self._run(info, receive, responder, slots, disconnect)
            finally:
                if disconnect is not None:
                    disconnect.clear()
        self.hook.request_complete(outcome)
        if self.writeback is not None and info.session_id is not None:
            await self.writeback.after_request(outcome)
        return outcome

    async def _run(
        self,
        info: RequestInfo,
        receive: Receive,
        responder: Responder,
        slots: ExitStack,
        disconnect: ServerCall | None,
    ) -> Outcome:
        # Typed by annotation: subscripting a generic to call it costs on every request.
        body_send: Sender[bytes]
        body_recv: Receiver[bytes]
        declared = _declared_length(info.headers)
        # The body hypercorn queued before the app ran: taken now. When it is the whole
        # body and the server will call on a disconnect, no watcher task is needed.
        first = queued(receive) if disconnect is not None else None
        whole = _whole_body(first, declared)
        if whole is not None:
            body_send, body_recv = open_channel(1)
            if whole:
                body_send.send_nowait(whole)
            body_send.close()
        else:
            body_send, body_recv = open_channel(0)
        stages, inboxes = self._open(info, body_recv, responder, slots)
        run = _Run()
        # Annotations for /debug/trace and the request's I/O counts; the stage
        # tasks inherit both (the counter object itself is shared).
        TASK_LABEL.set(label := TaskLabel(info.request_id, info.route.label))
        upstream = UpstreamReads()
        UPSTREAM_IO.set(upstream)
        side = SideCalls()  # a group's extra tries, billed too
        SIDE_CALLS.set(side)
        try:
            if whole is not None:
                # The server calls on a disconnect: the stages' nursery is the request's.
                assert disconnect is not None
                async with trio.open_nursery() as nursery:
                    cancel = nursery.cancel_scope
                    disconnect.set(partial(self._client_gone, run, responder, cancel))
                    await self._stages(run, nursery, stages, inboxes)
            else:
                async with trio.open_nursery() as request_nursery:
                    gone: Disconnect = (
                        disconnect
                        if disconnect is not None
                        else ReceiveWatcher(receive, request_nursery)
                    )
                    request_nursery.start_soon(
                        self._watch,
                        run,
                        receive,
                        declared,
                        body_send,
                        responder,
                        request_nursery.cancel_scope,
                        slots,
                        first,
                        gone,
                    )
                    async with trio.open_nursery() as nursery:
                        await self._stages(run, nursery, stages, inboxes)
                    request_nursery.cancel_scope.cancel(reason="request finished")
            TASK_LABEL.set(label)
        except Exception as exc:  # a bug in a stage: log it, tell the client nothing of it
            log.exception("request %s failed inside the gateway", info.request_id, exc_info=exc)
            run.fail("sse", InternalError("the gateway failed while serving this request"))
        return await self._end(info, responder, run, upstream, side)

    def _open(
        self, info: RequestInfo, body: Receiver[bytes], responder: Responder, slots: ExitStack
    ) -> tuple[
        tuple[ParseStage, ContextStage, InferenceStage, SSEStage],
        tuple[Inbox[ParsedRequest], Inbox[Prepared], Inbox[Delta]],
    ]:
        """The request's four stages joined by their channels, and the inboxes the
        shells wait on for the last three stages' input."""
        req_send: Sender[ParsedRequest]
        req_recv: Receiver[ParsedRequest]
        inf_send: Sender[Prepared]
        inf_recv: Receiver[Prepared]
        plan_send: Sender[Prepared]
        plan_recv: Receiver[Prepared]
        delta_send: Sender[Delta]
        delta_recv: Receiver[Delta]
        req_send, req_recv = open_channel(0)
        inf_send, inf_recv = open_channel(0)
        plan_send, plan_recv = open_channel(1)
        delta_send, delta_recv = open_channel(1)
        cfg = self.config
        sc = cfg.sessions
        parse = ParseStage(info, body, req_send, cfg.limits, self.admission, slots)
        context = ContextStage(
            info,
            req_recv,
            inf_send,
            plan_send,
            self.bus,
            sc.system_template,
            sc.history_turns,
            self._clear_vars,
            self.cache,
        )
        inference = InferenceStage(info, inf_recv, delta_send, self.cache)
        sse = SSEStage(info, delta_recv, plan_recv, responder, cfg.limits)
        return (parse, context, inference, sse), (req_recv, inf_recv, delta_recv)

    async def _end(
        self,
        info: RequestInfo,
        responder: Responder,
        run: _Run,
        upstream: UpstreamReads,
        side: SideCalls,
    ) -> Outcome:
        """After the stages joined: the request's first failure written (unless the
        client left), and its :class:`Outcome` made of what the stages reported."""
        parse = run.parse or ParseReport()
        context = run.context or ContextReport()
        inference = run.inference or InferenceReport()
        sse = run.sse or SSEReport()
        # The request no longer waits for a shared answer (the last to go ends it).
        Cache.release(context.ticket)
        if not run.disconnected:
            if run.error is None and not responder.finished:
                run.fail("sse", InternalError("the request ended without a response"))
            if run.error is not None:
                await self._write_error(info, responder, run.error, context, inference, sse)
        # The one that launched the upstream call pays for all of it (its error written).
        flown = await Cache.paid(context.ticket)
        at = trio.current_time()
        prompt = None
        if needs_local_prompt(sse, flown) and context.prepared is not None:
            # The backend answered but its count never came (the client left, a
            # deadline, a cap, a drop): the request is billed for its prompt as counted
            # here (shielded: the client may be gone).
            prompt = await local_prompt(context.prepared.inference, info.route)
        completion = None
        if needs_local_count(sse, flown):
            completion = await local_completion(reply_text(sse), sse.served_model, info.route)
        extra: list[SideCall] = [*side.calls, *(inference.chain.calls if inference.chain else ())]
        settled = await settle_calls(extra) if extra else ()
        end = RequestEnd(
            at=at,
            error=run.error,
            error_stage=run.error_stage,
            disconnected=run.disconnected,
            disconnect_stage=run.disconnect_stage,
            stages=run.times,
            client_writes=responder.writes,
            client_bytes=responder.bytes_written,
            upstream_reads=upstream.reads,
            upstream_bytes=upstream.bytes,
            prompt_tokens=prompt,
            completion_tokens=completion,
            flown=flown,
            side=settled,
        )
        return outcome_of(info, end, parse, context, inference, sse)

    async def _stages(
        self,
        run: _Run,
        nursery: trio.Nursery,
        stages: tuple[_Stage[Any], _Stage[Any], _Stage[Any], _Stage[Any]],
        inboxes: tuple[Inbox[Any], Inbox[Any], Inbox[Any]],
    ) -> None:
        """Start parse, context and inference in ``nursery``; run sse in this task.

        The last stage runs in the nursery's own task: one task fewer to spawn per
        request, and the same shell, scope and channels. A stage's failure cancels
        ``nursery``.
        """
        parse, context, inference, sse = stages
        cancel = nursery.cancel_scope
        nursery.start_soon(self._stage, run, parse, None, cancel)
        nursery.start_soon(self._stage, run, context, inboxes[0], cancel)
        nursery.start_soon(self._stage, run, inference, inboxes[1], cancel)
        await self._stage(run, sse, inboxes[2], cancel)

    async def _stage(
        self,
        run: _Run,
        stage: _Stage[Any],
        inbox: Inbox[Any] | None,
        cancel: trio.CancelScope,
    ) -> None:
        """The one shell every stage runs in (see the module docstring)."""
        name = stage.name
        hook = self.hook
        TASK_LABEL.set(TaskLabel(stage.info.request_id, stage.info.route.label, name))
        hook.stage_started(name)
        started: float | None = None
        expired: str | None = None
        late = False
        try:
            item: Any = None
            with trio.move_on_at(stage.info.budget.cut(name)) as scope:
                if inbox is not None:
                    try:
                        item = await inbox.receive()
                    except trio.EndOfChannel:
                        return  # an earlier stage failed and says why
                started = run.started[name] = trio.current_time()
                try:
                    capped = await stage.run(item)
                except UpstreamError:
                    if trio.current_time() < scope.deadline:
                        raise
                    # The backend broke off as the cut passed: it was sent the time
                    # left (rounded up) and kept it, and its end reached this task
                    # before the cut's cancel did (a busy loop runs both in one
                    # pass). The deadline ended the call, whichever side saw it first.
                    capped, late = False, True
                if capped:
                    # A cap ended the reply: the upstream call has nothing left to give.
                    run.capped = True
                    cancel.cancel(reason=f"{name} ended the reply")
            # Expired while waiting for its input: the stage before it reports.
            if (scope.cancelled_caught or late) and started is not None:
                expired = name
                await stage.expired(item)
        except trio.BrokenResourceError:
            # The next stage is gone before this one handed on: it was cancelled (the
            # client left, a cap ended the reply) or failed -- recorded on ``run`` before
            # the cancel, so the request ends for that reason. A stage that ran on after
            # the cancel without reaching a checkpoint meets the closed channel first.
            # Without such a reason it is a bug, and the request's shell reports it.
            if not (run.disconnected or run.capped or run.error is not None):
                raise
        except GatewayError as exc:
            if isinstance(exc, StageDeadlineExceeded):
                # Counted under what the answer names: the stage, or the chain step
                # whose share ran out -- also when the scope did not expire (a refusal
                # to start with too little left, a shared flight that was late).
                expired = exc.stage
            if run.fail(name, exc):
                cancel.cancel(reason=f"{name} stage failed")
        finally:
            for channel in stage.owned:
                channel.close()
            ended = trio.current_time()
            if started is not None:
                run.times[name] = (started, ended)
            hook.stage_ended(name, None if started is None else ended - started, expired)
            run.keep(stage.report())

    async def _watch(
        self,
        run: _Run,
        receive: Receive,
        declared: int | None,
        body: Sender[bytes],
        responder: Responder,
        request_scope: trio.CancelScope,
        slots: ExitStack,
        first: Message | None,
        disconnect: Disconnect,
    ) -> None:
        """Own ``receive()``: forward the body, then have ``disconnect`` tell of a disconnect.

        ``first``: a message already received (taken before the stages started).

        A body that does not come in one piece takes one of the worker's slots
        for bodies arriving (``limits.max_receiving``) until it is in: slow
        uploads get their own, smaller share of the in-flight slots, and a
        request whose body came at once never needs one. hypercorn hands even a
        body that came at once over as the whole body with ``more_body`` set and
        an empty last message: a body that already has its declared
        ``Content-Length`` is in, takes no slot, and is handed on as complete
        without waiting for that last message.
        """
        slot: BodySlot | None = None
        lim = self.config.limits
        pace = BodyPace(
            trio.current_time(),
            idle=lim.body_read_timeout_ms / 1000.0,
            total=lim.body_total_timeout_ms / 1000.0,
            min_rate=lim.body_min_rate,
        )
        async with body:
            while True:
                msg = first if first is not None else await _next_message(receive, pace)
                first = None
                if isinstance(msg, BodyReadTimeout):  # a slowloris body: refuse it, free the slot
                    if run.fail("parse", msg):
                        request_scope.cancel(reason="request body too slow")
                    return
                kind = msg["type"]
                if kind == "http.disconnect":
                    self._disconnected(run, request_scope)
                    return
                if kind != "http.request":
                    continue
                chunk = msg.get("body", b"")
                pace.add(len(chunk))
                if (
                    slot is None
                    and msg.get("more_body", False)
                    and pace.received != declared
                    and self.admission is not None
                ):
                    try:
                        slot = slots.enter_context(self.admission.body())
                    except GatewayError as err:
                        if run.fail("parse", err):
                            request_scope.cancel(reason="too many bodies arriving")
                        return
                if chunk:
                    try:
                        await hand_on(body, chunk)
                    except trio.BrokenResourceError:
                        # The parse stage refused the body and ends the request:
                        # reading the rest would only buffer what was refused.
                        return
                # At its declared length the body is in: parse goes on now, not
                # after hypercorn's empty last message (read below, with the rest).
                if not msg.get("more_body", False) or pace.received == declared:
                    break
        if slot is not None:
            slot.release()  # the body is in: the slot goes to the next upload
        disconnect.set(partial(self._client_gone, run, responder, request_scope))

    def _client_gone(
        self, run: _Run, responder: Responder, request_scope: trio.CancelScope
    ) -> None:
        """The stream closed: a disconnect, unless the reply was done (hypercorn also
        reports the end of a completed exchange this way)."""
        if not responder.finished:
            self._disconnected(run, request_scope)

    @staticmethod
    def _disconnected(run: _Run, request_scope: trio.CancelScope) -> None:
        run.disconnected = True
        run.disconnect_stage = run.furthest()
        request_scope.cancel(reason="client disconnected")

    async def _write_error(
        self,
        info: RequestInfo,
        responder: Responder,
        err: GatewayError,
        context: ContextReport,
        inference: InferenceReport,
        sse: SSEReport,
    ) -> None:
        budget = info.budget
        # The reserve is what is kept back for exactly this write.
        limit = max(budget.deadline, trio.current_time()) + budget.reserve
        with trio.move_on_at(limit):
            if not responder.started:
                cache = cache_result(context, inference)
                chain = inference.chain
                steps = chain.names if chain is not None else None
                headers = response_headers(info, context.prepared, cache=cache, steps=steps)
                await responder.error(err, headers)
            elif not responder.finished:
                tail = sse.fail(err) if sse.fail is not None else None
                if tail is None:  # the head went out without a framed event
                    framer = info.route.codec.framer(info.request_id, "", info.created, None, False)
                    tail = framer.fail(err)
                await responder.body(tail, more=False)


async def _next_message(receive: Receive, pace: BodyPace) -> Message | BodyReadTimeout:
    """The next message of a body still arriving: one the server has already queued,
    taken without a wait or a deadline; else awaited until ``pace`` says the body is
    too slow, and then the error that refuses it."""
    ready = queued(receive)
    if ready is not None:
        return ready
    limit, why = pace.deadline(trio.current_time())
    with trio.move_on_at(limit):
        return await receive()
    return BodyReadTimeout(why)


def _whole_body(first: Message | None, declared: int | None) -> bytes | None:
    """The request's body when ``first`` holds all of it (the last part, or the
    declared ``Content-Length``); None when more may follow."""
    if first is None or first["type"] != "http.request":
        return None
    body: bytes = first.get("body", b"")
    return body if not first.get("more_body", False) or len(body) == declared else None


def _declared_length(headers: dict[str, str]) -> int | None:
    """The request's ``Content-Length``; None when it has none (chunked) or not a number."""
    value = headers.get("content-length")
    return int(value) if value is not None and value.isdigit() else None
