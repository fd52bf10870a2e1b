"""A config file reads its keys file and rule packs only from its own folder tree or
``[server] config_paths``; the admin API's reload cannot widen that, so it cannot be
used to probe the filesystem (issue 33, item 10)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from aiserve_trio.config import ConfigError, load_config

from .asgi_client import Client
from .test_reload import conf, running, write

KEYS = '[[keys]]\nid = "k1"\nsecret_sha256 = "{}"\ntenant = "t1"\n'


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """``tmp/conf/gateway.toml`` and a secret outside its folder, ``tmp/secret/keys.toml``."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "keys.toml").write_text("[[keys]]\nnot = [valid\n")
    return tmp_path


def _gateway(tree: Path, extra: str, server: str = "", policies: str = "") -> Path:
    path = tree / "conf" / "gateway.toml"
    route = f'\n[[routes]]\npath = "/v1/p"\nname = "p"\nadapter = "b"\npolicies = {policies}\n'
    text = conf(extra=extra, routes=route if policies else "")
    if server:
        text = text.replace("[server]\n", f"[server]\n{server}\n", 1)
    write(path, text)
    return path


@pytest.mark.parametrize(
    "ref", ["../secret/keys.toml", "{tree}/secret/keys.toml", "/etc/passwd", "../secret/none.toml"]
)
def test_a_keys_file_outside_the_tree_is_not_read(tree: Path, ref: str) -> None:
    ref = ref.format(tree=tree)
    auth = f'[auth]\nenabled = true\nkeys_file = "{ref}"\n'
    path = _gateway(tree, "").with_suffix(".toml")
    write(path, conf(auth=auth))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "auth.keys_file" in message
    assert "outside the config's folder" in message
    # Whether it exists, what it holds, where its TOML breaks: nothing of it is said.
    assert "line" not in message
    assert "column" not in message
    assert "No such" not in message


def test_a_rule_pack_outside_the_tree_is_not_read(tree: Path) -> None:
    extra = f'[policies.p]\nkind = "compliance"\npack = "{tree}/secret/keys.toml"\n'
    with pytest.raises(ConfigError, match=r"rule pack .* is outside the config's folder") as info:
        load_config(_gateway(tree, extra, policies='["p"]'))
    assert "line" not in str(info.value)


def test_a_symlink_inside_to_a_file_outside_is_not_read(tree: Path) -> None:
    (tree / "conf" / "keys.toml").symlink_to(tree / "secret" / "keys.toml")
    path = tree / "conf" / "gateway.toml"
    write(path, conf(auth='[auth]\nenabled = true\nkeys_file = "keys.toml"\n'))
    with pytest.raises(ConfigError, match="outside the config's folder"):
        load_config(path)


def test_files_inside_the_tree_and_in_config_paths_are_read(tree: Path) -> None:
    pack = '[[rules]]\nid = "r"\npattern = "guaranteed"\nreplace = "likely"\n'
    (tree / "conf" / "packs").mkdir()
    (tree / "conf" / "packs" / "mine.toml").write_text(pack)
    (tree / "shared").mkdir()
    (tree / "shared" / "theirs.toml").write_text(pack)
    extra = (
        '[policies.mine]\nkind = "compliance"\npack = "packs/mine.toml"\n'
        '[policies.theirs]\nkind = "compliance"\npack = "../shared/theirs.toml"\n'
    )
    used = '["mine", "theirs"]'
    with pytest.raises(ConfigError, match="theirs"):
        load_config(_gateway(tree, extra, policies=used))
    cfg = load_config(_gateway(tree, extra, server='config_paths = ["../shared"]', policies=used))
    assert {"mine", "theirs"} <= set(cfg.policy_specs)


async def test_a_reload_over_http_cannot_probe_a_file_outside(
    tree: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = _gateway(tree, "")
    async with running(path) as app:
        for ref in (f"{tree}/secret/keys.toml", "/etc/passwd", f"{tree}/secret/none.toml"):
            auth = f'[auth]\nenabled = false\nkeys_file = "{ref}"\n'
            r = await Client(app).request(
                "POST",
                "/admin/config/reload",
                body=conf(auth=auth).encode(),
                headers={"content-type": "application/toml"},
            )
            assert r.status == 422, r.body
            message = r.json()["error"]["message"]
            assert "outside the config's folder" in message
            assert "line" not in message
            assert "No such" not in message


async def test_a_reload_over_http_cannot_widen_config_paths(
    tree: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = _gateway(tree, "")
    async with running(path) as app:
        text = conf(auth=f'[auth]\nenabled = false\nkeys_file = "{tree}/secret/keys.toml"\n')
        text = text.replace("[server]\n", '[server]\nconfig_paths = ["/"]\n', 1)
        result = await app.reloader.reload(by="test", candidate=text)
        assert not result.applied
        assert result.error is not None
        assert "server.config_paths" in result.error
        assert "[[keys]]" not in result.error
        assert "line" not in result.error
