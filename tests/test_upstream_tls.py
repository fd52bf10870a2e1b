"""The lean upstream client over real TLS: a private CA, mTLS, each failure, resumption, reload.

The backend is ``aiserve-sim --certfile/--keyfile [--require-client-cert CA]`` (a real
process, certificates from trustme), or a bare Trio TLS listener for failures that end
in the handshake. Real sockets and real time, so each request is short.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
import trustme

from aiserve_trio.adapters import h1
from aiserve_trio.adapters.tls import TLSSettings
from aiserve_trio.config import ConfigError, load_config, parse_config
from aiserve_trio.reload import watched_files
from aiserve_trio.runtime.asgi import App
from aiserve_trio.sim.cli import build_parser, tls_error
from aiserve_trio.sim.model import token_text

from .conftest import config_text, make_config
from .servers import ROOT
from .sim_gateway import PATH, chat, post, retries, running, toml_value, upstream_errors
from .sim_process import FAST_ARGS, run_sim

pytestmark = pytest.mark.slow


@dataclass
class PKI:
    """Files of a private CA, a server certificate it signed, and a client certificate."""

    dir: Path
    ca: Path  # the private CA (PEM)
    other_ca: Path  # a CA that signed nothing here
    server_cert: Path  # for 127.0.0.1 and localhost
    server_key: Path
    client_ca: Path  # the CA a mTLS backend trusts for client certificates
    client_cert: Path
    client_key: Path  # mode 600
    ca_obj: trustme.CA


def _write_key(path: Path, pem: bytes) -> Path:
    path.write_bytes(pem)
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    other = trustme.CA()
    client_ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = client_ca.issue_cert("gateway.test")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    other.cert_pem.write_to_path(str(d / "other-ca.pem"))
    client_ca.cert_pem.write_to_path(str(d / "client-ca.pem"))
    server.private_key_and_cert_chain_pem.write_to_path(str(d / "server.pem"))
    _write_key(d / "server.key", server.private_key_pem.bytes())
    (d / "client.pem").write_bytes(b"".join(b.bytes() for b in client.cert_chain_pems))
    _write_key(d / "client.key", client.private_key_pem.bytes())
    return PKI(
        d,
        d / "ca.pem",
        d / "other-ca.pem",
        d / "server.pem",
        d / "server.key",
        d / "client-ca.pem",
        d / "client.pem",
        d / "client.key",
        ca,
    )


@contextlib.contextmanager
def tls_sim(pki: PKI, *extra: str) -> Iterator[int]:
    """``aiserve-sim`` over TLS with the private CA's server certificate; yields its port."""
    tls = ["--certfile", str(pki.server_cert), "--keyfile", str(pki.server_key)]
    with run_sim([*tls, *extra, *FAST_ARGS]) as addr:
        yield int(addr.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def sim_port(pki: PKI) -> Iterator[int]:
    with tls_sim(pki) as port:
        yield port


@pytest.fixture(scope="module")
def mtls_port(pki: PKI) -> Iterator[int]:
    with tls_sim(pki, "--require-client-cert", str(pki.client_ca)) as port:
        yield port


def _adapter(name: str, port: int, **settings: str | int | bool) -> str:
    lines = "\n".join(f"{k} = {toml_value(v)}" for k, v in settings.items())
    return f"""
[adapters.{name}]
kind = "openai"
base_url = "https://127.0.0.1:{port}/v1"
models = ["sim-model"]
backoff_base_ms = 10
backoff_max_ms = 20
{lines}
"""


def tls_app(port: int, **settings: str | int | bool) -> App:
    """An app whose route ``/v1/up`` goes to adapter ``up`` at ``https://127.0.0.1:port``."""
    route = f"""
[[routes]]
path = "{PATH}"
name = "up"
adapter = "up"
default_model = "sim-model"
"""
    return App(make_config(_adapter("up", port, **settings) + route))


def handshakes(app: App, kind: str, adapter: str = "up") -> float:
    labels = {"adapter": adapter, "kind": kind}
    value = app.metrics.registry.get_sample_value("aiserve_upstream_tls_handshakes_total", labels)
    return value or 0.0


async def _tls_error(app: App) -> str:
    """The error message of one request that must fail with ``upstream_tls_error``."""
    async with running(app) as client:
        r = await post(client, chat(max_tokens=2))
    assert r.status == 502, r.text()
    error = r.json()["error"]
    assert error["code"] == "upstream_tls_error", error
    assert "up:" in error["message"]  # the adapter is named
    assert upstream_errors(app, "upstream_tls_error") == 1  # counted
    assert retries(app) == 2  # retried like a connect error
    return str(error["message"])


# --- it works -------------------------------------------------------------------------


async def test_a_private_ca_backend_works_with_ca_file_alone_and_new_connections_resume(
    pki: PKI, sim_port: int
) -> None:
    app = tls_app(sim_port, ca_file=str(pki.ca))
    async with running(app) as client:
        for _ in range(3):  # one after another: one connection, kept and reused
            first = await post(client, chat(max_tokens=3))
            assert first.status == 200, first.text()
        assert handshakes(app, "full") == 1
        assert handshakes(app, "resumed") == 0
        # Two at once: one reuses the kept connection, the other opens one, which
        # offers the session the first connection was given and resumes it.
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(post, client, chat(max_tokens=3))
        assert handshakes(app, "full") == 1
        assert handshakes(app, "resumed") == 1
        again = await post(client, chat(stream=True, max_tokens=4))
    assert again.status == 200
    assert again.text() == "".join(token_text(i) for i in range(4))


@pytest.mark.parametrize("http2", [False, True])
async def test_server_name_verifies_an_ip_addressed_backend_by_its_name(
    pki: PKI, sim_port: int, http2: bool
) -> None:
    app = tls_app(sim_port, ca_file=str(pki.ca), server_name="localhost", http2=http2)
    async with running(app) as client:
        r = await post(client, chat(max_tokens=2))
    assert r.status == 200, r.text()
    app = tls_app(sim_port, ca_file=str(pki.ca), server_name="elsewhere.test", http2=http2)
    async with running(app) as client:
        r = await post(client, chat(max_tokens=2))
    assert r.status == 502  # the name is checked, not only sent


async def test_a_handshake_that_never_ends_times_out_and_leaves_no_descriptor(pki: PKI) -> None:
    silent = trio.socket.socket()
    await silent.bind(("127.0.0.1", 0))
    silent.listen()
    port = silent.getsockname()[1]
    context = ssl.create_default_context(cafile=str(pki.ca))
    tls = TLSSettings(context, "127.0.0.1")
    pool = h1.H1Pool("127.0.0.1", port, max_connections=1, tls=tls)
    head = h1.RequestHead("GET", "/", "x", []).build([], None)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(h1.ConnectTimeout):
            async with pool.request(head, b"", h1.Timeouts(io=5.0, connect=0.1)):
                pass
    assert len(os.listdir("/proc/self/fd")) == before
    silent.close()


@pytest.mark.parametrize("settings", [{"http2": True}, {"client": "httpx2"}])
async def test_httpx2_takes_the_same_tls_settings(
    pki: PKI, mtls_port: int, settings: dict[str, str | bool]
) -> None:
    # HTTP/2 over ALPN stays on httpx2: the same private CA and client certificate apply.
    app = tls_app(
        mtls_port,
        ca_file=str(pki.ca),
        client_cert=str(pki.client_cert),
        client_key=str(pki.client_key),
        **settings,
    )
    async with running(app) as client:
        r = await post(client, chat(stream=True, max_tokens=3))
    assert r.status == 200, r.text()
    assert r.text() == "".join(token_text(i) for i in range(3))


async def test_mtls_backend_accepts_the_configured_client_certificate(
    pki: PKI, mtls_port: int
) -> None:
    app = tls_app(
        mtls_port,
        ca_file=str(pki.ca),
        client_cert=str(pki.client_cert),
        client_key=str(pki.client_key),
    )
    async with running(app) as client:
        r = await post(client, chat(max_tokens=2))
    assert r.status == 200, r.text()


# --- each failure: 502 upstream_tls_error, named, counted, retried --------------------


async def test_unknown_ca(pki: PKI, sim_port: int) -> None:
    message = await _tls_error(tls_app(sim_port, ca_file=str(pki.other_ca)))
    assert "unknown CA" in message


async def test_the_system_store_does_not_trust_a_private_ca(sim_port: int) -> None:
    message = await _tls_error(tls_app(sim_port))
    assert "unknown CA" in message


async def test_name_mismatch(pki: PKI, sim_port: int) -> None:
    message = await _tls_error(tls_app(sim_port, ca_file=str(pki.ca), server_name="elsewhere.test"))
    assert "name mismatch" in message


async def test_client_certificate_refused_by_a_backend_that_says_so(pki: PKI) -> None:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.client_ca))
    context.verify_mode = ssl.CERT_REQUIRED
    pki.ca_obj.issue_cert("127.0.0.1").configure_cert(context)
    with tls_listener(context) as port:
        message = await _tls_error(tls_app(port, ca_file=str(pki.ca)))  # none presented
    assert "refused the client certificate" in message


