"""How the pipeline hears of a disconnect (``server/disconnect.py``): the server's call
(hypercorn through the seam, for real, and a scope driven by hand) or a task waiting in
``receive()`` (any other server, and hypercorn as shipped)."""

from __future__ import annotations

import json
import logging
from typing import Any

import trio
import trio.testing

from aiserve_trio.runtime.asgi import App
from aiserve_trio.server.disconnect import EXTENSION, ServerCall
from aiserve_trio.sessions.bus import Session

from .asgi_client import chat_body, make_scope
from .authcfg import OFF, auth_app
from .conftest import make_config
from .fakes import SlowBus


class Exchange:
    """One request driven as hypercorn drives it, with the disconnect call marked."""

    def __init__(
        self, app: Any, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        raw = json.dumps(body).encode()
        headers = {
            "content-type": "application/json", "content-length": str(len(raw)), **(headers or {})
        }
        self.scope = make_scope("POST", "/v1/chat/completions", headers)
        self.call = ServerCall()
        self.scope.setdefault("extensions", {})[EXTENSION] = self.call
        self.queue_in, self.queue_out = trio.open_memory_channel[dict[str, Any]](10)
        self.queue_in.send_nowait({"type": "http.request", "body": raw, "more_body": True})
        self.queue_in.send_nowait({"type": "http.request", "body": b"", "more_body": False})
        self.app = app
        self.chunks: list[bytes] = []
        self.status = 0
        self.done = trio.Event()
        self.got = trio.Event()

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            self.chunks.append(message.get("body", b""))
            self.got.set()
            self.got = trio.Event()
            if not message.get("more_body", False):
                self.close()

    def close(self) -> None:
        """The stream closes (the reply ended, or the client went): as hypercorn does."""
        self.call.closed()
        self.queue_in.send_nowait({"type": "http.disconnect"})

    async def wait_for_chunks(self, n: int) -> None:
        while len(self.chunks) < n:
            await self.got.wait()

    async def run(self) -> None:
        try:
            await self.app(self.scope, self.queue_out.receive, self.send)
        finally:
            self.done.set()


def disconnects(app: Any) -> float:
    text = app.metrics.render().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("aiserve_client_disconnects_total{")
    )


async def test_a_reply_is_served_with_no_task_waiting_in_receive(autojump_clock: Any) -> None:
    app = auth_app(OFF)
    ex = Exchange(app, chat_body("echo: a b c"))
    await ex.run()
    assert ex.status == 200
    assert json.loads(b"".join(ex.chunks))["choices"][0]["message"]["content"] == "a b c"
    # Nothing read the queue after the body: the server's closing message is still there.
    assert ex.queue_out.receive_nowait() == {"type": "http.request", "body": b"", "more_body": False}
    assert disconnects(app) == 0  # the close after the reply is not a disconnect


async def test_the_servers_call_on_a_disconnect_ends_the_stream(autojump_clock: Any) -> None:
    app = auth_app(OFF, ttft_ms="10", itl_ms="100")
    words = " ".join(["w"] * 200)
    ex = Exchange(app, chat_body("echo: " + words, stream=True))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ex.run)
        await ex.wait_for_chunks(3)
        started = trio.current_time()
        ex.close()  # the client goes away mid-stream
        with trio.fail_after(5):
            await ex.done.wait()
        assert trio.current_time() - started < 0.2  # at once, not at the end of 200 words
    assert disconnects(app) == 1
    assert b"w w w w w w w w w w w w w w w w w w w w" not in b"".join(ex.chunks)


async def test_a_scope_without_the_call_keeps_a_task_in_receive(autojump_clock: Any) -> None:
    app = auth_app(OFF, ttft_ms="10", itl_ms="100")
    ex = Exchange(app, chat_body("echo: " + " ".join(["w"] * 200), stream=True))
    del ex.scope["extensions"][EXTENSION]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ex.run)
        await ex.wait_for_chunks(3)
        ex.queue_in.send_nowait({"type": "http.disconnect"})
        with trio.fail_after(5):
            await ex.done.wait()
    assert disconnects(app) == 1


def test_a_call_set_after_the_stream_closed_is_made_at_once() -> None:
    call = ServerCall()
    calls: list[str] = []
    call.set(lambda: calls.append("first"))
    call.closed()
    call.closed()  # once only
    assert calls == ["first"]
    call.set(lambda: calls.append("late"))  # the request asks after the close: told now
    assert calls == ["first", "late"]
    cleared = ServerCall()
    cleared.set(lambda: calls.append("cleared"))
    cleared.clear()
    cleared.closed()
    assert calls == ["first", "late"]


