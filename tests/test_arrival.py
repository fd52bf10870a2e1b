"""A request's deadline counts from when the server read its head (the seam's stamp,
``scope["extensions"]["aiserve.arrived"]``), not from when its app task starts: time it
waited in the server is time it does not have. The entry's side on the virtual clock, the
seam's against the real server."""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import h11
import pytest
import trio
import trustme
from hypercorn.config import Config
from hypercorn.events import Closed, RawData
from hypercorn.trio import serve

from aiserve_trio.http.types import ARRIVED
from aiserve_trio.runtime.asgi import App
from aiserve_trio.runtime.entry import arrived
from aiserve_trio.server import directio

from .asgi_client import Exchange, Response, chat_body, make_scope
from .conftest import seam_on
from .servers import free_port
from .test_coalesce import HEAD, Scope, body, exchange, server
from .test_observability import traced_app
from .test_shed import assert_shed, shed_app, shed_count


async def stamped(
    app: App, waited: float | None, headers: dict[str, str] | None = None
) -> tuple[Response, float, Exchange]:
    """One chat request whose head the server read ``waited`` seconds before the app
    runs (None: no stamp, as hypercorn as shipped); (response, seconds the app took, the
    exchange)."""
    hdrs = {"content-type": "application/json", **(headers or {})}
    scope = make_scope("POST", "/v1/chat/completions", hdrs)
    start = trio.current_time()
    if waited is not None:
        scope["extensions"] = {ARRIVED: start - waited}
    ex = Exchange(app, scope, [json.dumps(chat_body()).encode()])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ex.run)
        await ex.done.wait()
        ex.disconnect()
    return ex.response, trio.current_time() - start, ex


def server_wait(app: App) -> tuple[float, float]:
    """``aiserve_server_wait_seconds``: (count, sum)."""
    found = {}
    for line in app.metrics.render().decode().splitlines():
        for part in ("count", "sum"):
            if line.startswith(f"aiserve_server_wait_seconds_{part} "):
                found[part] = float(line.rsplit(" ", 1)[1])
    return found.get("count", 0.0), found.get("sum", 0.0)


async def test_time_waited_in_the_server_is_taken_from_the_budget(autojump_clock: Any) -> None:
    """A 1 s deadline (0.9 s after the reserve), a backend that takes 5 s to its first
    token: the inference cut is 0.675 s after arrival. Read 0.3 s before the app ran, the
    504 comes 0.375 s into the app; without a stamp, 0.675 s."""
    app = shed_app("", ttft_ms="5000")
    hdrs = {"x-request-timeout-ms": "1000"}
    late, took, _ = await stamped(app, 0.3, hdrs)
    assert late.status == 504
    assert took == pytest.approx(0.375, abs=0.01)
    plain, took, _ = await stamped(app, None, hdrs)
    assert plain.status == 504
    assert took == pytest.approx(0.675, abs=0.01)
    # The wait is measured: one request waited 0.3 s in the server, the other not at all.
    count, total = server_wait(app)
    assert count == 1
    assert total == pytest.approx(0.3, abs=0.001)


async def test_a_request_that_waited_in_the_server_past_its_queue_budget_is_shed_at_once(
    autojump_clock: Any,
) -> None:
    """queue_share 0.2 of a 10 s deadline (1.98 s): read 2.5 s before its app ran, a request
    is shed the moment the app sees it -- 503, Retry-After, counted, its body unread; read
    1 s before, it is served."""
    app = shed_app("queue_share = 0.2")
    hdrs = {"x-request-timeout-ms": "10000"}
    resp, took, ex = await stamped(app, 2.5, hdrs)
    assert_shed(resp)
    assert took == 0.0
    assert ex.parts_read == 0
    assert shed_count(app, "queue") == 1
    ok, _, _ = await stamped(app, 1.0, hdrs)
    assert ok.status == 200
    assert shed_count(app, "queue") == 1
    # Shedding off: the same wait is only time taken from the budget.
    off, _, _ = await stamped(shed_app(""), 2.5, hdrs)
    assert off.status == 200


async def test_the_trace_starts_when_the_server_read_the_request(autojump_clock: Any) -> None:
    """The request span covers the 5 s it waited in the server, and the stage spans stay
    where they happened (not 5 s in the future)."""
    app, exporter, _ = traced_app()
    before = time.time_ns()
    resp, _, _ = await stamped(app, 5.0)
    assert resp.status == 200
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root, parse = spans["POST chat"], spans["parse"]
    assert root.start_time is not None
    assert parse.start_time is not None
    assert root.start_time <= before - 4_000_000_000
    assert parse.start_time - root.start_time >= 5_000_000_000
    assert parse.start_time <= time.time_ns()


def test_a_stamp_counts_only_when_it_is_a_time_before_now() -> None:
    assert arrived({"extensions": {ARRIVED: 7.5}}, 10.0) == 7.5
    assert arrived({"extensions": {ARRIVED: 12.0}}, 10.0) == 10.0  # not yet: now
    assert arrived({"extensions": {ARRIVED: "7.5"}}, 10.0) == 10.0
    assert arrived({"extensions": {}}, 10.0) == 10.0
    assert arrived({}, 10.0) == 10.0  # another server: no extensions at all


# --- the seam's stamp, against the real server -------------------------------------------


