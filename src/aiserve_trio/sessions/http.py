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

from ..api import encoder, error_json
from ..errors import (
    BadRequest,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    StageDeadlineExceeded,
    UnsupportedMediaType,
)
from ..stages.request import JSON_HEADERS, SSE_HEADERS
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
    from collections.abc import Awaitable, Callable

    from ..config import Config
    from ..stages.request import Receive, Responder

_T = TypeVar("_T")
PREFIX = "/v1/sessions/"
MAX_VARS_BODY = 65_536
_vars_decoder = msgspec.json.Decoder(dict[str, str])


class SessionView(msgspec.Struct, kw_only=True):
    id: str
    turns: list[Turn]
    variables: dict[str, str]


class VarsUpdated(msgspec.Struct, kw_only=True):
    id: str
    updated: list[str]


def frame_event(ev: Event) -> bytes:
    """One turn as an SSE event (sans-IO)."""
    return b"id: %s\nevent: turn\ndata: %s\n\n" % (ev.id.encode(), encoder.encode(ev.turn))


def frame_error(err: SessionBusError) -> bytes:
    """A bus failure as the stream's last event (a named event, so EventSource's
    own ``error`` handler is not confused with it)."""
    return b"event: bus_error\ndata: %s\n\n" % error_json(err)


PING = b": ping\n\n"
CLOSE = b"event: close\ndata: {}\n\n"
#: Browsers wait this long before reconnecting an ended EventSource.
RETRY = b"retry: 1000\n\n"


def split_path(path: str) -> tuple[str, str]:
    """``/v1/sessions/ID[/what]`` -> ``(ID, what)``; the id is validated.

    Raises:
        NotFound: not a session endpoint.
        BadRequest: the id is malformed.
    """
    rest = path[len(PREFIX) :]
    sid, _, what = rest.partition("/")
    if what not in ("", "vars", "events") or not sid:
        raise NotFound(f"no route serves {path[:200]}")
    try:
        check_session_id(sid)
    except BadRequest as exc:
        exc.param = "session_id"
        raise
    return sid, what


class SessionEndpoints:
    """Serves ``/v1/sessions/...`` for one app."""

    def __init__(self, config: Config, bus: SessionBus, closing: trio.Event) -> None:
        self.config = config
        self.bus = bus
        self.closing = closing
        self.tenant = config.server.default_tenant
        # Sessions are shared by all routes; writes from here live as long as the longest.
        self.ttl = max((r.context_ttl for r in config.routes), default=86_400)
        d = config.deadline
        self.call_budget = d.default_ms * config.budgets.context / 1000.0

    async def handle(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        receive: Receive,
        responder: Responder,
    ) -> None:
        """Serve one request; GatewayErrors propagate for the caller to render."""
        sid, what = split_path(path)
        allowed = "PUT" if what == "vars" else "GET"
        if method != allowed:
            raise MethodNotAllowed(
                f"{method} is not allowed on {path[:200]}; use {allowed}",
                headers={"Allow": allowed},
            )
        if what == "vars":
            await self._put_vars(sid, headers, receive, responder)
        elif what == "events":
            await self._events(sid, headers, receive, responder)
        else:
            s = await self._bounded(
                lambda: self.bus.load(self.tenant, sid, self.config.sessions.max_turns, self.ttl)
            )
            view = SessionView(id=sid, turns=s.turns, variables=s.variables)
            await responder.complete(200, JSON_HEADERS, encoder.encode(view))

    async def _bounded(self, call: Callable[[], Awaitable[_T]]) -> _T:
        with trio.move_on_after(self.call_budget):
            return await call()
        raise StageDeadlineExceeded("context", "the session bus did not answer in time")

    async def _put_vars(
        self, sid: str, headers: dict[str, str], receive: Receive, responder: Responder
    ) -> None:
        ctype = headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise UnsupportedMediaType("the body must be application/json")
        body = bytearray()
        with trio.move_on_after(self.call_budget) as scope:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return
                body += msg.get("body", b"")
                if len(body) > MAX_VARS_BODY:
                    raise PayloadTooLarge(f"session variables exceed {MAX_VARS_BODY} bytes")
                if not msg.get("more_body", False):
                    break
        if scope.cancelled_caught:
            raise StageDeadlineExceeded("parse", "the request body did not arrive in time")
        try:
            values = _vars_decoder.decode(body)
        except msgspec.ValidationError as exc:
            raise BadRequest(f"expected a JSON object of strings: {exc}", param="body") from None
        except msgspec.DecodeError:
            raise BadRequest("the body is not valid JSON", param="body") from None
        check_vars(values, "body")
        await self._bounded(lambda: self.bus.set_vars(self.tenant, sid, values, self.ttl))
        out = VarsUpdated(id=sid, updated=sorted(values))
        await responder.complete(200, JSON_HEADERS, encoder.encode(out))

    async def _events(
        self, sid: str, headers: dict[str, str], receive: Receive, responder: Responder
    ) -> None:
        cfg = self.config.sessions
        after = headers.get("last-event-id") or None
        if after is not None:
            parse_event_id(after)
        # The replay happens before the head, so a bus that is down is a 503, not a stream.
        first = await self._bounded(
            lambda: self.bus.read(self.tenant, sid, after, limit=cfg.replay_events, block_ms=0)
        )
        await responder.start(200, [*SSE_HEADERS, (b"x-aiserve-session-events", b"turn")])
        await responder.body(RETRY + b"".join(frame_event(e) for e in first))
        cursor = first[-1].id if first else (after or "0-0")
        gone = False
        tail = CLOSE

        async def watch_disconnect(cancel: trio.CancelScope) -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            cancel.cancel(reason="client disconnected")

        async def watch_closing(cancel: trio.CancelScope) -> None:
            await self.closing.wait()
            cancel.cancel(reason="app shutting down")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_disconnect, nursery.cancel_scope)
            nursery.start_soon(watch_closing, nursery.cancel_scope)
            with trio.move_on_after(cfg.events_max_s):
                while True:
                    try:
                        events = await self.bus.read(
                            self.tenant,
                            sid,
                            cursor,
                            limit=cfg.replay_events,
                            block_ms=cfg.heartbeat_ms,
                        )
                    except SessionBusError as err:
                        tail = frame_error(err)
                        break
                    if events:
                        cursor = events[-1].id
                        await responder.body(b"".join(frame_event(e) for e in events))
                    else:
                        await responder.body(PING)
            nursery.cancel_scope.cancel(reason="event stream ended")
        if not gone:
            with trio.move_on_after(1.0):
                await responder.body(tail, more=False)
