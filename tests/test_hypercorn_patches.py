"""The app's start-up puts its hypercorn patches in place; the Date header is the same text."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any
from wsgiref.handlers import format_date_time

import pytest
import trio
from hypercorn import config as _config
from hypercorn.protocol.http_stream import HTTPStream
from hypercorn.trio import tcp_server as _tcp_server

from aiserve_trio.asgi import App
from aiserve_trio.http import coalesce, datecache, directio, disconnect, idle
from aiserve_trio.http.idle import IdleTimer

# The attributes the patches replace are hypercorn's module globals, not its API.
hypercorn_config: Any = _config
tcp_server: Any = _tcp_server


async def test_start_up_installs_the_keep_alive_timer_the_date_cache_and_direct_io(
    make_app: Callable[..., App], monkeypatch: pytest.MonkeyPatch
) -> None:
    # As a fresh worker finds hypercorn: nothing patched yet (restored after the test).
    monkeypatch.setattr(idle.install, "installed", False)
    monkeypatch.setattr(datecache.install, "installed", False)
    monkeypatch.setattr(directio.install, "installed", False)
    monkeypatch.setattr(disconnect.install, "installed", False)
    monkeypatch.setattr(HTTPStream, "handle", HTTPStream.handle)
    unpatched_handle = HTTPStream.handle
    monkeypatch.setattr(tcp_server.TCPServer, "protocol_send", tcp_server.TCPServer.protocol_send)
    monkeypatch.setattr(tcp_server.TCPServer, "_read_data", tcp_server.TCPServer._read_data)
    unpatched = tcp_server.TCPServer.protocol_send, tcp_server.TCPServer._read_data
    monkeypatch.setattr(coalesce.install, "installed", True)  # its own test covers it
    monkeypatch.setattr(tcp_server, "TrioSingleTask", tcp_server.TrioSingleTask)
    monkeypatch.setattr(hypercorn_config, "format_date_time", format_date_time)
    app = make_app()
    async with trio.open_nursery() as nursery:
        await app.startup(nursery)
        nursery.cancel_scope.cancel()
    await app.shutdown()
    assert tcp_server.TrioSingleTask is IdleTimer
    assert tcp_server.TCPServer.protocol_send is not unpatched[0]
    assert tcp_server.TCPServer._read_data is not unpatched[1]
    assert HTTPStream.handle is not unpatched_handle
    assert hypercorn_config.format_date_time is not format_date_time
    now = time.time()
    assert hypercorn_config.format_date_time(now) == format_date_time(now)


def test_the_date_is_formatted_once_a_second_and_reads_as_wsgirefs() -> None:
    calls: list[float] = []

    def counting(ts: float) -> Any:
        calls.append(ts)
        return format_date_time(ts)

    fmt = datecache.cached(counting)
    t = 1_796_000_000.0
    for step in (0.0, 0.1, 0.5, 0.999):
        assert fmt(t + step) == format_date_time(t + step)
    assert len(calls) == 1
    assert fmt(t + 1.0) == format_date_time(t + 1) != format_date_time(t)
    assert fmt(t + 0.2) == format_date_time(t)  # a clock that stepped back still reads right
    assert len(calls) == 3