async def test_client_certificate_refused_by_a_backend_that_just_closes(
    pki: PKI, mtls_port: int
) -> None:
    # aiserve-sim (hypercorn on Trio) closes without the alert: under TLS 1.3 the
    # client's side of the handshake is over by then, and the close is all it sees.
    message = await _tls_error(tls_app(mtls_port, ca_file=str(pki.ca)))  # none presented
    assert "client certificate" in message


async def test_a_client_certificate_from_another_ca_is_refused(pki: PKI, mtls_port: int) -> None:
    stranger = trustme.CA().issue_cert("gateway.test")
    cert = pki.dir / "stranger.pem"
    cert.write_bytes(b"".join(b.bytes() for b in stranger.cert_chain_pems))
    key = _write_key(pki.dir / "stranger.key", stranger.private_key_pem.bytes())
    app = tls_app(mtls_port, ca_file=str(pki.ca), client_cert=str(cert), client_key=str(key))
    message = await _tls_error(app)
    assert "refused the client certificate" in message


@contextlib.contextmanager
def tls_listener(context: ssl.SSLContext) -> Iterator[int]:
    """A bare TLS server that only shakes hands, on a thread with the stdlib's blocking
    ``ssl`` (which sends its alerts, as nginx or Node do; a Trio server drops them)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(5)
            with (
                contextlib.suppress(OSError),
                conn,
                context.wrap_socket(conn, server_side=True) as tls,
            ):
                while tls.recv(65536):
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        listener.close()


async def test_expired_certificate(pki: PKI) -> None:
    now = datetime.datetime.now(datetime.UTC)
    old = pki.ca_obj.issue_cert(
        "127.0.0.1",
        not_before=now - datetime.timedelta(days=30),
        not_after=now - datetime.timedelta(days=1),
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    old.configure_cert(context)
    with tls_listener(context) as port:
        message = await _tls_error(tls_app(port, ca_file=str(pki.ca)))
    assert "expired" in message


async def test_protocol_mismatch(pki: PKI) -> None:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    pki.ca_obj.issue_cert("127.0.0.1").configure_cert(context)
    with tls_listener(context) as port:
        message = await _tls_error(tls_app(port, ca_file=str(pki.ca), tls_min_version="1.3"))
    assert "no TLS protocol version" in message
    # The default (TLS 1.2 and up) speaks to it.
    with tls_listener(context) as port:
        app = tls_app(port, ca_file=str(pki.ca))
        async with running(app) as client:
            r = await post(client, chat(max_tokens=2))
        # The listener shakes hands and answers nothing: not a TLS error any more.
        assert upstream_errors(app, "upstream_tls_error") == 0
        assert handshakes(app, "full") >= 1
        assert r.status in (502, 504)


async def test_a_tls_failure_fails_over_to_the_next_deployment(pki: PKI, sim_port: int) -> None:
    extra = (
        _adapter("stranger", sim_port, ca_file=str(pki.other_ca), max_retries=0)
        + _adapter("trusted", sim_port, ca_file=str(pki.ca))
        + f"""
