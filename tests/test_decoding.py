"""msgspec validation messages become ones naming the TOML key."""

from __future__ import annotations

import msgspec
import pytest

from aiserve_trio.core.decoding import convert, describe, field_error, join_key
from aiserve_trio.core.errors import ConfigError


class Inner(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    low: int = 0
    high: int = 1

    def __post_init__(self) -> None:
        if self.low > self.high:
            raise field_error("low", "must not exceed `high`")


class Outer(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    items: list[Inner] = []


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"items": [{}, {"low": 2}]}, "t.toml: key `policies.x.items[1].low`: must not exceed `high`"),
        ({"items": [{"mid": 1}]}, "t.toml: unknown key `policies.x.items[0].mid`"),
        ({"items": [{"high": "2"}]}, "t.toml: key `policies.x.items[0].high`: Expected `int`, got `str`"),
        ({"extra": 1}, "t.toml: unknown key `policies.x.extra`"),
    ],
)
def test_convert_names_the_key(value: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        convert(value, Outer, source="t.toml", key="policies.x")
    assert str(info.value) == message


def test_describe_without_a_key() -> None:
    assert describe("Expected `object`, got `int`") == "Expected `object`, got `int`"
    assert describe("Object contains unknown field `a`") == "unknown key `a`"
    assert describe("`a`: bad") == "key `a`: bad"


def test_join_key() -> None:
    assert join_key("", "a", "", "b[0]", "[1]", "c") == "a.b[0][1].c"
