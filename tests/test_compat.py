"""Library-internal accesses: used within their version range, skipped (with one warning) outside."""

from __future__ import annotations

import importlib.metadata
import logging

import httpx2
import pytest
import trio

from aiserve_trio.adapters import compat
from aiserve_trio.adapters.compat import PrivateAccess, version_tuple
from aiserve_trio.adapters.transport import ClientPool


@pytest.mark.parametrize(
    ("text", "parts"),
    [("2.16.2", (2, 16, 2)), ("0.12", (0, 12)), ("2.17.0rc1", (2, 17, 0)), ("1.0.post1", (1, 0))],
)
def test_version_tuple(text: str, parts: tuple[int, ...]) -> None:
    assert version_tuple(text) == parts


def access(installed: str | None) -> PrivateAccess:
    def lookup(dist: str) -> str:
        if installed is None:
            raise importlib.metadata.PackageNotFoundError(dist)
        return installed

    return PrivateAccess("lib", "2.16", "2.17", "lib.Thing._private", installed=lookup)


@pytest.mark.parametrize(
    ("installed", "supported"),
    [("2.16.0", True), ("2.16.9", True), ("2.15.3", False), ("2.17.0", False), (None, False)],
)
def test_the_range_is_since_inclusive_before_exclusive(
    installed: str | None, supported: bool
) -> None:
    assert access(installed).supported is supported


def test_the_installed_libraries_are_the_ones_the_accesses_were_written_for() -> None:
    # Fails after an upgrade: re-check the attributes, then move the ranges.
    assert compat.HTTPX2_POOL.supported
    assert compat.WS_STREAM.supported


def test_out_of_range_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    a = access("3.0")
    with caplog.at_level(logging.WARNING, logger="aiserve_trio.adapters.compat"):
        assert not a.supported
        assert not a.supported
        a.give_up("again")
    assert [r.getMessage() for r in caplog.records] == [
        "lib.Thing._private: not used (installed version is not in [2.16, 2.17)); falling back"
    ]


# --- httpx2's connection pool ------------------------------------------------------


async def test_pool_counts_through_the_private_pool() -> None:
    async with httpx2.AsyncClient() as client:
        assert compat.pool_connections(client) == (0, 0)
    mocked = httpx2.AsyncClient(transport=httpx2.MockTransport(lambda r: httpx2.Response(200)))
    assert compat.pool_connections(mocked) == (0, 0)  # holds no connections


async def test_pool_counts_are_unknown_outside_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "HTTPX2_POOL", access("3.0"))
    async with httpx2.AsyncClient() as client:
        assert compat.pool_connections(client) is None
        pool = ClientPool(lambda: client, per_client=1, max_streams=1)
        with pool.lease():
            assert pool.connections() is None


async def test_pool_counts_are_unknown_when_the_attribute_moved(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    a = access("2.16.2")
    monkeypatch.setattr(compat, "HTTPX2_POOL", a)
    async with httpx2.AsyncClient() as client:
        transport = client._transport
        assert isinstance(transport, httpx2.AsyncHTTPTransport)
        real = transport._pool
        monkeypatch.setattr(transport, "_pool", object())
        with caplog.at_level(logging.WARNING, logger="aiserve_trio.adapters.compat"):
            assert compat.pool_connections(client) is None
        assert not a.supported  # given up for the process
        assert len(caplog.records) == 1
        monkeypatch.setattr(transport, "_pool", real)


# --- trio-websocket's stream ----------------------------------------------------------


class Stream(trio.abc.AsyncResource):
    def __init__(self) -> None:
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True


class FakeWs:
    def __init__(self) -> None:
        self._stream = Stream()


async def test_ws_stream_is_closed_within_the_range() -> None:
    ws = FakeWs()
    await compat.close_ws_stream(ws)  # type: ignore[arg-type]
    assert ws._stream.closed


async def test_ws_stream_close_is_skipped_outside_the_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(compat, "WS_STREAM", access("0.13.0"))
    ws = FakeWs()
    await compat.close_ws_stream(ws)  # type: ignore[arg-type]
    assert not ws._stream.closed


async def test_ws_stream_close_is_skipped_when_the_attribute_moved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a = access("2.16.1")
    monkeypatch.setattr(compat, "WS_STREAM", a)
    await compat.close_ws_stream(object())  # type: ignore[arg-type]
    assert not a.supported
