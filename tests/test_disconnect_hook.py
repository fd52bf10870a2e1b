"""A request whose body was all there, on a server that calls the app on a disconnect
(``http/disconnect.py``): no task waits in ``receive()``, and a disconnect still ends it."""

from __future__ import annotations

import json
from typing import Any

import trio
import trio.testing

from aiserve_trio.http.disconnect import HOOK, SUPPORTED

from .asgi_client import chat_body, make_scope
from .authcfg import OFF, auth_app


class Exchange:
    """One request driven as hypercorn drives it, with the disconnect call marked."""

    def __init__(self, app: Any, body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode()
        headers = {"content-type": "application/json", "content-length": str(len(raw))}
        self.scope = make_scope("POST", "/v1/chat/completions", headers)
        self.scope[SUPPORTED] = True
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
        callback = self.scope.pop(HOOK, None)
        if callback is not None:
            callback()
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


async def test_a_scope_without_the_mark_keeps_a_task_in_receive(autojump_clock: Any) -> None:
    app = auth_app(OFF, ttft_ms="10", itl_ms="100")
    ex = Exchange(app, chat_body("echo: " + " ".join(["w"] * 200), stream=True))
    del ex.scope[SUPPORTED]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ex.run)
        await ex.wait_for_chunks(3)
        assert HOOK not in ex.scope  # nothing registered: the watcher reads receive()
        ex.queue_in.send_nowait({"type": "http.disconnect"})
        with trio.fail_after(5):
            await ex.done.wait()
    assert disconnects(app) == 1
