"""A streamed reply whose every delta is in hand when the sse stage starts: one write,
still bounded by the write deadline (there is no keep-alive task for it)."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from aiserve_trio.adapters.base import Adapter, Delta, DeltaSink, InferenceRequest, Usage
from aiserve_trio.adapters.retry import Progress
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client, chat_body
from .authcfg import OFF, auth_config


class AtOnce(Adapter):
    """Sends the whole reply without waiting between deltas (a fast backend's one read)."""

    def __init__(self) -> None:
        super().__init__("mock", ["aiserve-mock"])

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        await send.send(Delta(text="all of it at once"))
        await send.send(Delta(finish_reason="stop", usage=Usage(prompt_tokens=3, completion_tokens=4)))


def app(**limits: str) -> App:
    return App(auth_config(OFF, **limits), adapters={"mock": AtOnce()})


async def test_a_reply_in_hand_is_one_write(autojump_clock: Any) -> None:
    r = await Client(app()).chat(chat_body(stream=True))
    assert r.status == 200
    assert len(r.chunks) == 1  # text, finish, usage and [DONE] together
    assert r.events()[-1] == "[DONE]"
    assert "all of it at once" in r.body.decode()


async def test_a_reply_in_hand_to_a_client_that_does_not_read_is_dropped(
    autojump_clock: Any,
) -> None:
    a = app(write_timeout_ms="1000")
    start = trio.current_time()
    r = await Client(a).chat(
        chat_body(stream=True), {"x-request-timeout-ms": "100000"}, send_delay=1000
    )
    # Given up on after the write deadline, not at the 100 s request deadline.
    assert trio.current_time() - start < 3.0
    assert a.gate.admission.streams == 0
    assert r.status == 200