[adapters.up]
kind = "group"
models = ["sim-model"]
deployments = [{{ adapter = "stranger" }}]
fallbacks = ["trusted"]

[[routes]]
path = "{PATH}"
name = "up"
adapter = "up"
default_model = "sim-model"
"""
    )
    app = App(make_config(extra))
    async with running(app) as client:
        r = await post(client, chat(max_tokens=2))
    assert r.status == 200, r.text()
    assert handshakes(app, "full", adapter="trusted") == 1


# --- reload ---------------------------------------------------------------------------


async def test_a_changed_ca_file_is_taken_on_reload(pki: PKI, sim_port: int, tmp_path: Path) -> None:
    ca = tmp_path / "upstream-ca.pem"
    ca.write_bytes(pki.other_ca.read_bytes())  # the wrong CA first
    path = tmp_path / "aiserve.toml"
    route = f"""
[[routes]]
path = "{PATH}"
name = "up"
adapter = "up"
default_model = "sim-model"
"""
    adapter = _adapter("up", sim_port, ca_file="upstream-ca.pem", max_retries=0)
    path.write_text(config_text() + adapter + route)  # the path relative to the file
    app = App(load_config(path))
    assert ca in watched_files(app.config)  # the file watcher sees it change too
    async with running(app) as client:
        r = await post(client, chat(max_tokens=2))
        assert r.status == 502
        ca.write_bytes(pki.ca.read_bytes())  # the operator fixes the bundle, same path
        result = await app.reloader.reload(by="test")
        assert result.applied, result
        r = await post(client, chat(max_tokens=2))
    assert r.status == 200, r.text()


# --- settings, checked at load ----------------------------------------------------------


def _load(tmp_path: Path, **settings: str) -> None:
    path = tmp_path / "aiserve.toml"
    path.write_text(config_text() + _adapter("up", 443, **settings))
    load_config(path)


def test_an_unreadable_ca_file_is_one_line_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, ca_file="missing.pem")
    message = str(info.value)
    assert "\n" not in message
    assert "key `adapters.up.ca_file`" in message
    assert "missing.pem" in message


def test_a_ca_file_that_is_not_pem_is_refused(tmp_path: Path) -> None:
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match=r"key `adapters.up.ca_file`: not usable"):
        _load(tmp_path, ca_file="junk.pem")


def _beside(tmp_path: Path, source: Path) -> str:
    """A copy of ``source`` in the config's folder (files outside it are not read)."""
    copy = tmp_path / source.name
    copy.write_bytes(source.read_bytes())
    return str(copy)