# --- the real hypercorn, in this process, with and without the seam -------------------


class Served:
    """The gateway under hypercorn's Trio worker; records each HTTP scope's disconnect call."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.calls: list[object] = []
        self.finished = trio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.calls.append(scope["extensions"].get(EXTENSION))
        try:
            await self.app(scope, receive, send)
        finally:
            self.finished.set()


async def serve_and_disconnect(app: Any, split: bool = False) -> tuple[Served, float]:
    """Serve ``app`` on hypercorn; a client streams, leaves after a few chunks; how long
    the gateway took to notice. ``split``: the body comes in two pieces, 50 ms apart."""
    from functools import partial

    from hypercorn.config import Config
    from hypercorn.trio import serve

    from .servers import free_port

    served = Served(app)
    port = free_port()
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    done = trio.Event()
    raw = json.dumps(chat_body("echo: " + " ".join(["w"] * 300), stream=True)).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(raw), raw)
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve, served, config, shutdown_trigger=done.wait))
        with trio.fail_after(10):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            if split:
                await stream.send_all(request[:-10])
                await trio.sleep(0.05)  # hypercorn hands the app the body in two messages
                await stream.send_all(request[-10:])
            else:
                await stream.send_all(request)
            got = b""
            while got.count(b"data: ") < 3:
                got += await stream.receive_some(65536)
            await stream.aclose()
            left = trio.current_time()
            await served.finished.wait()
            noticed = trio.current_time() - left
            assert disconnects(app) == 1
        done.set()
    return served, noticed


async def test_through_the_seam_hypercorn_calls_and_the_stream_ends_at_once(
    monkeypatch: Any,
) -> None:
    monkeypatch.delenv("AISERVE_HYPERCORN_PATCHES", raising=False)
    app = auth_app(OFF, ttft_ms="5", itl_ms="50")  # 300 words: 15 s if it went on
    served, noticed = await serve_and_disconnect(app)
    # The app's start-up installed the seam; hypercorn's worker then built its server.
    assert [type(c) for c in served.calls] == [ServerCall]
    assert noticed < 1.0


async def test_on_hypercorn_as_shipped_the_watcher_hears_the_disconnect(
    monkeypatch: Any,
) -> None:
    monkeypatch.setenv("AISERVE_HYPERCORN_PATCHES", "off")
    app = auth_app(OFF, ttft_ms="5", itl_ms="50")
    served, noticed = await serve_and_disconnect(app)
    assert served.calls == [None]  # no call offered: the pipeline's watcher reads receive()
    assert noticed < 1.0


async def test_a_body_in_pieces_is_read_then_the_servers_call_hears_the_disconnect(
    monkeypatch: Any,
) -> None:
    monkeypatch.delenv("AISERVE_HYPERCORN_PATCHES", raising=False)
    app = auth_app(OFF, ttft_ms="5", itl_ms="50")
    served, noticed = await serve_and_disconnect(app, split=True)
    assert [type(c) for c in served.calls] == [ServerCall]
    assert noticed < 1.0



class GatedBus(SlowBus):
    """A session bus whose load returns when the test opens the gate."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.loading = trio.Event()
        self.gate = trio.Event()

    async def load(self, tenant: str, session_id: str, history_turns: int, ttl: int) -> Session:
        self.loading.set()
        await self.gate.wait()
        return self.session


async def test_a_disconnect_as_the_context_stage_hands_on_is_not_a_failure(
    autojump_clock: Any, caplog: Any
) -> None:
    """The session arrives (the context stage is rescheduled) and the client goes in the
    same step (the sse stage is cancelled). When the sse stage runs first it closes its
    inbox, and the context stage, running on to hand it the prepared request, finds it
    closed: that is the disconnect, not a bug -- no "failed inside the gateway" ERROR and
    traceback. Trio runs a step's tasks in either order, so the race is run 20 times."""
    caplog.set_level(logging.ERROR)
    for _ in range(20):
        bus = GatedBus()
        app = App(make_config(), bus=bus)
        ex = Exchange(app, chat_body("echo: a b c"), {"x-session-id": "s1"})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ex.run)
            await bus.loading.wait()
            bus.gate.set()
            ex.close()
            with trio.fail_after(5):
                await ex.done.wait()
        assert disconnects(app) == 1
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
