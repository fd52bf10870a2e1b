import sqlite3
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from aiserve_trio.config import (
    ConfigError,
    MockAdapterConfig,
    default_config_text,
    load_config,
    parse_config,
)

from .servers import ROOT


def _with(replace: str, by: str) -> str:
    text = default_config_text()
    assert replace in text
    return text.replace(replace, by, 1)


def _hypercorn(
    workers: int, env: dict[str, str], config: str = "configs/hypercorn.toml", cwd: Path | None = None
) -> subprocess.CompletedProcess[bytes]:
    """The real hypercorn binary on ``config``, run to its end: its parent process is what a
    supervisor watches."""
    return subprocess.run(
        [
            str(Path(sys.executable).parent / "hypercorn"),
            "--config",
            str(ROOT / config),
            "--bind",
            "127.0.0.1:0",
            "--workers",
            str(workers),
            "aiserve_trio:app",
        ],
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src"), **env},
        capture_output=True,
        timeout=30,
        check=False,
    )


def test_embedded_default_is_the_configs_file():
    assert (ROOT / "configs" / "aiserve.toml").read_text() == default_config_text()


def test_embedded_default_loads_with_the_documented_defaults(monkeypatch):
    monkeypatch.delenv("AISERVE_CONFIG", raising=False)
    cfg = load_config()
    assert (cfg.budgets.context, cfg.budgets.inference, cfg.budgets.sse) == (0.40, 0.35, 0.25)
    assert cfg.deadline.reserve_ms == 100
    assert cfg.deadline.min_inference_ms == 50
    assert cfg.routes[0].path == "/v1/chat/completions"
    assert cfg.adapters["mock"].models == ["aiserve-mock"]


def test_aiserve_config_env_names_the_file(tmp_path, monkeypatch):
    f = tmp_path / "x.toml"
    f.write_text(_with("inter_token_ms = 20", "inter_token_ms = 7"))
    monkeypatch.setenv("AISERVE_CONFIG", str(f))
    mock = load_config().adapters["mock"]
    assert isinstance(mock, MockAdapterConfig)
    assert mock.inter_token_ms == 7


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (_with("[deadline]", "[deadline]\nbogus = 1"), "unknown key `deadline.bogus`"),
        (
            _with("reserve_ms = 100", 'reserve_ms = "100"'),
            "key `deadline.reserve_ms`: Expected `int`",
        ),
        (_with("sse = 0.25", "sse = 0.30"), "key `budgets`: shares must sum to 1.0"),
        (
            _with('adapter = "mock"', 'adapter = "gpt"'),
            "key `routes[0].adapter`: unknown adapter 'gpt'",
        ),
        (
            _with("policies = []", 'policies = ["no-such-policy"]'),
            "key `routes[0].policies[0]`: unknown policy 'no-such-policy'",
        ),
        (
            _with('on_context_timeout = "fail"', 'on_context_timeout = "retry"'),
            "key `routes[0].on_context_timeout`",
        ),
        (_with("[server]", "[serverx]"), "unknown key `serverx`"),
        (
            _with("default_ms = 30000", "default_ms = 300000"),
            "key `deadline.default_ms`: must not exceed `max_ms` (120000)",
        ),
        (
            _with("pattern = '\\b(hello", "pattern = '((hello"),
            "key `adapters.mock.rules[0].pattern`: not a regular expression",
        ),
        (_with('name = "chat"', 'name = "Chat-Route"'), "key `routes[0].name`"),
        ("this is = = not toml", "not valid TOML"),
        # a dict's key is named even though msgspec's path says only `adapters[...]`
        (
            _with('models = ["aiserve-mock"]', "models = []"),
            "key `adapters.mock.models`: must name at least one model",
        ),
        (
            _with("ttft_ms = 60", 'ttft_ms = "fast"'),
            "key `adapters.mock.ttft_ms`: Expected `float`",
        ),
        (
            _with('default_tenant = "default"', 'default_tenant = "a:b"'),
            "key `server.default_tenant`: tenant 'a:b' must match",
        ),
        (
            _with('backend = "memory"', 'backend = "memory"\npool_size = 0'),
            "key `sessions.pool_size`: must be positive",
        ),
        (
            _with("context_ttl = 86400", "context_ttl = 86400\ntenant = 'x y'"),
            "key `routes[0].tenant`: tenant 'x y' must match",
        ),
        # a default above the maximum it pairs with, wherever such a pair exists
        (
            _with("context_ttl = 86400", "context_ttl = 86400\ndeadline = {default_ms = 20000, max_ms = 700}"),
            "key `routes[0].deadline.default_ms`: the default (20000 ms) must not exceed the maximum (700 ms)",
        ),
        (
            _with("context_ttl = 86400", "context_ttl = 86400\ndeadline = {max_ms = 700}"),
            "key `routes[0].deadline.max_ms`: the default (30000 ms) must not exceed the maximum (700 ms)",
        ),
        (
            _with("body_read_timeout_ms = 5000", "body_read_timeout_ms = 60000"),
            "key `limits.body_read_timeout_ms`: must not exceed `body_total_timeout_ms` (30000)",
        ),
        (
            _with('backend = "memory"', 'backend = "memory"\noutbox_retry_ms = 9000'),
            "key `sessions.outbox_retry_ms`: must not exceed `outbox_retry_max_ms` (5000)",
        ),
    ],
)
def test_bad_configs_are_refused_naming_the_key_and_file(text, message):
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="bad.toml")
    assert str(info.value).startswith("bad.toml: ")
    assert message in str(info.value)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.toml: cannot read"):
        load_config(tmp_path / "nope.toml")


