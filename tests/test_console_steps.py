"""``PUT /admin/api/routes/steps`` against a fake reloader: what the handler checks, what
it hands the reloader, and what it answers (no sockets; the handler called directly)."""

from __future__ import annotations

import json
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from aiserve_trio.config import Config
from aiserve_trio.console.edit import read_steps
from aiserve_trio.console.handlers import Console, Result
from aiserve_trio.errors import (
    BadRequest,
    Conflict,
    GatewayError,
    Unprocessable,
    UnsupportedMediaType,
)
from aiserve_trio.http.endpoints import Request
from aiserve_trio.http.responder import Responder
from aiserve_trio.observability.metrics import Metrics
from aiserve_trio.observability.observer import RequestObserver
from aiserve_trio.security.auth import Principal
from aiserve_trio.security.gate import Gate

from .asgi_client import make_scope
from .conftest import make_config

STEPS = '''
[[routes]]
path = "/v1/chain"
adapter = "mock"

# Classify first.
[[routes.steps]]
name = "intent"
kind = "classify"

[[routes.steps]]
name = "answer"
kind = "generate"
'''
OPS = Principal(key_id="ops", tenant="t", routes=frozenset("*"), channels=frozenset("*"), admin=True)


@dataclass(frozen=True)
class Outcome:
    applied: bool
    version: str
    error: str | None
    unchanged: bool = False


@dataclass
class FakeReloader:
    """Answers like the reloader; writes the candidate as the real one would when valid."""

    path: Path
    version: str = "v1"
    refuse: str | None = None
    calls: list[tuple[str, str | None]] = field(default_factory=list)
    #: Set while a reload is in progress; the test may hold it open.
    gate: trio.Event | None = None
    entered: trio.Event = field(default_factory=trio.Event)

    async def reload(self, *, by: str, candidate: str | None = None) -> Result:
        self.calls.append((by, candidate))
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.refuse is not None:
            return Outcome(applied=False, version=self.version, error=self.refuse)
        assert candidate is not None
        self.path.write_text(candidate)
        self.version = f"v{len(self.calls) + 1}"
        return Outcome(applied=True, version=self.version, error=None)

    def status(self) -> dict[str, object]:
        return {"version": self.version, "last_refused": None}


@dataclass
class Host:
    config: Config
    gate: Gate
    metrics: Metrics
    observer: RequestObserver


@dataclass
class Setup:
    console: Console
    reloader: FakeReloader
    file: Path


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    file = tmp_path / "gateway.toml"
    file.write_text("# the operator's file\n" + STEPS)
    # The app's config as loaded (the handler reads steps from the file on disk).
    config = msgspec.structs.replace(make_config(), source=str(file))
    metrics = Metrics()
    host = Host(config, Gate(config), metrics, RequestObserver(metrics, None))
    reloader = FakeReloader(file)
    console = Console.of(host)
    console.reloader = reloader
    return Setup(console, reloader, file)


@dataclass
class Sent:
    status: int = 0
    body: bytes = b""

    def json(self) -> Any:
        return json.loads(self.body)


