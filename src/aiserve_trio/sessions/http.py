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

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import msgspec
import trio

from ..core.api import encoder
from ..core.errors import (
    BadRequest,
    StageDeadlineExceeded,
    UnsupportedMediaType,
)
from ..core.slices import Steps, run_sliced
from ..http.body import read_body
from ..http.sse import CLOSE, PING, RETRY, bus_error_event, session_event
from ..http.types import JSON_HEADERS, SSE_HEADERS
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
    from collections.abc import Awaitable, Sequence

    from ..config import Config
    from ..http.endpoints import Request

_T = TypeVar("_T")
MAX_VARS_BODY = 65_536
_vars_decoder = msgspec.json.Decoder(dict[str, str])


#: Applies data protection to a batch of texts (a session's variables, its turns' texts).
Redactor = Callable[[dict[str, str]], Steps[dict[str, str]]]


@dataclass(frozen=True, slots=True)
class ReadScope:
    """What one key sees of its tenant's sessions (issue 51, item 5).

    ``channels``: only turns written on these channels (None: every channel) -- a key
    reads a session only through the channels it may use. ``redact``: applied to the
    turns' texts and the variables on the way out (None: as stored) -- a key whose
    routes all redact never reads a turn or a variable they would not have let through.
    """

    channels: frozenset[str] | None = None
    redact: Redactor | None = None


EVERYTHING = ReadScope()


def redact_turns(turns: list[Turn], redact: Redactor) -> Steps[list[Turn]]:
    """``turns`` with their contents and tool calls' arguments through ``redact``, in steps.

    The texts are named by position (``"3"``, ``"3.0"``): names no variable may have,
    so ``[sessions] clear_vars`` never leaves one of them clear.
    """
    texts: dict[str, str] = {}
    for i, turn in enumerate(turns):
        texts[str(i)] = turn.content
        for j, call in enumerate(turn.tool_calls or ()):
            texts[f"{i}.{j}"] = call.function.arguments
    clean = yield from redact(texts)
    out = []
    for i, turn in enumerate(turns):
        calls = None
        if turn.tool_calls is not None:
            calls = [
                msgspec.structs.replace(
                    call,
                    function=msgspec.structs.replace(
                        call.function, arguments=clean[f"{i}.{j}"]
                    ),
                )
                for j, call in enumerate(turn.tool_calls)
            ]
        out.append(msgspec.structs.replace(turn, content=clean[str(i)], tool_calls=calls))
    return out


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
        redact: Redactor | None = None,
        scope: Callable[[Request], ReadScope] | None = None,
    ) -> None:
        """Args:
        closing: any of these set ends the live event streams cleanly (the app
            shuts down; the configuration they were opened with was replaced).
        tenant: the tenant a request acts for.
        redact: applied to variables before they are stored (the data
            protection of the routes that share the sessions).
        scope: what the request's key sees of a session (every turn, as stored,
            when None).
        """
        self.redact = redact
        self.scope = scope
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
        """``GET /v1/sessions/{id}``: the session's turns and variables, as the
        request's key may see them (:class:`ReadScope`)."""
        sid, tenant = session_id(request), self.tenant(request)
        seen = self.scope(request) if self.scope is not None else EVERYTHING
        turns = self.config.sessions.max_turns
        s = await self._bounded(lambda: self.bus.load(tenant, sid, turns, self.ttl))
        kept = [t for t in s.turns if seen.channels is None or t.channel in seen.channels]
        variables = s.variables
        if seen.redact is not None:
            kept = await run_sliced(redact_turns(kept, seen.redact))
            variables = await run_sliced(seen.redact(variables))
        view = SessionView(id=sid, turns=kept, variables=variables)
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
        seen = self.scope(request) if self.scope is not None else EVERYTHING

        async def framed(events: list[Event]) -> bytes:
            """The events this key may see, as it may see them."""
            if seen.channels is not None:
                events = [e for e in events if e.turn.channel in seen.channels]
            if seen.redact is not None and events:
                turns = await run_sliced(redact_turns([e.turn for e in events], seen.redact))
                events = [Event(id=e.id, turn=t) for e, t in zip(events, turns, strict=True)]
            return frame_events(events)

        after = request.headers.get("last-event-id") or None
        if after is not None:
            parse_event_id(after)
        # The replay happens before the head, so a bus that is down is a 503, not a stream.
        first = await self._bounded(
            lambda: self.bus.read(tenant, sid, after, limit=cfg.replay_events, block_ms=0)
        )
        await responder.start(200, [*SSE_HEADERS, (b"x-aiserve-session-events", b"turn")])
        await responder.body(RETRY + await framed(first))
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
                        cursor = events[-1].id  # past the turns this key does not see too
                        await responder.body(await framed(events) or PING)
                    else:
                        await responder.body(PING)
            nursery.cancel_scope.cancel(reason="event stream ended")
        if not gone:
            with trio.move_on_after(1.0):
                await responder.body(tail, more=False)