def test_budgets_within_tolerance_are_accepted():
    cfg = parse_config(_with("sse = 0.25", "sse = 0.2505"))
    assert cfg.budgets.sse == 0.2505


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize(
    ("case", "line"),
    [
        ("invalid", "key `budgets`: shares must sum to 1.0"),
        ("missing", "cannot read config file: No such file or directory"),
    ],
)
def test_server_on_a_bad_config_says_one_line_and_exits_non_zero(tmp_path, workers, case, line):
    # The real hypercorn binary: its parent process is what a supervisor watches.
    bad = tmp_path / "bad.toml"
    if case == "invalid":
        bad.write_text(_with("sse = 0.25", "sse = 0.5"))
    proc = _hypercorn(workers, {"AISERVE_CONFIG": str(bad)})
    assert proc.returncode != 0, proc
    assert proc.stdout == b""
    lines = proc.stderr.decode().splitlines()
    assert len(lines) == 1, proc.stderr.decode()
    assert lines[0].startswith(f"aiserve-trio: not started: {bad}: ")
    assert line in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_server_whose_start_up_fails_says_one_line_and_exits_non_zero(tmp_path, workers):
    # A valid config whose start-up fails all the same: the audit database was migrated
    # by a newer gateway. hypercorn would print the ExceptionGroup and exit 0.
    db = tmp_path / "audit.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE audit_schema (version INTEGER NOT NULL)")
        conn.execute("INSERT INTO audit_schema (version) VALUES (999)")
    cfg = tmp_path / "aiserve.toml"
    cfg.write_text(default_config_text() + f'\n[audit]\nbackend = "sqlite"\npath = "{db}"\n')
    proc = _hypercorn(workers, {"AISERVE_CONFIG": str(cfg)})
    assert proc.returncode != 0, proc
    lines = proc.stderr.decode().splitlines()
    # The start-up's own log lines come first; then the one line, and no traceback.
    assert "Traceback" not in proc.stderr.decode()
    refusal = [line for line in lines if "not started" in line]
    assert refusal == [lines[-1]], proc.stderr.decode()
    assert lines[-1].startswith(f"aiserve-trio: not started: {cfg}: start-up failed: SchemaTooNew: ")
    assert "schema version 999" in lines[-1]


async def test_outside_hypercorn_a_bad_config_fails_the_lifespan_start_up(tmp_path, monkeypatch):
    # Not a hypercorn process (pytest): nothing exits, the ASGI way is kept.
    from aiserve_trio import _DeferredApp
    from aiserve_trio.runtime.startup import hypercorn_process

    assert hypercorn_process() is None
    monkeypatch.setenv("AISERVE_CONFIG", str(tmp_path / "nope.toml"))
    sent: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        return {"type": "lifespan.startup"}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    await _DeferredApp()({"type": "lifespan"}, receive, send)
    assert len(sent) == 1
    assert sent[0]["type"] == "lifespan.startup.failed"
    assert "nope.toml: cannot read config file" in str(sent[0]["message"])


