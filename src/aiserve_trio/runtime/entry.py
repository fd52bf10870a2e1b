"""The per-request entry: every HTTP request's way in, and the chat routes' start.

:meth:`Entry.serve` takes a request to the current runtime's endpoint table
(``http/endpoints.py``): CORS preflights first, then the gate -- the key, a
chat request's spend budget, admission (a fast 503 or 429 before any body is
read), the stream slot -- and then the endpoint's handler. Every error a client
sees is the API's error envelope with a correct status.

:meth:`Entry.chat` is a chat route's handler (``runtime/builder.py`` binds it to a
runtime's parts): the request's id, its deadline, channel and session, then the
:class:`~.pipeline.Pipeline`; :meth:`Entry.embed` serves an embeddings route.
"""

from __future__ import annotations

import secrets
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from ..core.budgets import TIMEOUT_HEADER, effective_timeout_ms, plan
from ..core.errors import BadRequest, GatewayError, PayloadTooLarge, Shed
from ..http.endpoints import Admission, Auth, Request
from ..http.responder import Responder
from ..http.sse import SHUTTING_DOWN, shutdown_event
from ..http.turns import CURRENT_PLACE, Place, Turn, Turns
from ..http.types import ARRIVED, TURN, TURNS
from ..observability.annotate import TASK_LABEL, TaskLabel
from ..observability.metrics import status_label
from ..server import server_call
from ..sessions.bus import check_session_id
from ..stages.outcome import Outcome
from ..stages.types import RequestInfo

if TYPE_CHECKING:
    from ..config import Config
    from ..http.endpoints import Endpoint
    from ..http.types import Receive, Scope, Send
    from ..observability.observer import RequestObserver
    from ..observability.tracing import Tracing
    from ..security.auth import Principal
    from ..stages.types import Route
    from .generation import Generations, Parts, Runtime


