"""HTTP endpoints of the session bus.

- ``GET /v1/sessions/{id}``: the session's turns and variables (JSON).
- ``PUT /v1/sessions/{id}/vars``: merge a JSON object of string variables.
- ``GET /v1/sessions/{id}/events``: ``text/event-stream`` for ``EventSource``.
  It replays the last ``replay_events`` turns (or, with ``Last-Event-ID``, the
  turns after that id), then follows the session live. Each turn is one event
  (``id:`` = the bus's event id, ``event: turn``, ``data:`` = the turn as JSON),
  so a reconnecting browser resumes without gaps or duplicates. Turns appear
  **turn by turn**: a reply is written to the bus once it has been delivered,
  not token by token. Heartbeats are ``: ping`` comments. The stream ends
  cleanly (``event: close``) when the app shuts down or after ``events_max_s``;
  the browser then reconnects with ``Last-Event-ID``.

The tenant is always derived server-side (``[server] default_tenant`` until
authentication supplies one), never from the session id.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

import msgspec
import trio

from ..api import encoder
from ..errors import (
    BadRequest,
    StageDeadlineExceeded,
    UnsupportedMediaType,
)
from ..http.body import read_body
from ..http.sse import CLOSE, PING, RETRY, bus_error_event, session_event
from ..http.types import JSON_HEADERS, SSE_HEADERS
from ..slices import Steps, run_sliced
from .bus import (
    Event,
    SessionBus,
    SessionBusError,
    Turn,
    check_session_id,
    check_vars,
    parse_event_id,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from ..config import Config
    from ..http.endpoints import Request

_T = TypeVar("_T")
MAX_VARS_BODY = 65_536
_vars_decoder = msgspec.json.Decoder(dict[str, str])


class SessionView(msgspec.Struct, kw_only=True):
    id: str
    turns: list[Turn]
    variables: dict[str, str]


class VarsUpdated(msgspec.Struct, kw_only=True):
    id: str
    updated: list[str]


def frame_events(events: list[Event]) -> bytes:
    """Turns as SSE events (sans-IO)."""
    return b"".join(session_event(ev.id, encoder.encode(ev.turn)) for ev in events)


def session_id(request: Request) -> str:
    """The session id of the path, validated.

    Raises:
        BadRequest: the id is malformed, or a stored response's, which these
            endpoints neither read nor write (``param`` is ``session_id``).
    """
    return check_session_id(request.params["id"], "session_id")


class SessionEndpoints:
    """Serves ``/v1/sessions/{id}``, ``.../vars`` and ``.../events`` for one app.

    Each handler acts for ``tenant(request)``: the key's tenant, never one
    the client names.
    """

    def __init__(
        self,
        config: Config,
        bus: SessionBus,
        closing: Sequence[trio.Event],
        tenant: Callable[[Request], str],
        redact: Callable[[dict[str, str]], Steps[dict[str, str]]] | None = None,
    ) -> None:
        """Args:
        closing: any of these set ends the live event streams cleanly (the app
            shuts down; the configuration they were opened with was replaced).
        tenant: the tenant a request acts for.
        redact: applied to variables before they are stored (the data
            protection of the routes that share the sessions).
        """
        self.redact = redact
        self.config = config
        self.bus = bus
        self.closing = closing
        self.tenant = tenant
        # Sessions are shared by all routes; writes from here live as long as the longest.
        self.ttl = max((r.context_ttl for r in config.routes), default=86_400)
        d = config.deadline
        self.call_budget = d.default_ms * config.budgets.context / 1000.0

    async def _bounded(self, call: Callable[[], Awaitable[_T]]) -> _T:
        with trio.move_on_after(self.call_budget):
            return await call()
        raise StageDeadlineExceeded("context", "the session bus did not answer in time")

    async def get(self, request: Request) -> None:
        """``GET /v1/sessions/{id}``: the session's turns and variables."""
        sid, tenant = session_id(request), self.tenant(request)
        turns = self.config.sessions.max_turns
        s = await self._bounded(lambda: self.bus.load(tenant, sid, turns, self.ttl))
        view = SessionView(id=sid, turns=s.turns, variables=s.variables)
        await request.responder.complete(200, JSON_HEADERS, encoder.encode(view))

    async def put_vars(self, request: Request) -> None:
        """``PUT /v1/sessions/{id}/vars``: merge a JSON object of string variables."""
        sid, tenant = session_id(request), self.tenant(request)
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise UnsupportedMediaType("the body must be application/json")
        body: bytes | None = None
        with trio.move_on_after(self.call_budget) as scope:
            body = await read_body(request.receive, MAX_VARS_BODY)
        if scope.cancelled_caught:
            raise StageDeadlineExceeded("parse", "the request body did not arrive in time")
        if body is None:
            return  # the client went away
        try:
            values = _vars_decoder.decode(body)
        except msgspec.ValidationError as exc:
            raise BadRequest(f"expected a JSON object of strings: {exc}", param="body") from None
        except msgspec.DecodeError:
            raise BadRequest("the body is not valid JSON", param="body") from None
        check_vars(values, "body")
        if self.redact is not None:
            values = await run_sliced(self.redact(values))
        await self._bounded(lambda: self.bus.set_vars(tenant, sid, values, self.ttl))
        out = VarsUpdated(id=sid, updated=sorted(values))
        await request.responder.complete(200, JSON_HEADERS, encoder.encode(out))

    async def events(self, request: Request) -> None:
        """``GET /v1/sessions/{id}/events``: the session's turns as an event stream."""
        sid, tenant = session_id(request), self.tenant(request)
        responder, receive = request.responder, request.receive
        cfg = self.config.sessions
        after = request.headers.get("last-event-id") or None
        if after is not None:
            parse_event_id(after)
        # The replay happens before the head, so a bus that is down is a 503, not a stream.
        first = await self._bounded(
            lambda: self.bus.read(tenant, sid, after, limit=cfg.replay_events, block_ms=0)
        )
        await responder.start(200, [*SSE_HEADERS, (b"x-aiserve-session-events", b"turn")])
        await responder.body(RETRY + frame_events(first))
        cursor = first[-1].id if first else (after or "0-0")
        gone = False
        tail = CLOSE

        async def watch_disconnect(cancel: trio.CancelScope) -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            cancel.cancel(reason="client disconnected")

        async def watch_closing(event: trio.Event, cancel: trio.CancelScope) -> None:
            await event.wait()
            cancel.cancel(reason="app shutting down or configuration replaced")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_disconnect, nursery.cancel_scope)
            for event in self.closing:
                nursery.start_soon(watch_closing, event, nursery.cancel_scope)
            with trio.move_on_after(cfg.events_max_s):
                while True:
                    try:
                        events = await self.bus.read(
                            tenant, sid, cursor, limit=cfg.replay_events, block_ms=cfg.heartbeat_ms
                        )
                    except SessionBusError as err:
                        tail = bus_error_event(err)
                        break
                    if events:
                        cursor = events[-1].id
                        await responder.body(frame_events(events))
                    else:
                        await responder.body(PING)
            nursery.cancel_scope.cancel(reason="event stream ended")
        if not gone:
            with trio.move_on_after(1.0):
                await responder.body(tail, more=False)
