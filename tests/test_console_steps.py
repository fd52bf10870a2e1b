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

from aiserve_trio.config import Config, parse_config
from aiserve_trio.console.edit import read_steps
from aiserve_trio.console.handlers import Console, Result
from aiserve_trio.core.errors import (
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
from aiserve_trio.reload import config_version
from aiserve_trio.security.auth import Principal
from aiserve_trio.security.gate import Gate

from .asgi_client import make_scope
from .conftest import config_text

STEPS = '''
[[routes]]
path = "/v1/chain"
adapter = "mock"

# Classify first.
[[routes.steps]]
name = "intent"
kind = "classify"
[[routes.steps.rules]]
label = "greeting"
pattern = 'hello'

[[routes.steps]]
name = "answer"
kind = "classify"
key = "answer"
[[routes.steps.rules]]
label = "yes"
pattern = 'yes'

[[routes.steps]]
name = "reply"
kind = "generate"
'''
OPS = Principal(key_id="ops", tenant="t", routes=frozenset("*"), channels=frozenset("*"), admin=True,
                global_admin=True)


@dataclass(frozen=True)
class Outcome:
    applied: bool
    version: str
    error: str | None
    unchanged: bool = False


def version_of(path: Path) -> str:
    return config_version(parse_config(path.read_text(), source=str(path), base_dir=path.parent))


@dataclass
class FakeReloader:
    """Answers like the reloader; writes the candidate as the real one would when valid."""

    path: Path
    version: str = ""
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
        self.version = version_of(self.path)
        return Outcome(applied=True, version=self.version, error=None)

    def status(self) -> dict[str, object]:
        return {"version": self.version, "last_refused": None}


@dataclass
class Host:
    config: Config
    gate: Gate
    metrics: Metrics
    observer: RequestObserver
    cache: None = None


@dataclass
class Setup:
    console: Console
    reloader: FakeReloader
    file: Path


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    file = tmp_path / "gateway.toml"
    file.write_text("# the operator's file\n" + config_text() + STEPS)
    config = parse_config(file.read_text(), source=str(file), base_dir=tmp_path)
    metrics = Metrics()
    host = Host(config, Gate(config), metrics, RequestObserver(metrics, None))
    reloader = FakeReloader(file, version_of(file))
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


def change(setup: Setup, *steps: tuple[str, bool], version: str | None = None,
           path: str = "/v1/chain") -> dict[str, Any]:
    return {
        "path": path,
        "version": setup.reloader.version if version is None else version,
        "steps": [{"name": n, "enabled": e} for n, e in steps],
    }


async def test_a_new_order_goes_to_the_reloader_as_the_whole_file(setup: Setup) -> None:
    first = setup.reloader.version
    sent = await put(setup.console, change(setup, ("answer", True), ("intent", False), ("reply", True)))
    assert sent.status == 200
    assert sent.json() == {"applied": True, "unchanged": False, "version": setup.reloader.version}
    assert sent.json()["version"] != first
    ((by, candidate),) = setup.reloader.calls
    assert by == "console:ops"
    assert candidate is not None
    assert candidate.startswith("# the operator's file\n")
    assert "# Classify first.\n[[routes.steps]]\nname = \"intent\"" in candidate
    assert [(s.name, s.enabled) for s in read_steps(candidate, "/v1/chain")] == [
        ("answer", True), ("intent", False), ("reply", True)
    ]


async def test_with_auth_off_the_change_is_by_loopback(setup: Setup) -> None:
    await put(setup.console, change(setup, ("answer", True), ("intent", True), ("reply", True)), principal=None)
    assert setup.reloader.calls[0][0] == "console:loopback"


async def test_a_stale_version_is_a_conflict_and_nothing_is_reloaded(setup: Setup) -> None:
    with pytest.raises(Conflict, match="changed since this page read it") as err:
        await put(setup.console, change(setup, ("answer", True), ("intent", True), ("reply", True), version="v0"))
    assert (err.value.status, err.value.code, err.value.param) == (409, "stale_version", "version")
    assert setup.reloader.calls == []


async def test_a_file_changed_on_disk_but_not_reloaded_is_a_conflict(setup: Setup) -> None:
    text = setup.file.read_text()
    # Comments and formatting are not a change of the config: the edit goes ahead.
    setup.file.write_text(text + "\n# a note by hand\n")
    sent = await put(setup.console, change(setup, ("answer", True), ("intent", True), ("reply", True)))
    assert sent.status == 200
    candidate = setup.reloader.calls[-1][1]
    assert candidate is not None
    assert candidate.endswith("# a note by hand\n")
    # A setting changed by hand and not reloaded yet: the console would apply it unseen.
    setup.file.write_text(setup.file.read_text().replace("max_messages = 256", "max_messages = 8"))
    with pytest.raises(Conflict, match="changed on disk since it was loaded") as err:
        await put(setup.console, change(setup, ("intent", True), ("answer", True), ("reply", True)))
    assert err.value.code == "config_file_changed"
    assert len(setup.reloader.calls) == 1
    setup.file.write_text("[[routes]\n")
    with pytest.raises(Conflict, match="not valid now"):
        await put(setup.console, change(setup, ("intent", True), ("answer", True), ("reply", True)))


async def test_the_reloaders_refusal_is_a_422_with_its_line(setup: Setup) -> None:
    line = f"{setup.file}: key `routes[1].steps[0]`: a classify step must come first"
    setup.reloader.refuse = line
    with pytest.raises(Unprocessable) as err:
        await put(setup.console, change(setup, ("answer", True), ("intent", True), ("reply", True)))
    assert (err.value.status, err.value.code, err.value.message) == (422, "config_refused", line)


@pytest.mark.parametrize(
    ("steps", "code"),
    [
        ((("answer", True), ("reply", True)), "invalid_steps"),
        ((("answer", True), ("intent", True), ("reply", True), ("extra", True)), "unknown_step"),
    ],
)
async def test_steps_that_are_not_the_routes_are_422(
    setup: Setup, steps: tuple[tuple[str, bool], ...], code: str
) -> None:
    with pytest.raises(Unprocessable) as err:
        await put(setup.console, change(setup, *steps))
    assert (err.value.code, err.value.param) == (code, "steps")
    assert setup.reloader.calls == []


async def test_an_unknown_route_is_422(setup: Setup) -> None:
    with pytest.raises(Unprocessable, match="no route with path /v1/nope"):
        await put(setup.console, change(setup, ("a", True), ("reply", True), path="/v1/nope"))


@pytest.mark.parametrize(
    ("body", "ctype", "error"),
    [
        (b"{", "application/json", BadRequest),
        ({"path": "/v1/chain", "steps": []}, "application/json", BadRequest),  # no version
        ({"path": "/v1/chain", "version": "x", "steps": [], "extra": 1}, "application/json", BadRequest),
        ({"path": "/v1/chain", "version": "v1", "steps": [{"name": 3}]}, "application/json", BadRequest),
        ({"path": "/v1/chain", "version": "x", "steps": []}, "text/plain", UnsupportedMediaType),
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
        await put(setup.console, change(setup, ("answer", True), ("intent", True), ("reply", True)))
    assert err.value.code == "config_not_writable"
    host = setup.console.host
    assert isinstance(host, Host)
    setup.console.reloader = setup.reloader
    host.config = msgspec.structs.replace(host.config, source="<embedded aiserve.toml>")
    with pytest.raises(Conflict, match="without a config file"):
        await put(setup.console, change(setup, ("answer", True), ("intent", True), ("reply", True)))


async def test_two_changes_at_once_one_waits_and_then_is_stale(setup: Setup) -> None:
    held = setup.reloader.gate = trio.Event()
    results: list[Sent | GatewayError] = []

    async def one(steps: dict[str, Any]) -> None:
        try:
            results.append(await put(setup.console, steps))
        except GatewayError as exc:
            results.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, change(setup, ("answer", True), ("intent", True), ("reply", True)))
        await setup.reloader.entered.wait()
        nursery.start_soon(one, change(setup, ("intent", False), ("answer", True), ("reply", True)))
        await trio.testing.wait_all_tasks_blocked()
        assert len(setup.reloader.calls) == 1  # the second waits for the first
        held.set()
    first, second = results
    assert isinstance(first, Sent)
    assert first.status == 200
    assert isinstance(second, Conflict)
    assert second.code == "stale_version"
    assert len(setup.reloader.calls) == 1
    assert [s.name for s in read_steps(setup.file.read_text(), "/v1/chain")] == [
        "answer", "intent", "reply"
    ]