@dataclass(frozen=True, slots=True, eq=False)
class Entry:
    """Serves requests; the observer and tracing are the gateway's."""

    observer: RequestObserver
    tracing: Tracing
    #: The worker's queue of chat requests starting (``[deadline] max_starting``), when
    #: the server hands none (hypercorn as shipped, tests).
    turns: Turns = field(default_factory=Turns)
    #: The queue the last chat request used (the server's, with the seam): the gauges'.
    _used: list[Turns] = field(default_factory=list)

    def turns_now(self) -> tuple[int, int, int]:
        """(bound now, starting, waiting) of the worker's queue, for the gauges."""
        turns = self._used[0] if self._used else self.turns
        return turns.limit, turns.active, turns.waiting

    async def serve(
        self, generations: Generations, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """Serve one HTTP request with the runtime current when it arrives."""
        # The deadline counts from here, auth included: when the server read the request's
        # head (the seam's stamp), else now.
        now = trio.current_time()
        arrival = arrived(scope, now)
        if arrival < now:
            self.observer.server_wait(now - arrival)
        # The runtime this request uses from start to end, whatever a reload does meanwhile.
        rt = generations.current
        rt.enter()
        try:
            await self._serve(rt, arrival, scope, receive, send)
        finally:
            rt.leave()

    async def _serve(
        self, rt: Runtime, arrival: float, scope: Scope, receive: Receive, send: Send
    ) -> None:
        path: str = scope["path"]
        endpoint, params = rt.endpoints.resolve(scope["method"], path)
        # For /debug/trace and /debug/profile: what this task serves (its own context copy).
        TASK_LABEL.set(TaskLabel(None, endpoint.name))
        # Chat streams are bounded by the sse stage's own write deadline instead
        # of a cancel scope around every write.
        chat = endpoint.auth is Auth.CHAT
        route = rt.routes.get(path) if chat else None
        if route is None or route.config.kind == "embeddings":
            # Only a chat route's request keeps a turn the server took before reading it
            # (server/preread.py): everything else is not what the queue is for.
            _give_back_turn(scope)
        write_timeout = None if chat else rt.config.limits.write_timeout_ms / 1000.0
        hdrs = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        cors = rt.cors
        extra = cors.response_headers(hdrs.get("origin")) if cors is not None else None
        responder = Responder(send, write_timeout, extra, endpoint.errors)
        principal: Principal | None = None
        handled = False
        if cors is not None and cors.is_preflight(scope["method"], hdrs):
            # Before the gate: a browser sends no key with a preflight.
            try:
                await responder.start(204, cors.preflight(hdrs))
                await responder.body(b"", more=False)
            except GatewayError as err:
                await responder.error(err)
            return
        try:
            request = Request(
                scope, scope["method"], path, hdrs, receive, responder, arrival, params
            )
            # The key first: a request without a valid one takes no slot.
            request.principal = principal = p = await rt.gate.authenticate(endpoint, request)
            # A chat request holds its maximum cost against its budgets while it runs.
            hold: AbstractContextManager[object] = nullcontext()
            if chat:  # a spent budget takes no slot either
                length = hdrs.get("content-length", "")
                size = int(length) if length.isdigit() else None
                hold = await rt.gate.within_budget(p, _tenant_of(rt, path, p), path, size)
            # A fast 503 (429) before any body is read.
            with hold, rt.gate.admit(endpoint, scope, hdrs), rt.gate.stream_slot(endpoint, p):
                handled = True  # from here the handler reports how the request ended
                await endpoint.handler(request)
        except GatewayError as err:
            if not responder.started:
                await responder.error(err)
            if chat and not handled:
                # A wrong key's address: the audit log counts those per address.
                client = rt.gate.client_address(scope, hdrs) if err.status == 401 else None
                self._refused(rt, endpoint, principal, hdrs, err, arrival, client)
        except BaseException:
            # Cancelled by hypercorn after its graceful_timeout: end an open stream
            # with a final event instead of tearing the connection.
            if responder.started and not responder.finished:
                with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                    route = rt.routes.get(path)
                    if route is not None:  # the API's own failure event
                        last = route.codec.framer("", "", 0, None, False).fail(SHUTTING_DOWN)
                    else:
                        last = shutdown_event(session_stream=endpoint.admission is Admission.STREAM)
                    await responder.body(last, more=False)
            raise

    def _refused(
        self,
        rt: Runtime,
        endpoint: Endpoint,
        principal: Principal | None,
        headers: dict[str, str],
        err: GatewayError,
        arrival: float,
        client: str | None = None,
    ) -> None:
        """A chat request the gate refused (key, rate, budget): the audit log's row
        (``client``: a wrong key's address)."""
        now = trio.current_time()
        self.observer.request_refused(
            Outcome(
                request_id=f"refused-{secrets.token_hex(12)}",
                route=endpoint.name,
                channel=headers.get("x-channel", "none")[:16].strip().lower() or "none",
                arrival=arrival,
                ended=now,
                status=status_label(err.status),
                error=err,
                error_stage="gate",
                tenant=_tenant_of(rt, endpoint.path, principal),
                key_id=principal.key_id if principal is not None else None,
                client=client,
            )
        )

    async def chat(self, rt: Parts, route: Route, request: Request) -> None:
        """A chat route's handler: the deadline, channel and session, then the pipeline."""
        cfg = rt.config
        d = cfg.deadline
        rd = route.config.deadline
        headers = request.headers
        # A reply's id (and the request's ``X-Request-Id``) as the client's API spells it.
        request_id = route.codec.id_prefix + secrets.token_hex(12)
        try:
            timeout_ms = effective_timeout_ms(
                headers.get(TIMEOUT_HEADER),
                default_ms=rd.default_ms or d.default_ms,
                max_ms=rd.max_ms or d.max_ms,
                reserve_ms=d.reserve_ms,
            )
            channel = _channel(cfg, headers.get("x-channel"))
            sid = headers.get("x-session-id")
            session_id = check_session_id(sid) if sid is not None else None
            if session_id is None and route.codec.stored is not None:
                # A response's turns are stored under its id, for `previous_response_id`.
                session_id = request_id
            declared = headers.get("content-length")
            limit = cfg.limits.max_body_bytes
            if declared is not None and declared.isdigit() and int(declared) > limit:
                # Shed before reading a byte of a body that cannot be accepted.
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            budget = plan(
                request.arrival,
                timeout_ms,
                reserve_ms=d.reserve_ms,
                min_inference_ms=d.min_inference_ms,
                context=cfg.budgets.context,
                inference=cfg.budgets.inference,
                queue_share=d.queue_share,
                ttft_ms=d.ttft_ms,
            )
            if trio.current_time() >= budget.queue_end:
                # It waited in the server (its head read, its app not yet started) past
                # its queue budget: shed now, before a byte of its body is read.
                raise Shed(
                    "queue",
                    "the gateway is overloaded: the request waited past its queue budget "
                    "before the gateway could start it",
                )
        except GatewayError as err:
            _give_back_turn(request.scope)  # refused before it started: not its turn's use
            await request.responder.error(err, [(b"x-request-id", request_id.encode())])
            now = trio.current_time()
            refused = Outcome(
                request_id=request_id,
                route=route.label,
                channel="none",
                arrival=request.arrival,
                ended=now,
                status=status_label(err.status),
                error=err,
                error_stage="parse",
            )
            self.observer.request_complete(refused)
            return
        info = RequestInfo(
            request_id=request_id,
            route=route,
            budget=budget,
            created=int(time.time()),
            channel=channel,
            session_id=session_id,
            tenant=rt.gate.tenant(request.principal, route.tenant),
            headers=headers,
            trace=self.tracing.start(route.label, headers, request.arrival),
            key_id=request.principal.key_id if request.principal is not None else None,
            models=request.principal.models if request.principal is not None else None,
            key_max_streams=request.principal.max_streams if request.principal else 0,
        )
        # Its place in the worker's queue of requests starting (http/turns.py): the parse
        # stage takes its turn once the body is in (or has the one the server took before
        # reading it: server/preread.py), the inference stage gives it back.
        extensions = request.scope.get("extensions") or {}
        turns = extensions.get(TURNS)
        if not isinstance(turns, Turns):
            turns = self.turns
        turns.bound(d.min_starting, d.max_starting)
        used = self._used
        if not used or used[0] is not turns:
            used[:] = [turns]
        turn = extensions.pop(TURN, None)
        place = Place(turns, turn if isinstance(turn, Turn) else None)
        held = CURRENT_PLACE.set(place)
        try:
            outcome = await rt.pipeline.run(
                info, request.receive, request.responder, server_call(request.scope)
            )
        finally:
            CURRENT_PLACE.reset(held)
            place.release()
        await rt.gate.after_chat(request.principal, outcome)

    async def embed(self, rt: Parts, route: Route, request: Request) -> None:
        """An embeddings route's handler."""
        outcome = await rt.embeddings.serve(route, request)
        await rt.gate.after_chat(request.principal, outcome)


def arrived(scope: Scope, now: float) -> float:
    """When the request arrived: the server's stamp of its head's read
    (``http.types.ARRIVED``, the seam's), or ``now`` without one (hypercorn as shipped,
    another server) or with one that is not a time before ``now``."""
    extensions = scope.get("extensions")
    at = extensions.get(ARRIVED) if extensions else None
    if type(at) is float and at <= now:
        return at
    return now


def _give_back_turn(scope: Scope) -> None:
    """Give back the turn the server took for this request before reading it, if any."""
    extensions = scope.get("extensions")
    turn = extensions.pop(TURN, None) if extensions else None
    if isinstance(turn, Turn):
        turn.release()


def _tenant_of(rt: Runtime, path: str, principal: Principal | None) -> str:
    """The tenant a request to ``path`` acts for: the key's, else its route's."""
    route = rt.routes.get(path)
    fallback = route.tenant if route is not None else rt.config.server.default_tenant
    return rt.gate.tenant(principal, fallback)


def _channel(cfg: Config, value: str | None) -> str:
    channels = cfg.server.channels
    if value is None:
        return channels[0]
    channel = value.strip().lower()
    if channel not in channels:
        raise BadRequest(
            f"`X-Channel` must be one of {', '.join(channels)}; got {value[:40]!r}",
            param="X-Channel",
            code="invalid_channel",
        )
    return channel
