"""The hypercorn seam (``server/``): one attribute of hypercorn replaced at start-up,
none with ``AISERVE_HYPERCORN_PATCHES=off``; a hypercorn whose pinned methods changed is
refused (or run as shipped when hypercorn's TOML allows it); the pin and the seam agree."""

from __future__ import annotations

import importlib
import logging
import os
import pkgutil
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any
from wsgiref.handlers import format_date_time

import hypercorn
import pytest
import trio
from hypercorn.config import Config
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from aiserve_trio import server
from aiserve_trio.runtime.asgi import App
from aiserve_trio.server import datecache
from aiserve_trio.server.fingerprints import PINNED, SUPPORTED, fingerprint, problems
from aiserve_trio.server.tcp import GatewayTCPServer
from aiserve_trio.server.worker import Worker

from .servers import BIN, ROOT, free_port


def hypercorn_attributes() -> dict[str, int]:
    """Every attribute of every hypercorn module and of every class defined in one, by
    ``module.name`` / ``module.Class.name``, to the identity of its value."""
    for info in pkgutil.walk_packages(hypercorn.__path__, "hypercorn."):
        try:
            importlib.import_module(info.name)
        except ImportError:  # the optional HTTP/3 and asyncio extras
            continue
    out: dict[str, int] = {}
    for name, module in list(sys.modules.items()):
        if name != "hypercorn" and not name.startswith("hypercorn."):
            continue
        for attr, value in vars(module).items():
            out[f"{name}.{attr}"] = id(value)
            if isinstance(value, type) and value.__module__ == name:
                for cattr, cvalue in vars(value).items():
                    out[f"{name}.{attr}.{cattr}"] = id(cvalue)
    return out


def changed(before: dict[str, int], after: dict[str, int]) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


async def start_and_stop(app: App) -> None:
    async with trio.open_nursery() as nursery:
        await app.startup(nursery)
        nursery.cancel_scope.cancel()
    await app.shutdown()


