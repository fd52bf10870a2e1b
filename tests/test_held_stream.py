"""A stream whose client reads nothing holds a few reads of its reply, not the reply.

In-process: the app (started as hypercorn's lifespan starts it) in front of
``bench.h2_window.Upstream`` on a loopback port, which writes a long reply of 1 KiB
deltas as fast as its socket takes them; the client takes the head and one body
chunk, then blocks every ``send`` (a client whose HTTP/2 window is 0, or an HTTP/1.1
client that stopped reading, as the server's send buffer sees them). Counted: the
bytes the gateway read from the upstream (the openai adapter's per-read hook). What
it read and did not write is what the stream holds in the worker's memory (issue 55,
item 1: a held stream costs a few tens of KB, docs/architecture.md).

On 64 KiB upstream reads each read of a fast backend's 1 KiB deltas became one
~56 KB delta, and a blocked stream held four of them and their events (~0.7 MB of
RSS each, ``bench.h2_window --delta-bytes 1024``): here 295 KB read and not written
(watched fail); 84 KB with 16 KiB reads, 68 KB with the sse write's bound too.
"""

from __future__ import annotations

import pytest
import trio
from bench.h2_window import PATH, Upstream, chat_body, gateway_toml

from aiserve_trio.adapters import openai
from aiserve_trio.config import parse_config
from aiserve_trio.runtime.asgi import App

from .sim_gateway import running

#: What a blocked stream may have read from its upstream and not written (bytes):
#: a few reads, the inference -> sse channel and the write under way.
HELD = 100_000


@pytest.mark.slow
async def test_a_client_that_reads_nothing_stops_the_upstream_after_a_few_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pulled: list[int] = []
    monkeypatch.setattr(openai, "upstream_read", pulled.append)
    upstream = Upstream()
    try:
        app = App(parse_config(gateway_toml(upstream.port, 60_000), source="<test>"))
        async with running(app) as client:
            body = chat_body(50_000_000, delta=1024)
            async with client.open(
                "POST",
                PATH,
                body=body,
                headers={"content-type": "application/json"},
                stall_after=1,
            ) as ex:
                with trio.fail_after(10):
                    await ex.wait_for_bytes(1)
                await trio.sleep(1.0)  # the upstream writes as fast as it is read
                held = sum(pulled)
                await trio.sleep(0.5)
                assert sum(pulled) == held  # it is read no more
                assert ex.response.status == 200
                written = len(ex.response.body)
                assert held - written <= HELD, (held, written, len(pulled))
                # Each read is a delta of its own: none is bigger than a read.
                assert max(pulled) <= 16384, max(pulled)
                ex.disconnect()  # the client leaves: the request ends
    finally:
        upstream.close()
