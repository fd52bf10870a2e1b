"""Compliance packs: rate figures rewritten in the stream; rules are data."""

# ruff: noqa: RUF001

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiserve_trio.config import ConfigError, build_policies
from aiserve_trio.policies.base import PolicyContext
from aiserve_trio.policies.compliance import Compliance

from .conftest import make_config

PHRASE = "[rate available from your adviser]"


def pack(extra: str = "", name: str = "no-rate-figures") -> Compliance:
    (p,) = build_policies([name], make_config(extra))
    assert isinstance(p, Compliance)
    return p


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The rate is 3.85% a year.", f"The rate is {PHRASE} a year."),
        ("fixed at 3.85 per cent.", f"fixed at {PHRASE}."),
        ("about 4 percent", f"about {PHRASE}"),
        ("年利率4.2%，期限30年", "年利率以银行公布为准，期限30年"),
        ("年化收益率为 3.5％。", "年化收益率为 以银行公布为准。"),
        ("利率百分之三点八五", f"利率{PHRASE}"),
        ("cut by 25 bps", f"cut by {PHRASE}"),
        ("Version 2.0, 30 years, 100 loans", "Version 2.0, 30 years, 100 loans"),
    ],
)
def test_rewrites_rate_figures(text: str, expected: str) -> None:
    assert pack().rewrite(text) == expected


def test_phrase_configurable_and_counted() -> None:
    p = pack('[policies.no-rate-figures]\nphrase = "ask us"\n')
    ctx = PolicyContext(route="r", channel="app", tenant="t", request_id="x")
    f = p.output_filter(ctx)
    assert f is not None
    out = f.feed("rate 3.") + f.feed("85") + f.feed("% now") + f.finish()
    assert out == "rate ask us now"
    assert ctx.actions == [("no-rate-figures", "rewritten")]


def test_named_pack_of_kind_compliance(tmp_path: Path) -> None:
    (tmp_path / "g.toml").write_text(
        'phrase = "returns are not guaranteed"\n[[rules]]\nid = "g"\n'
        "pattern = '(?i)guaranteed (?:returns?|profits?)'\n"
    )
    extra = f'[policies.no-guarantees]\nkind = "compliance"\npack = "{tmp_path / "g.toml"}"\n'
    p = pack(extra, name="no-guarantees")
    assert p.rewrite("We offer Guaranteed returns!") == "We offer returns are not guaranteed!"


@pytest.mark.parametrize(
    ("rules", "match"),
    [
        ("[[rules]]\nid = 'a'\npattern = '[0-9]+%'\n", "unbounded"),
        ("[[rules]]\nid = 'a'\npattern = '(oops'\n", "not a regular expression"),
        ("[[rules]]\nid = 'a'\npattern = 'x'\nreplace = '\\g<nope>'\n", "rules\\[0\\]"),
        ("[[rules]]\nid = 'a'\npattern = 'x'\ncolour = 'red'\n", "unknown key `rules\\[0\\].colour`"),
        ("[[rules]]\nid = 'a'\npattern = 3\n", "key `rules\\[0\\].pattern`: Expected `str`, got `int`"),
        ("phrase = 'x'\nrules = []\n", "key `rules`: must be a non-empty array"),
    ],
)
def test_bad_pack_refused(tmp_path: Path, rules: str, match: str) -> None:
    (tmp_path / "bad.toml").write_text(rules)
    extra = f'[policies.p]\nkind = "compliance"\npack = "{tmp_path / "bad.toml"}"\n'
    with pytest.raises(ConfigError, match=match) as info:
        pack(extra, name="p")
    # the config, the policy and the pack file are named
    assert str(info.value).startswith(f"<test>: policy 'p': rule pack {tmp_path / 'bad.toml'}: ")


def test_compliance_kind_needs_a_pack() -> None:
    with pytest.raises(ConfigError, match="pack"):
        pack('[policies.p]\nkind = "compliance"\n', name="p")


P = pack()
PIECE = st.sampled_from(
    [
        "3.85%",
        "年利率4.2%",
        "3.85 per cent",
        "百分之三",
        " ",
        "rate ",
        "3",
        ".",
        "%",
        "per",
        " cent",
        "利率",
        "x",
    ]
)


@settings(max_examples=200, deadline=None)
@given(st.lists(PIECE, max_size=20), st.lists(st.integers(0, 200), max_size=20))
def test_streamed_equals_whole(parts: list[str], cuts: list[int]) -> None:
    text = "".join(parts)
    bounds = [0, *sorted(c for c in set(cuts) if c <= len(text)), len(text)]
    f = P.rewriter.stream()
    out = "".join(f.feed(text[a:b]) for a, b in itertools.pairwise(bounds)) + f.finish()
    assert out == P.rewrite(text)
