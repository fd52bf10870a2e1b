"""The Redis keys ``[sessions]`` and ``[cache]`` share (``redisconn.RedisSettings``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from aiserve_trio.config import ConfigError, parse_config
from aiserve_trio.util.redisconn import client_for_url

BASE = (
    "[auth]\nenabled = false\n"
    '[adapters.m]\nkind = "mock"\n'
    '[[routes]]\npath = "/v1/chat/completions"\nadapter = "m"\n'
)

BAD = [
    ("pool_size", "0", "must be positive"),
    ("follow_pool_size", "-1", "must be positive"),
    ("connect_timeout_ms", "0", "must be positive"),
    ("key_prefix", '"a b"', "must be 1-64 letters, digits or '_.-'"),
    ("key_prefix", '""', "must be 1-64 letters, digits or '_.-'"),
]


@pytest.mark.parametrize("section", ["sessions", "cache"])
@pytest.mark.parametrize(("key", "value", "why"), BAD)
def test_both_tables_refuse_a_bad_redis_key_alike(section: str, key: str, value: str, why: str):
    with pytest.raises(ConfigError) as err:
        parse_config(f"{BASE}[{section}]\n{key} = {value}\n")
    assert str(err.value) == f"<memory>: key `{section}.{key}`: {why}"


def test_the_defaults_are_the_same_in_both_tables() -> None:
    cfg = parse_config(BASE)
    for key, value in [
        ("backend", "memory"),
        ("pool_size", 32),
        ("follow_pool_size", 64),
        ("connect_timeout_ms", 1_000),
        ("key_prefix", "aiserve"),
    ]:
        assert getattr(cfg.sessions, key) == value
        assert getattr(cfg.cache, key) == value
    assert cfg.sessions.url == "redis://127.0.0.1:6379/0"
    assert cfg.cache.url is None  # the sessions' Redis


def test_a_url_the_client_cannot_use_is_refused_before_any_connection() -> None:
    with pytest.raises(ValueError, match="scheme must be redis, rediss, unix"):
        client_for_url("http://127.0.0.1:6379/0", 4, 1.0)
    with pytest.raises(ValueError, match="every node must be host:port"):
        client_for_url("redis+cluster://a,b:1", 4, 1.0)
    with pytest.raises(ValueError, match="a sentinel URL names the service"):
        client_for_url("redis+sentinel://a:1", 4, 1.0)


def test_loading_a_config_does_not_import_the_redis_client() -> None:
    probe = (
        "import sys\n"
        "from aiserve_trio.config import load_config\n"
        "load_config(None)\n"
        "assert 'coredis' not in sys.modules, 'the config imported coredis'\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