@pytest.mark.seam
@pytest.mark.slow
async def test_the_seam_stamps_when_it_read_each_request() -> None:
    """On one keep-alive connection: a request sent 0.2 s after the first is stamped with
    its own read, not the connection's; two pipelined requests, the first served in 0.3 s,
    the second stamped when its bytes were read -- with the first -- so its app starts
    0.3 s after its arrival."""
    seen: list[tuple[float, float]] = []  # (stamp, app start)

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        seen.append((scope["extensions"][ARRIVED], trio.current_time()))
        if scope["path"] == "/slow":
            await trio.sleep(0.3)
        await send({**HEAD, "headers": [(b"content-length", b"2")]})
        await send(body(b"ok"))

    async with server(app) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        conn = h11.Connection(h11.CLIENT)
        assert await exchange(stream, conn) == (200, b"ok")
        await trio.sleep(0.2)
        assert await exchange(stream, conn) == (200, b"ok")
        (first, first_app), (second, second_app) = seen
        assert first <= first_app
        assert second <= second_app
        assert second - first >= 0.2  # its own read, not the first's
        assert second_app - second < 0.1

        seen.clear()
        raw = b"".join(
            b"GET /%s HTTP/1.1\r\nhost: x\r\n\r\n" % path for path in (b"slow", b"next")
        )
        await stream.send_all(raw)
        got = b""
        while got.count(b"ok") < 2:
            got += await stream.receive_some(65536)
        (slow, _), (nxt, nxt_app) = seen
        assert nxt == slow  # read in the same read
        assert nxt_app - nxt >= 0.3  # it waited behind the slow one, inside its deadline
        await stream.aclose()


async def test_the_read_loop_stamps_each_read_and_keeps_the_accept_for_bytes_already_there(
    autojump_clock: Any,
) -> None:
    """Bytes waiting when the loop first reads came with the connect: the accept's time
    stands for them; bytes the loop waited for get the time it read them."""
    a, b = trio.socket.socketpair()
    accepted = trio.current_time()
    arrivals = directio.Arrivals(accepted)
    seen: list[tuple[bytes, float]] = []

    class Recording:
        async def handle(self, event: Any) -> None:
            if isinstance(event, RawData) and event.data:
                seen.append((event.data, arrivals.read_at))

    class Server:
        config = Config()
        protocol = Recording()

    async def client() -> None:
        await trio.sleep(1.5)  # the loop has read the first bytes and waits
        await a.send(b"second")
        a.close()

    await a.send(b"first")
    await trio.sleep(0.5)  # the handler starts after its accept
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client)
        await directio.read_loop(Server(), b, Closed, RawData, arrivals)
    b.close()
    assert seen == [(b"first", accepted), (b"second", pytest.approx(accepted + 2.0, abs=0.01))]


@asynccontextmanager
async def tls_server(app: Any, tmp_path: Path) -> AsyncIterator[tuple[int, ssl.SSLContext]]:
    """The seam's hypercorn over TLS, ``app`` answering after the body: (port, client
    context)."""
    seam_on()
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    certfile, keyfile = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(certfile))
    cert.private_key_pem.write_to_path(str(keyfile))
    port = free_port()
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.certfile, config.keyfile = str(certfile), str(keyfile)
    done = trio.Event()

    async def asgi(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        await app(scope, receive, send)

    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve, asgi, config, shutdown_trigger=done.wait))  # type: ignore[arg-type]
        yield port, ctx
        done.set()


@pytest.mark.seam
@pytest.mark.slow
async def test_tls_requests_are_stamped_with_their_own_read(tmp_path: Path) -> None:
    """Over TLS (hypercorn's read loop, stamped by the seam's protocol wrapper): a request
    sent 0.2 s after the first on the same connection is stamped with its own read."""
    seen: list[tuple[float, float]] = []

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        seen.append((scope["extensions"][ARRIVED], trio.current_time()))
        await send({**HEAD, "headers": [(b"content-length", b"2")]})
        await send(body(b"ok"))

    async with tls_server(app, tmp_path) as (port, ctx):
        tcp = await trio.open_tcp_stream("127.0.0.1", port)
        stream = trio.SSLStream(tcp, ctx, server_hostname="127.0.0.1")
        conn = h11.Connection(h11.CLIENT)
        assert await exchange(stream, conn) == (200, b"ok")  # type: ignore[arg-type]
        await trio.sleep(0.2)
        assert await exchange(stream, conn) == (200, b"ok")  # type: ignore[arg-type]
        await stream.aclose()
    (first, first_app), (second, second_app) = seen
    assert first <= first_app
    assert second <= second_app
    assert second - first >= 0.2
    assert second_app - second < 0.1


@pytest.mark.seam
@pytest.mark.slow
async def test_h2_streams_are_stamped_with_the_read_of_their_headers() -> None:
    """HTTP/2 (prior knowledge): a stream opened 0.2 s after the first on the same
    connection is stamped with the read that brought its HEADERS."""
    seen: list[tuple[float, float]] = []

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        seen.append((scope["extensions"][ARRIVED], trio.current_time()))
        await send({**HEAD, "headers": [(b"content-length", b"2")]})
        await send(body(b"ok"))

    async def one(stream: trio.SocketStream, conn: h2.connection.H2Connection) -> None:
        sid = conn.get_next_available_stream_id()
        head = [(":method", "GET"), (":path", "/"), (":scheme", "http"), (":authority", "x")]
        conn.send_headers(sid, head, end_stream=True)
        await stream.send_all(conn.data_to_send())
        while True:
            events = conn.receive_data(await stream.receive_some(65536))
            await stream.send_all(conn.data_to_send())
            if any(isinstance(e, h2.events.StreamEnded) and e.stream_id == sid for e in events):
                return

    async with server(app) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        await one(stream, conn)
        await trio.sleep(0.2)
        await one(stream, conn)
        await stream.aclose()
    (first, first_app), (second, second_app) = seen
    assert first <= first_app
    assert second <= second_app
    assert second - first >= 0.2
    assert second_app - second < 0.1