async def put(console: Console, body: Any, *, ctype: str = "application/json",
              principal: Principal | None = OPS) -> Sent:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent = Sent()

    async def send(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            sent.status = message["status"]
        else:
            sent.body += message.get("body", b"")

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    scope = make_scope("PUT", "/admin/api/routes/steps", {"content-type": ctype})
    request = Request(scope, "PUT", scope["path"], {"content-type": ctype}, receive,
                      Responder(send), 0.0)
    request.principal = principal
    await console.put_steps(request)
    return sent


def change(*steps: tuple[str, bool], version: str = "v1", path: str = "/v1/chain") -> dict[str, Any]:
    return {"path": path, "version": version, "steps": [{"name": n, "enabled": e} for n, e in steps]}


async def test_a_new_order_goes_to_the_reloader_as_the_whole_file(setup: Setup) -> None:
    sent = await put(setup.console, change(("answer", True), ("intent", False)))
    assert sent.status == 200
    assert sent.json() == {"applied": True, "unchanged": False, "version": "v2"}
    ((by, candidate),) = setup.reloader.calls
    assert by == "console:ops"
    assert candidate is not None
    assert candidate.startswith("# the operator's file\n")
    assert "# Classify first.\n[[routes.steps]]\nname = \"intent\"" in candidate
    assert [(s.name, s.enabled) for s in read_steps(candidate, "/v1/chain")] == [
        ("answer", True), ("intent", False)
    ]


async def test_with_auth_off_the_change_is_by_loopback(setup: Setup) -> None:
    await put(setup.console, change(("answer", True), ("intent", True)), principal=None)
    assert setup.reloader.calls[0][0] == "console:loopback"


async def test_a_stale_version_is_a_conflict_and_nothing_is_reloaded(setup: Setup) -> None:
    with pytest.raises(Conflict, match="changed since this page read it") as err:
        await put(setup.console, change(("answer", True), ("intent", True), version="v0"))
    assert (err.value.status, err.value.code, err.value.param) == (409, "stale_version", "version")
    assert setup.reloader.calls == []


async def test_the_reloaders_refusal_is_a_422_with_its_line(setup: Setup) -> None:
    line = f"{setup.file}: key `routes[1].steps[0]`: a classify step must come first"
    setup.reloader.refuse = line
    with pytest.raises(Unprocessable) as err:
        await put(setup.console, change(("answer", True), ("intent", True)))
    assert (err.value.status, err.value.code, err.value.message) == (422, "config_refused", line)


@pytest.mark.parametrize(
    ("steps", "code"),
    [
        ((("answer", True),), "invalid_steps"),
        ((("answer", True), ("intent", True), ("extra", True)), "unknown_step"),
    ],
)
async def test_steps_that_are_not_the_routes_are_422(
    setup: Setup, steps: tuple[tuple[str, bool], ...], code: str
) -> None:
    with pytest.raises(Unprocessable) as err:
        await put(setup.console, change(*steps))
    assert (err.value.code, err.value.param) == (code, "steps")
    assert setup.reloader.calls == []


async def test_an_unknown_route_is_422(setup: Setup) -> None:
    with pytest.raises(Unprocessable, match="no route with path /v1/nope"):
        await put(setup.console, change(("a", True), path="/v1/nope"))


@pytest.mark.parametrize(
    ("body", "ctype", "error"),
    [
        (b"{", "application/json", BadRequest),
        ({"path": "/v1/chain", "steps": []}, "application/json", BadRequest),  # no version
        ({**change(("a", True)), "extra": 1}, "application/json", BadRequest),
        ({"path": "/v1/chain", "version": "v1", "steps": [{"name": 3}]}, "application/json", BadRequest),
        (change(("a", True)), "text/plain", UnsupportedMediaType),
    ],
)
async def test_a_malformed_body_is_refused(
    setup: Setup, body: Any, ctype: str, error: type[GatewayError]
) -> None:
    with pytest.raises(error):
        await put(setup.console, body, ctype=ctype)
    assert setup.reloader.calls == []


async def test_without_a_reloader_or_a_file_nothing_can_be_saved(setup: Setup) -> None:
    setup.console.reloader = None
    with pytest.raises(Conflict, match="cannot reload") as err:
        await put(setup.console, change(("answer", True), ("intent", True)))
    assert err.value.code == "config_not_writable"
    host = setup.console.host
    assert isinstance(host, Host)
    setup.console.reloader = setup.reloader
    host.config = msgspec.structs.replace(host.config, source="<embedded aiserve.toml>")
    with pytest.raises(Conflict, match="without a config file"):
        await put(setup.console, change(("answer", True), ("intent", True)))


async def test_two_changes_at_once_one_waits_and_then_is_stale(setup: Setup) -> None:
    held = setup.reloader.gate = trio.Event()
    results: list[Sent | GatewayError] = []

    async def one(steps: dict[str, Any]) -> None:
        try:
            results.append(await put(setup.console, steps))
        except GatewayError as exc:
            results.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, change(("answer", True), ("intent", True)))
        await setup.reloader.entered.wait()
        nursery.start_soon(one, change(("intent", False), ("answer", True)))
        await trio.testing.wait_all_tasks_blocked()
        assert len(setup.reloader.calls) == 1  # the second waits for the first
        held.set()
    first, second = results
    assert isinstance(first, Sent)
    assert first.status == 200
    assert isinstance(second, Conflict)
    assert second.code == "stale_version"
    assert len(setup.reloader.calls) == 1
    assert [s.name for s in read_steps(setup.file.read_text(), "/v1/chain")] == ["answer", "intent"]