async def test_start_up_replaces_two_hypercorn_attributes_the_server_class_and_its_trio(
    make_app: Callable[..., App], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(server.SWITCH, raising=False)
    before = hypercorn_attributes()
    await start_and_stop(make_app())
    # The worker's server class, and the trio its worker module builds listeners with
    # (server/accept.py: every waiting connection accepted at once).
    assert changed(before, hypercorn_attributes()) == [
        "hypercorn.trio.run.TCPServer",
        "hypercorn.trio.run.trio",
    ]
    from hypercorn.trio import run

    built: Any = run.TCPServer  # type: ignore[attr-defined]
    # The seam's server, bound to the worker's state (no module holds it).
    assert built.func is GatewayTCPServer
    assert isinstance(built.keywords["worker"], Worker)
    assert server.installed()


async def test_with_patches_off_nothing_of_hypercorn_changes(
    make_app: Callable[..., App], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AISERVE_HYPERCORN_PATCHES", "off")
    before = hypercorn_attributes()
    with caplog.at_level(logging.INFO):
        await start_and_stop(make_app())
    assert changed(before, hypercorn_attributes()) == []
    assert "hypercorn seam: off (AISERVE_HYPERCORN_PATCHES=off)" in caplog.text


def test_every_pinned_method_matches_this_hypercorn() -> None:
    assert problems() == []
    # Each pin names something that is there and is hypercorn's (or its HTTP/2 library's).
    assert all(path.startswith(("hypercorn.", "h2.")) for path in PINNED)


def test_a_changed_method_is_refused_and_named(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(server.SWITCH, raising=False)
    path = "hypercorn.protocol.h2:H2Protocol._handle_events"
    pins = {**PINNED, path: "0" * 16}
    assert problems(pins) == [
        f"{path} changed (fingerprint {fingerprint(path)}, the seam knows {'0' * 16})"
    ]
    with pytest.raises(server.SeamRefused, match=r"H2Protocol\._handle_events changed"):
        server.install(Config(), pinned=pins)
    assert not server.installed()
    allowed = Config()
    allowed.aiserve_allow_unpatched = True  # type: ignore[attr-defined]
    with caplog.at_level(logging.ERROR):
        assert (
            server.install(allowed, pinned=pins) == "not installed (hypercorn as shipped)"
        )
    assert not server.installed()
    assert any(r.levelno == logging.ERROR and path in r.getMessage() for r in caplog.records)


def test_a_pinned_name_that_is_gone_is_refused() -> None:
    assert problems({"hypercorn.protocol.h2:H2Protocol.handle_gone": "0" * 16}) == [
        "hypercorn.protocol.h2:H2Protocol.handle_gone is not there"
    ]


def test_the_dependency_pin_is_the_range_the_seam_supports() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [Requirement(d) for d in project["dependencies"] if d.startswith("hypercorn")]
    assert len(pins) == 1
    ((major, minor),) = SUPPORTED  # one minor series; a second one needs its own pin thought
    assert pins[0].specifier == SpecifierSet(f">={major}.{minor},<{major}.{minor + 1}")


# --- the real binary on a hypercorn with one pinned method changed ----------------------


def changed_hypercorn(tmp: Path) -> Path:
    """A copy of this hypercorn whose H2Protocol._handle_events has one line more."""
    copy = tmp / "site"
    shutil.copytree(Path(hypercorn.__file__).parent, copy / "hypercorn")
    h2 = copy / "hypercorn" / "protocol" / "h2.py"
    text = h2.read_text()
    anchor = "    async def _handle_events(self, events: list[h2.events.Event]) -> None:\n"
    assert anchor in text
    h2.write_text(text.replace(anchor, anchor + "        events = list(events)\n"))
    return copy


def run_binary(site: Path, extra_toml: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    cfg = tmp / "hypercorn.toml"
    cfg.write_text((ROOT / "configs" / "hypercorn.toml").read_text() + "\n" + extra_toml)
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT / 'src'}"}
    env.pop("AISERVE_CONFIG", None)
    env.pop("AISERVE_HYPERCORN_PATCHES", None)
    port = free_port()
    args = [str(BIN / "hypercorn"), "--config", str(cfg), "--bind", f"127.0.0.1:{port}"]
    proc = subprocess.Popen(
        [*args, "aiserve_trio:app"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=8)
    except subprocess.TimeoutExpired:  # it serves: stop it and say what it logged
        proc.terminate()
        out, err = proc.communicate(timeout=10)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
def test_the_binary_refuses_to_start_on_a_hypercorn_with_a_changed_method(tmp_path: Path) -> None:
    site = changed_hypercorn(tmp_path)
    done = run_binary(site, "", tmp_path)
    assert done.returncode not in (0, None), done.stderr[-2000:]
    refusal = [line for line in done.stderr.splitlines() if line.startswith("aiserve-trio:")]
    assert len(refusal) == 1, done.stderr[-2000:]
    assert "not started: the hypercorn seam cannot be installed" in refusal[0]
    assert "H2Protocol._handle_events changed" in refusal[0]


@pytest.mark.slow
def test_allowed_unpatched_it_serves_on_hypercorn_as_shipped_and_logs_an_error(
    tmp_path: Path,
) -> None:
    site = changed_hypercorn(tmp_path)
    done = run_binary(site, "aiserve_allow_unpatched = true\n", tmp_path)
    log = done.stderr
    assert "aiserve-trio ready" in log, log[-2000:]
    assert "[ERROR] hypercorn seam not installed" in log, log[-2000:]
    assert "hypercorn seam: not installed (hypercorn as shipped)" in log


# --- the Date header -------------------------------------------------------------------


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


def test_the_seams_config_says_what_hypercorns_says() -> None:
    config = Config()
    worker = Worker(config)
    view = worker.dated(config)
    assert worker.dated(config) is view
    config.include_server_header = False  # the view reads the config itself, not a copy
    for protocol in ("h11", "h2"):
        got = view.response_headers(protocol)
        want = config.response_headers(protocol)
        if got != want:  # the second turned between the two calls
            time.sleep(0.01)
            got, want = view.response_headers(protocol), config.response_headers(protocol)
        assert got == want
    assert view.keep_alive_timeout == config.keep_alive_timeout
    assert vars(config) == vars(Config()) | {"include_server_header": False}  # nothing added
