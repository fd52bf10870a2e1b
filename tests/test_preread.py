"""While the worker's queue of requests starting is full, an HTTP/1.1 request is left
unread until its turn comes (``server/preread.py``): unread it is bytes in the kernel,
not objects the collector walks. Its deadline still counts from when it came, a health
check is read at once, a turn no request took is given back, and the entry uses the
turn it was handed instead of queueing again."""

from __future__ import annotations

import json
import math
from typing import Any

import h11
import pytest
import trio

from aiserve_trio.http.turns import Place, Turn, Turns
from aiserve_trio.http.types import ARRIVED, TURN, TURNS
from aiserve_trio.runtime.asgi import App

from .asgi_client import Exchange, chat_body, make_scope
from .test_coalesce import HEAD, Scope, body, exchange, server
from .test_fair_turns import turns_app

pytestmark = pytest.mark.seam


def post(path: bytes) -> bytes:
    return b"POST /%s HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}" % path


async def answer(stream: trio.SocketStream) -> bytes:
    got = b""
    while b"\r\n\r\nok" not in got:
        data = await stream.receive_some(65536)
        assert data, f"closed after {got!r}"
        got += data
    return got


class TurnApp:
    """An ASGI app on the worker's queue, limited to one turn: a POST takes its turn (or
    uses the one handed to it); ``/hold`` keeps it until ``release`` is set; ``/linger``
    sends its whole answer but ends the exchange only once ``lingered`` is set. ``seen``: per
    path, (arrival stamp, app start, whether a turn was handed); ``turns``: the worker's."""

    def __init__(self) -> None:
        self.held = trio.Event()
        self.release = trio.Event()
        self.lingered = trio.Event()
        self.seen: dict[str, tuple[float, float, bool]] = {}
        self.turns: Turns | None = None

    def taken(self) -> int:
        """Turns the worker's queue has out now."""
        assert self.turns is not None
        return self.turns.active

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        ext = scope["extensions"]
        turns = self.turns = ext[TURNS]
        turns.limit = 1
        pre = ext.pop(TURN, None)
        self.seen[scope["path"]] = (ext[ARRIVED], trio.current_time(), pre is not None)
        if scope["method"] == "POST":
            place = Place(turns, pre)
            await place.take(math.inf, math.inf)
            if scope["path"] == "/hold":
                self.held.set()
                await self.release.wait()
            place.release()
        await send({**HEAD, "headers": [(b"content-length", b"2")]})
        if scope["path"] == "/linger":  # the whole body, and the exchange's end later
            await send(body(b"ok", more=True))
            await self.lingered.wait()
            await send(body(b""))
            return
        await send(body(b"ok"))


async def test_a_post_is_not_read_while_the_queue_is_full_and_keeps_its_arrival() -> None:
    """One turn (limit 1) held by a first request: a second POST is not read (its app
    does not start) until the turn is given back, then it runs with that turn handed to
    it and its arrival stamped when it came; a GET is read and answered meanwhile; at
    the end no turn is left taken."""
    app = TurnApp()
    async with server(app) as port:
        first = await trio.open_tcp_stream("127.0.0.1", port)
        await first.send_all(post(b"hold"))
        await app.held.wait()
        second = await trio.open_tcp_stream("127.0.0.1", port)
        sent = trio.current_time()
        await second.send_all(post(b"next"))
        await trio.sleep(0.3)
        assert "/next" not in app.seen  # unread: no scope, no app task

        health = await trio.open_tcp_stream("127.0.0.1", port)
        assert await exchange(health, h11.Connection(h11.CLIENT)) == (200, b"ok")

        app.release.set()
        await answer(first)
        await answer(second)
        arrived, started, handed = app.seen["/next"]
        assert handed  # the turn taken before its read, not queued for again
        assert arrived - sent < 0.1  # stamped when it came ...
        assert started - arrived >= 0.25  # ... not when its turn came
        assert app.taken() == 0
        for stream in (first, second, health):
            await stream.aclose()


async def test_a_post_sent_before_the_exchange_ahead_ended_waits_unread_too() -> None:
    """A client sends its next POST as soon as it has its answer, before the exchange
    that answered has ended on the server (under load the end comes a scheduler pass
    later): the POST is not read when that exchange ends either, while the queue is
    full -- it waits for its turn unread, and runs with the turn handed to it. (Read at
    once, it was parsed and its app started, to wait in the queue: at 1,024 clients a
    third of the requests were.)"""
    app = TurnApp()
    async with server(app) as port:
        first = await trio.open_tcp_stream("127.0.0.1", port)
        await first.send_all(post(b"hold"))
        await app.held.wait()
        eager = await trio.open_tcp_stream("127.0.0.1", port)
        await eager.send_all(b"GET /linger HTTP/1.1\r\nhost: x\r\n\r\n")
        await answer(eager)
        await eager.send_all(post(b"next"))
        await trio.sleep(0.2)
        app.lingered.set()  # the exchange ahead ends; the queue is still full
        await trio.sleep(0.3)
        assert "/next" not in app.seen  # still unread

        app.release.set()
        await answer(first)
        await answer(eager)
        assert app.seen["/next"][2]  # the turn taken before its read
        assert app.taken() == 0
        for stream in (first, eager):
            await stream.aclose()


