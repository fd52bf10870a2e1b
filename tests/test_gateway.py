"""The gateway is built and opened in one place, and closed in reverse order
(``gateway.build_gateway``, ``gateway.opened``, ``gateway.open_gateway``)."""

from __future__ import annotations

import sqlite3
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
import trio

from aiserve_trio.adapters.base import Adapter
from aiserve_trio.audit.schema import SchemaTooNew
from aiserve_trio.config import Config
from aiserve_trio.runtime.asgi import App
from aiserve_trio.runtime.gateway import ORDER, build_gateway, open_gateway, opened
from aiserve_trio.sessions.memory import MemoryBus

from .conftest import make_config
from .fakes import RecordingAdapter


class NotedAdapter(RecordingAdapter):
    """The config's mock, noting when it is opened and closed."""

    def __init__(self, inner: Adapter, log: list[str]) -> None:
        super().__init__(inner)
        self.log = log

    async def aopen(self, nursery: trio.Nursery) -> None:
        self.log.append("adapter opened")
        await super().aopen(nursery)

    async def aclose(self) -> None:
        self.log.append("adapter closed")
        await super().aclose()


class NotedBus(MemoryBus):
    """A memory bus, noting when it is opened and closed."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    async def aopen(self) -> None:
        self.log.append("bus opened")
        await super().aopen()

    async def aclose(self) -> None:
        self.log.append("bus closed")
        await super().aclose()


def recorded_and_audited(tmp_path: Path, audit_db: Path) -> Config:
    """The default config with the recorder and the audit log on (every part opens)."""
    return make_config(
        f'[record]\nenabled = true\npath = "{tmp_path / "rec"}"\n'
        f'[audit]\nbackend = "sqlite"\npath = "{audit_db}"\n'
    )


def noted_parts(log: list[str]) -> dict[str, Any]:
    """A noting mock adapter and a noting bus, for ``build_gateway``/``open_gateway``."""
    mock = App(make_config()).adapters["mock"]
    return {"adapters": {"mock": NotedAdapter(mock, log)}, "bus": NotedBus(log)}


def newer_audit_db(path: Path) -> Path:
    """An audit database migrated by a newer gateway: its writer refuses to start."""
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE audit_schema (version INTEGER NOT NULL)")
        conn.execute("INSERT INTO audit_schema (version) VALUES (999)")
    return path


async def test_a_start_up_failing_half_way_closes_what_it_opened_in_reverse_order(tmp_path):
    # The audit writer, sixth to open, refuses the start: the adapters, the bus, the
    # gate and the recorder are open by then; the cache and the background are not.
    config = recorded_and_audited(tmp_path, newer_audit_db(tmp_path / "audit.db"))
    log: list[str] = []
    gw = build_gateway(config, **noted_parts(log))
    with pytest.raises(SchemaTooNew, match="schema version 999"):  # itself, not in a group
        async with opened(gw):
            pytest.fail("the gateway opened")
    running = gw.running
    assert running.opened == ["nursery", "adapters", "bus", "gate", "recorder"]
    assert running.closed == ["recorder", "gate", "bus", "adapters", "nursery"]
    # The parts themselves were closed, in that order; nothing else started.
    assert log == ["adapter opened", "bus opened", "bus closed", "adapter closed"]
    assert running.tasks is None  # no background task ran
    assert not running.ready


async def test_a_gateway_opens_every_part_in_order_and_closes_them_in_reverse(tmp_path):
    config = recorded_and_audited(tmp_path, tmp_path / "audit.db")
    log: list[str] = []
    async with open_gateway(config, **noted_parts(log)) as gw:
        running = gw.running
        assert running.opened == list(ORDER)
        assert running.closed == []
        assert running.ready
        assert running.tasks is not None
        assert log == ["adapter opened", "bus opened"]
    assert running.closed == list(reversed(ORDER))
    assert log == ["adapter opened", "bus opened", "bus closed", "adapter closed"]
    assert not running.ready
    assert gw.closing.is_set()


async def test_the_lifespan_reports_a_failed_start_up_after_closing_what_opened(tmp_path):
    # Not a hypercorn process: the ASGI way (lifespan.startup.failed) with the reason.
    config = recorded_and_audited(tmp_path, newer_audit_db(tmp_path / "audit.db"))
    log: list[str] = []
    app = App(config, **noted_parts(log))
    sent: list[MutableMapping[str, Any]] = []
    messages = iter([{"type": "lifespan.startup"}])

    async def receive() -> dict[str, Any]:
        return next(messages)

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    await app({"type": "lifespan"}, receive, send)
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"]
    assert "schema version 999" in sent[0]["message"]
    assert log[-2:] == ["bus closed", "adapter closed"]
