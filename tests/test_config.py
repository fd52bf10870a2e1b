import subprocess
import sys
from pathlib import Path

import pytest

from aiserve_trio.config import ConfigError, default_config_text, load_config, parse_config

from .servers import ROOT


def _with(replace: str, by: str) -> str:
    text = default_config_text()
    assert replace in text
    return text.replace(replace, by, 1)


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
    assert load_config().adapters["mock"].inter_token_ms == 7


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
            "key `deadline.default_ms`: must not exceed",
        ),
        (
            _with("pattern = '\\b(hello", "pattern = '((hello"),
            "key `adapters.mock.rules[0].pattern`: not a regular expression",
        ),
        (_with('name = "chat"', 'name = "Chat-Route"'), "key `routes[0].name`"),
        ("this is = = not toml", "not valid TOML"),
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
def test_server_does_not_start_on_a_bad_config(tmp_path):
    # (hypercorn 0.18's parent process exits 0 even when its worker fails start-up,
    # so the check is that it stops, never serves, and says why.)
    bad = tmp_path / "bad.toml"
    bad.write_text(_with("sse = 0.25", "sse = 0.5"))
    hypercorn = Path(sys.executable).parent / "hypercorn"
    proc = subprocess.run(
        [
            str(hypercorn),
            "--config",
            str(ROOT / "configs/hypercorn.toml"),
            "--bind",
            "127.0.0.1:0",
            "aiserve_trio:app",
        ],
        env={"AISERVE_CONFIG": str(bad), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert b"Lifespan failure in startup" in proc.stdout + proc.stderr
    assert b"shares must sum to 1.0" in proc.stdout + proc.stderr
    assert str(bad).encode() in proc.stdout + proc.stderr


def test_auth_is_switched_off_only_explicitly():
    text = default_config_text()
    assert "\n[auth]\nenabled = false\n" in text
    with pytest.raises(ConfigError, match=r"key `auth`: missing; .*enabled = false"):
        parse_config(text.replace("\n[auth]\nenabled = false\n", "\n"), source="noauth.toml")