async def test_a_turn_taken_for_a_request_that_never_came_is_given_back() -> None:
    """A client that sends a POST's first bytes and closes while it waits for its turn:
    the turn handed to its connection goes back, and the next request gets it."""
    app = TurnApp()
    async with server(app) as port:
        first = await trio.open_tcp_stream("127.0.0.1", port)
        await first.send_all(post(b"hold"))
        await app.held.wait()
        quitter = await trio.open_tcp_stream("127.0.0.1", port)
        await quitter.send_all(b"POST /gone HT")
        await trio.sleep(0.2)
        await quitter.aclose()
        await trio.sleep(0.1)
        app.release.set()
        await answer(first)
        with trio.fail_after(5):  # not waiting forever behind a turn nobody gives back
            later = await trio.open_tcp_stream("127.0.0.1", port)
            await later.send_all(post(b"later"))
            await answer(later)
        assert app.taken() == 0
        await first.aclose()
        await later.aclose()


@pytest.mark.parametrize(
    "dribble",
    [b"POST /slow HT", b"POST /slow HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n{"],
    ids=["head cut short", "body still to come"],
)
async def test_a_client_that_dribbles_holds_no_turn(dribble: bytes) -> None:
    """While the queue is full, a request that comes in pieces gets the turn when its
    first bytes' turn comes, but gives it back at once: the next whole request is served
    while the dribbler still owes bytes (a turn held by it would starve the worker)."""
    app = TurnApp()
    async with server(app) as port:
        first = await trio.open_tcp_stream("127.0.0.1", port)
        await first.send_all(post(b"hold"))
        await app.held.wait()
        slow = await trio.open_tcp_stream("127.0.0.1", port)
        await slow.send_all(dribble)
        await trio.sleep(0.2)
        app.release.set()
        await answer(first)
        await trio.sleep(0.2)  # the dribbler has had its turn, and given it back
        with trio.fail_after(5):
            later = await trio.open_tcp_stream("127.0.0.1", port)
            await later.send_all(post(b"later"))
            await answer(later)
        assert app.taken() == 0
        for stream in (first, slow, later):
            await stream.aclose()


async def test_a_handed_turn_that_waited_past_the_queue_budget_is_shed(
    autojump_clock: Any,
) -> None:
    """The entry's side: a turn handed over after the request's queue budget passed is
    given back and the request answered 503 (shed), not started."""
    app = turns_app("max_starting = 1\nqueue_share = 0.1", latency_ms="10")
    turns = Turns(limit=1)
    turn = await turns.take(math.inf)
    assert isinstance(turn, Turn)
    scope = make_scope("POST", "/v1/chat/completions", {"content-type": "application/json"})
    # It came 5 s ago (a 30 s deadline: the queue budget was 3 s) and waited unread.
    scope["extensions"] = {ARRIVED: trio.current_time() - 5.0, TURNS: turns, TURN: turn}
    ex = Exchange(app, scope, [json.dumps(chat_body()).encode()])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ex.run)
        await ex.done.wait()
        ex.disconnect()
    assert ex.response.status == 503
    assert turns.active == 0


async def test_a_handed_turn_in_time_is_used_not_queued_for(autojump_clock: Any) -> None:
    """A chat request handed a turn (the queue full: limit 1, that turn the one taken)
    is served with it at once, and the turn is given back when its upstream call starts."""
    app = turns_app("max_starting = 1", latency_ms="10")
    turns = Turns(limit=1)
    turn = await turns.take(math.inf)
    assert isinstance(turn, Turn)
    scope = make_scope("POST", "/v1/chat/completions", {"content-type": "application/json"})
    scope["extensions"] = {ARRIVED: trio.current_time(), TURNS: turns, TURN: turn}
    ex = Exchange(app, scope, [json.dumps(chat_body()).encode()])
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ex.run)
            await ex.done.wait()
            ex.disconnect()
    assert ex.response.status == 200
    assert turns.active == 0


async def test_a_handed_turn_on_a_route_that_takes_none_is_given_back_at_once() -> None:
    """``/healthz`` (or any endpoint not a chat route) handed a turn gives it back before
    it runs."""
    app: App = turns_app("max_starting = 1")
    turns = Turns(limit=1)
    turn = await turns.take(math.inf)
    assert isinstance(turn, Turn)
    scope = make_scope("GET", "/healthz", {})
    scope["extensions"] = {TURNS: turns, TURN: turn}
    ex = Exchange(app, scope, [])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ex.run)
        await ex.done.wait()
        ex.disconnect()
    assert ex.response.status == 200
    assert turns.active == 0
