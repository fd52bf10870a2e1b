"""Policy settings and rule packs are decoded once, at config load, into Structs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from aiserve_trio.config import (
    Config,
    ConfigError,
    _loaded,
    build_policies,
    load_config,
    parse_config,
)
from aiserve_trio.core.decoding import decode_toml
from aiserve_trio.policies import registry
from aiserve_trio.policies.base import (
    BuildContext,
    Policy,
    PolicyKind,
    PolicySettings,
    PolicySpec,
)
from aiserve_trio.policies.channel import (
    ChannelShaping,
    ChannelShapingSettings,
    MessagesStyle,
    SpeechStyle,
    channel_shaping,
)
from aiserve_trio.policies.redact import RedactSettings, Tokens

from .conftest import config_text, make_config


def routed(policies: str, extra: str = "") -> str:
    """The test config with its route naming ``policies`` (a TOML array), and ``extra``."""
    text = config_text()
    assert "policies = []" in text
    return text.replace("policies = []", f"policies = {policies}", 1) + "\n" + extra


def test_settings_are_decoded_at_load_into_frozen_structs() -> None:
    cfg = make_config('[policies.gdpr-redact]\ndetect = ["card"]\ntokens = {card = "<c>"}\n')
    spec = cfg.policy_specs["gdpr-redact"]
    assert spec == PolicySpec(
        name="gdpr-redact",
        kind="gdpr-redact",
        settings=RedactSettings(detect=("card",), tokens=Tokens(card="<c>")),
    )
    with pytest.raises(AttributeError):
        spec.settings.region = "US"  # type: ignore[attr-defined]


def test_a_policy_a_route_names_gets_its_default_settings() -> None:
    cfg = parse_config(routed('["channel-shaping"]'), source="<test>")
    assert cfg.policy_specs["channel-shaping"].settings == ChannelShapingSettings()


def test_a_named_policy_of_another_kind() -> None:
    cfg = make_config('[policies.strict-redact]\nkind = "gdpr-redact"\ninput = false\n')
    spec = cfg.policy_specs["strict-redact"]
    assert (spec.kind, spec.settings) == ("gdpr-redact", RedactSettings(input=False))
    (p,) = build_policies(["strict-redact"], cfg)
    assert p.name == "strict-redact"


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("[policies.gdpr-redact]\ncolour = 1\n", "unknown key `policies.gdpr-redact.colour`"),
        (
            "[policies.anti-fraud-v2]\nblock_threshold = 'high'\n",
            "key `policies.anti-fraud-v2.block_threshold`: Expected `float | null`, got `str`",
        ),
        (
            '[policies.mine]\nkind = "gdpr-redakt"\n',
            "key `policies.mine.kind`: unknown kind 'gdpr-redakt'",
        ),
        ("[policies.mine]\ninput = true\n", "key `policies.mine`: 'mine' is not a policy kind"),
        ("[policies.mine]\nkind = 3\n", "key `policies.mine.kind`: Expected `str`, got `int`"),
        (
            '[policies.p]\nkind = "compliance"\nphrase = "x"\n',
            "key `policies.p`: Object missing required field `pack`",
        ),
        (
            '[policies.channel-shaping.ivr]\nstyle = "speech"\nmax_chars = "long"\n',
            "key `policies.channel-shaping.ivr.max_chars`: Expected `int`, got `str`",
        ),
        (
            '[policies.channel-shaping.ivr]\nstyle = "song"\n',
            "key `policies.channel-shaping.ivr.style`: must be 'speech' or 'messages'",
        ),
    ],
)
def test_bad_policy_tables_are_refused_at_load_naming_the_key(table: str, message: str) -> None:
    # (no route names these policies: every table is decoded when the config loads)
    with pytest.raises(ConfigError) as info:
        parse_config(config_text() + "\n" + table, source="gw.toml")
    assert str(info.value).startswith("gw.toml: ")
    assert message in str(info.value)


def test_a_bad_pack_of_a_routed_policy_fails_the_load(tmp_path: Path) -> None:
    (tmp_path / "mine.toml").write_text(
        '[[rules]]\nid = "a"\npattern = "x"\nreplacement = "y"\n'
    )
    text = routed('["mine"]', '[policies.mine]\nkind = "compliance"\npack = "mine.toml"\n')
    (tmp_path / "gw.toml").write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "gw.toml")
    assert str(info.value) == (
        f"{tmp_path / 'gw.toml'}: policy 'mine': rule pack {tmp_path / 'mine.toml'}: "
        "unknown key `rules[0].replacement`"
    )


def test_loading_never_changes_the_decoded_policy_tables() -> None:
    text = routed('["gdpr-redact"]', '[policies.gdpr-redact]\nregion = "GB"\n')
    decoded = decode_toml(text.encode(), Config, source="<test>")
    before = msgspec.to_builtins(decoded)
    cfg = _loaded(decoded, source="<test>", base_dir=".")
    assert msgspec.to_builtins(decoded) == before
    assert decoded.policy_specs == {}
    assert decoded.policies == {"gdpr-redact": {"region": "GB"}}
    assert cfg.policy_specs["gdpr-redact"].settings == RedactSettings(region="GB")
    assert parse_config(text) == parse_config(text)


def test_factories_take_a_small_build_context_not_the_config() -> None:
    ctx = BuildContext(source="x.toml", base_dir=".", channels=("app", "ivr"))
    settings = ChannelShapingSettings(channels={"app": MessagesStyle(max_bytes=10)})
    p = channel_shaping("channel-shaping", settings, ctx)
    assert isinstance(p, ChannelShaping)
    # the defaults for channels that exist, the configured styles over them
    assert p.styles == {"ivr": SpeechStyle(), "app": MessagesStyle(max_bytes=10)}
    with pytest.raises(ConfigError, match=r"x.toml: unknown key `policies.c.fax`"):
        channel_shaping("c", ChannelShapingSettings(channels={"fax": SpeechStyle()}), ctx)


# --- third-party kinds: entry points whose object is a PolicyKind -------------------


class Shout(Policy):
    def __init__(self, word: str) -> None:
        self.word = word


class ShoutSettings(PolicySettings, frozen=True):
    word: str = "HEY"


def shout(name: str, settings: ShoutSettings, ctx: BuildContext) -> Policy:
    return Shout(settings.word)


class _EntryPoint:
    def __init__(self, name: str, obj: Any) -> None:
        self.name, self.value, self._obj = name, f"tests:{name}", obj

    def load(self) -> Any:
        return self._obj


def _entry_points(*eps: _EntryPoint) -> Any:
    def entry_points(group: str) -> tuple[_EntryPoint, ...]:
        assert group == registry.ENTRY_POINT_GROUP
        return eps

    return entry_points


def test_a_third_party_kind_from_an_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    kind = PolicyKind(shout, ShoutSettings)
    monkeypatch.setattr(
        registry,
        "entry_points",
        # a built-in name is not replaced by an entry point
        _entry_points(_EntryPoint("shout", kind), _EntryPoint("gdpr-redact", kind)),
    )
    cfg = parse_config(routed('["shout", "gdpr-redact"]', '[policies.shout]\nword = "HO"\n'))
    assert cfg.policy_specs["shout"].settings == ShoutSettings(word="HO")
    p, redact = build_policies(["shout", "gdpr-redact"], cfg)
    assert isinstance(p, Shout)
    assert (p.name, p.word) == ("shout", "HO")
    assert not isinstance(redact, Shout)
    with pytest.raises(ConfigError, match=r"unknown key `policies.shout.volume`"):
        parse_config(routed('["shout"]', "[policies.shout]\nvolume = 11\n"))


def test_an_entry_point_that_is_not_a_policy_kind_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(registry, "entry_points", _entry_points(_EntryPoint("shout", shout)))
    with pytest.raises(ConfigError, match=r"entry point 'shout' .* is not a PolicyKind"):
        make_config()