def test_a_client_key_others_may_read_is_refused(pki: PKI, tmp_path: Path) -> None:
    key = tmp_path / "client.key"
    key.write_bytes(pki.client_key.read_bytes())
    key.chmod(0o644)
    cert = _beside(tmp_path, pki.client_cert)
    with pytest.raises(ConfigError, match=r"key `adapters.up.client_key`: .* readable by others"):
        _load(tmp_path, client_cert=cert, client_key=str(key))
    key.chmod(0o600)
    _load(tmp_path, client_cert=cert, client_key=str(key))


def test_a_client_key_that_does_not_match_the_certificate_is_refused(
    pki: PKI, tmp_path: Path
) -> None:
    key = _write_key(tmp_path / "other.key", trustme.CA().issue_cert("x.test").private_key_pem.bytes())
    with pytest.raises(ConfigError, match=r"key `adapters.up.client_cert`: not usable"):
        _load(tmp_path, client_cert=_beside(tmp_path, pki.client_cert), client_key=str(key))


def test_client_cert_and_client_key_go_together(pki: PKI, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="client_key"):
        _load(tmp_path, client_cert=str(pki.client_cert))


@pytest.mark.parametrize("key", ["verify", "insecure", "verify_ssl", "tls_verify"])
def test_there_is_no_switch_to_turn_verification_off(tmp_path: Path, key: str) -> None:
    path = tmp_path / "aiserve.toml"
    path.write_text(config_text() + _adapter("up", 443) + f"{key} = false\n")
    with pytest.raises(ConfigError, match=key):
        load_config(path)


def test_tls_min_version_takes_1_2_or_1_3(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tls_min_version"):
        _load(tmp_path, tls_min_version="1.1")
    assert parse_config(
        config_text() + _adapter("up", 443, tls_min_version="1.3"), source="<t>"
    ).adapters["up"]


# --- aiserve-sim's TLS flags ----------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (["--certfile", "cert.pem"], "--certfile and --keyfile go together"),
        (["--require-client-cert", "ca.pem"], "--require-client-cert needs --certfile"),
        (["--certfile", "nowhere.pem", "--keyfile", "nowhere.key"], "--certfile: cannot read"),
        ([], None),
    ],
)
def test_the_sim_refuses_tls_flags_it_cannot_use(flags: list[str], problem: str | None) -> None:
    error = tls_error(build_parser().parse_args(flags))
    assert error == problem if problem is None else (error or "").startswith(problem)


def test_the_server_on_an_unreadable_ca_file_says_one_line_and_exits(tmp_path: Path) -> None:
    cfg = tmp_path / "gateway.toml"
    cfg.write_text(config_text() + _adapter("up", 443, ca_file="gone.pem"))
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "hypercorn"),
            "--config",
            str(ROOT / "configs/hypercorn.toml"),
            "--bind",
            "127.0.0.1:0",
            "aiserve_trio:app",
        ],
        env={"AISERVE_CONFIG": str(cfg), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode != 0
    lines = proc.stderr.decode().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"aiserve-trio: not started: {cfg}: key `adapters.up.ca_file`: ")
    assert "gone.pem: No such file or directory" in lines[0]