def test_auth_is_switched_off_only_explicitly():
    text = default_config_text()
    assert "\n[auth]\nenabled = false\n" in text
    with pytest.raises(ConfigError, match=r"key `auth`: missing; .*enabled = false"):
        parse_config(text.replace("\n[auth]\nenabled = false\n", "\n"), source="noauth.toml")


def test_loading_never_changes_what_was_decoded(tmp_path):
    # What the loader adds (source, base_dir, the keys of keys_file) goes into a
    # new Struct: the one msgspec decoded is left as it was.
    from aiserve_trio.config import Config, _loaded
    from aiserve_trio.core.decoding import decode_toml

    from .authcfg import auth_toml

    body = auth_toml().split("[[auth.keys]]", 1)[1]
    (tmp_path / "keys.toml").write_text("[[keys]]" + body.replace("[[auth.keys]]", "[[keys]]"))
    text = default_config_text().replace(
        "[auth]\nenabled = false\n", '[auth]\nenabled = true\nkeys_file = "keys.toml"\n'
    )
    decoded = decode_toml(text.encode(), Config, source="gw.toml")
    before = msgspec.to_builtins(decoded)
    cfg = _loaded(decoded, source="gw.toml", base_dir=str(tmp_path))
    assert msgspec.to_builtins(decoded) == before
    assert decoded.auth is not None
    assert decoded.auth.keys == []
    assert (decoded.source, decoded.base_dir) == ("<memory>", ".")
    assert cfg is not decoded
    assert cfg.auth is not None
    assert [k.id for k in cfg.auth.keys] == ["alice", "bob", "ops"]
    assert (cfg.source, cfg.base_dir) == ("gw.toml", str(tmp_path))
    # so loading the same text twice gives the same config, keys read once each time
    (tmp_path / "gw.toml").write_text(text)
    first, second = load_config(tmp_path / "gw.toml"), load_config(tmp_path / "gw.toml")
    assert first == second == msgspec.structs.replace(cfg, source=str(tmp_path / "gw.toml"))


def test_a_bad_key_in_the_keys_file_names_that_file(tmp_path):
    from .authcfg import auth_toml

    body = auth_toml().split("[[auth.keys]]", 1)[1].replace('tenant = "bank-a"', 'tenant = "a:b"', 1)
    (tmp_path / "keys.toml").write_text("[[keys]]" + body.replace("[[auth.keys]]", "[[keys]]"))
    text = default_config_text().replace(
        "[auth]\nenabled = false\n", '[auth]\nenabled = true\nkeys_file = "keys.toml"\n'
    )
    (tmp_path / "gw.toml").write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "gw.toml")
    assert str(info.value).startswith(f"{tmp_path / 'keys.toml'}: key `keys[0].tenant`: ")


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize(
    ("case", "line"),
    [
        ("missing", "hypercorn's certfile 'certs/server.pem' cannot be read: No such file or directory"),
        ("not a certificate", "hypercorn's certfile 'certs/server.pem' is not usable"),
    ],
)
def test_server_on_missing_tls_files_says_one_line_and_exits_non_zero(tmp_path, workers, case, line):
    # configs/examples/hypercorn-tls.toml run before its certificate was made (or with junk).
    if case != "missing":
        (tmp_path / "certs").mkdir()
        (tmp_path / "certs/server.pem").write_text("not a certificate")
        (tmp_path / "certs/server.key").write_text("not a key")
    proc = _hypercorn(workers, {}, "configs/examples/hypercorn-tls.toml", cwd=tmp_path)
    assert proc.returncode != 0, proc
    lines = proc.stderr.decode().splitlines()
    assert len(lines) == 1, proc.stderr.decode()
    assert lines[0].startswith("aiserve-trio: not started: ")
    assert line in lines[0]
