"""Connections are accepted in the order they arrived, all that wait at once, however busy
the run loop is (``server/accept.py``): trio's own listener takes one per pass of the loop,
so under load a burst of new connections waited seconds behind the connections already
served (docs/performance.md)."""

from __future__ import annotations

import importlib
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import trio
import trio.testing

from aiserve_trio import server
from aiserve_trio.server.accept import DrainingListener, trio_view

from .conftest import seam_on

N = 64
BUSY = 32


@contextmanager
def waiting_connections(n: int) -> Iterator[tuple[socket.socket, list[socket.socket]]]:
    """A listening socket with ``n`` connections completed by the kernel, none accepted,
    each client having sent its index."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(n + 16)
    clients = []
    try:
        for i in range(n):
            c = socket.create_connection(lsock.getsockname())
            c.sendall(b"%d\n" % i)
            clients.append(c)
        yield lsock, clients
    finally:
        for c in clients:
            c.close()
        lsock.close()


async def passes_to_accept(listener: trio.abc.Listener[trio.SocketStream], n: int) -> list[int]:
    """Serve ``listener`` on a loop kept busy by ``BUSY`` tasks that only yield; for each
    connection in the order its handler started, the run-loop passes (steps of one busy
    task) it waited for and the index its client sent."""
    passes = 0
    started: list[tuple[int, int]] = []
    done = trio.Event()

    async def busy() -> None:
        nonlocal passes
        while not done.is_set():
            passes += 1
            await trio.lowlevel.checkpoint()

    async def handler(stream: trio.SocketStream) -> None:
        data = b""
        while not data.endswith(b"\n"):
            data += await stream.receive_some(16)
        started.append((passes, int(data)))
        if len(started) == n:
            done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(busy)  # one counts the passes; the others fill them
        for _ in range(BUSY - 1):
            nursery.start_soon(trio.lowlevel.checkpoint)
        nursery.start_soon(trio.serve_listeners, handler, [listener])
        await done.wait()
        nursery.cancel_scope.cancel()
    return [p for p, _ in started]


async def test_every_waiting_connection_is_accepted_in_one_pass() -> None:
    with waiting_connections(N) as (lsock, _):
        listener = DrainingListener(trio.socket.from_stdlib_socket(lsock.dup()))
        passes = await passes_to_accept(listener, N)
    # Accepted together: their handlers all started within a few passes of the first.
    assert max(passes) - min(passes) <= 3


async def test_trio_alone_takes_one_connection_a_pass() -> None:
    """What the seam replaces (the measurement behind it, held): one accept per pass."""
    with waiting_connections(N) as (lsock, _):
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(lsock.dup()))
        passes = await passes_to_accept(listener, N)
    assert max(passes) - min(passes) >= N // 2  # about N: one a pass


async def test_connections_are_served_in_arrival_order() -> None:
    order: list[int] = []
    with waiting_connections(N) as (lsock, _):
        listener = DrainingListener(trio.socket.from_stdlib_socket(lsock.dup()))
        async with trio.open_nursery() as nursery:
            for _ in range(N):
                stream = await listener.accept()
                nursery.start_soon(_index, stream, order)
        await listener.aclose()
    assert sorted(order) == list(range(N))


async def _index(stream: trio.SocketStream, order: list[int]) -> None:
    data = b""
    while not data.endswith(b"\n"):
        data += await stream.receive_some(16)
    order.append(int(data))
    await stream.aclose()


async def test_accept_order_follows_the_kernel_queue() -> None:
    """The kernel's accept queue is FIFO: the streams come out in connection order."""
    with waiting_connections(N) as (lsock, clients):
        listener = DrainingListener(trio.socket.from_stdlib_socket(lsock.dup()))
        streams = [await listener.accept() for _ in range(N)]
        ports = [s.socket.getpeername()[1] for s in streams]
        for s in streams:
            await s.aclose()
        await listener.aclose()
        assert ports == [c.getsockname()[1] for c in clients]


async def test_closing_closes_the_connections_not_yet_handed_out() -> None:
    with waiting_connections(4) as (lsock, clients):
        listener = DrainingListener(trio.socket.from_stdlib_socket(lsock.dup()))
        first = await listener.accept()
        await listener.aclose()
        await first.aclose()
        for c in clients:
            c.settimeout(5)
            # Closed by the gateway (a reset: what the client sent was never read), not
            # left hanging.
            with pytest.raises(ConnectionResetError):
                c.recv(1)


def test_the_seam_puts_the_draining_listener_in_hypercorns_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run: Any = importlib.import_module("hypercorn.trio.run")
    assert run.trio is trio
    seam_on()
    assert run.trio.SocketListener is DrainingListener
    assert run.trio.serve_listeners is trio.serve_listeners  # the rest is trio's own
    server.uninstall()
    assert run.trio is trio
    assert trio_view().SocketListener is DrainingListener
