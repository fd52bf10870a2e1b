"""gdpr-redact: what is redacted, what is left alone, and streaming equals whole-text."""

# ruff: noqa: RUF001

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiserve_trio.adapters.base import Message
from aiserve_trio.config import ConfigError, build_policies
from aiserve_trio.policies.base import PolicyContext
from aiserve_trio.policies.redact import build_rules
from aiserve_trio.policies.stream import Rewriter, make_rule, pattern_reach

from .conftest import make_config

RW = Rewriter(build_rules())


def stream(rw: Rewriter, pieces: list[str]) -> str:
    s = rw.stream()
    out = []
    for p in pieces:
        out.append(s.feed(p))
        assert s.held <= s.max_holdback
    return "".join(out) + s.finish()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("mail john.doe@example.com now", "mail [EMAIL] now"),
        ("QQ邮箱12345678@qq.com。", "QQ邮箱[EMAIL]。"),
        ("call +86 138 0013 8000, thanks", "call [PHONE], thanks"),
        ("电话13800138000。", "电话[PHONE]。"),
        ("office 010-62345678", "office [PHONE]"),
        ("UK +44 20 7946 0958.", "UK [PHONE]."),
        ("card 4111 1111 1111 1111 ok", "card [CARD] ok"),
        ("card 4111-1111-1111-1111", "card [CARD]"),
        ("amex 3782 822463 10005", "amex [CARD]"),
        ("card 4111 1111 1111 1111 2 times", "card [CARD] 2 times"),
        ("IBAN DE89 3704 0044 0532 0130 00.", "IBAN [IBAN]."),
        ("IBAN GB82WEST12345698765432", "IBAN [IBAN]"),
        ("身份证11010519491231002X。", "身份证[ID]。"),
        ("host 192.168.1.10.", "host [IP]."),
        ("v6 fe80::1ff:fe23:4567:890a ok", "v6 [IP] ok"),
        # zero-width characters and full-width digits do not hide a number
        ("手机138\u200b0013\u200b8000", "手机[PHONE]"),
        ("card ４１１１１１１１１１１１１１１１", "card [CARD]"),
    ],
)
def test_redacts(text: str, expected: str) -> None:
    assert RW.rewrite(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "card 4111 1111 1111 1112 fails Luhn",
        # (with ...01 the digits after "DE89" happen to pass Luhn: redacted as a card, fail-safe)
        "IBAN DE89 3704 0044 0532 0130 02 bad checksum",
        "ID 110105194912310021 bad checksum",
        "time 12:30:45, date 2024-05-21, version 1.2.3",
        "octet 1.2.3.256 is not an address",
        "order 12345678 and 8 digits",
        "std::vector and a::b",
    ],
)
def test_leaves_look_alikes(text: str) -> None:
    assert RW.rewrite(text) == text


def test_tokens_configurable_and_counted() -> None:
    cfg = make_config('[policies.gdpr-redact]\ntokens = {card = "<card>"}\ndetect = ["card"]\n')
    (policy,) = build_policies(["gdpr-redact"], cfg)
    ctx = PolicyContext(route="r", channel="api", tenant="t", request_id="x")
    msgs = [Message(role="user", content="4111 1111 1111 1111 and a@b.com")]
    out = policy.check_input(msgs, ctx)
    assert out[0].content == "<card> and a@b.com"  # email not in `detect`
    assert ctx.actions == [("gdpr-redact", "redacted")]
    f = policy.output_filter(ctx)
    assert f is not None
    assert f.feed("pay 4111 1111 ") == "pay "
    assert f.feed("1111 1111.") + f.finish() == "<card>."


def test_text_that_cannot_be_a_secret_flows() -> None:
    s = RW.stream()
    # Everything up to the last word is out at once; the word could start an e-mail.
    assert s.feed("Hello there, how are") == "Hello there, how "
    assert s.feed(" you?") == "are you?"
    assert s.held == 0


@pytest.mark.parametrize(
    ("settings_toml", "match"),
    [
        ('detect = ["ssn"]', "unknown kind"),
        ("colour = 1", "unknown key `policies.gdpr-redact.colour`"),
        ('region = "XX"', "unknown region"),
        ('input = "yes"', "key `policies.gdpr-redact.input`: Expected `bool`, got `str`"),
        ('tokens = {ssn = "[SSN]"}', "unknown key `policies.gdpr-redact.tokens.ssn`"),
    ],
)
def test_bad_settings_refused(settings_toml: str, match: str) -> None:
    # refused when the config is loaded, naming the config and the key
    with pytest.raises(ConfigError, match=match) as info:
        make_config(f"[policies.gdpr-redact]\n{settings_toml}\n")
    assert str(info.value).startswith("<test>: ")


def test_unbounded_pattern_refused() -> None:
    with pytest.raises(ValueError, match="unbounded"):
        make_rule("x", r"[0-9]+%", lambda _m: "")
    assert pattern_reach(r"(?<![0-9])[0-9]{2}(?![0-9])")[0] == 2 + 2


# --- streaming equals whole-text: random texts, random chunkings ---------------

SECRETS = [
    "john.doe@example.com",
    "12345678@qq.com",
    "+86 138 0013 8000",
    "13800138000",
    "010-62345678",
    "4111 1111 1111 1111",
    "4111111111111111",
    "3782 822463 10005",
    "DE89 3704 0044 0532 0130 00",
    "GB82WEST12345698765432",
    "11010519491231002X",
    "192.168.1.10",
    "fe80::1ff:fe23:4567:890a",
]
LOOKALIKES = [
    "4111 1111 1111 1112",
    "110105194912310021",
    "1.2.3.256",
    "12:30:45",
    "2024-05-21",
    "a@b",
    "DE89 3704 0044 0532 0130 02",
]
FILLER = st.sampled_from(
    [" ", ", ", ". ", "\n", "the ", "card ", "电话", "。", "-", "+", "@", "0", "12", "x", "\u200b"]
)
PIECE = st.one_of(
    st.sampled_from(SECRETS), st.sampled_from(LOOKALIKES), FILLER, st.text(max_size=6)
)


@st.composite
def chunked(draw: st.DrawFn) -> tuple[str, list[str]]:
    text = "".join(draw(st.lists(PIECE, max_size=25)))
    cuts = sorted(set(draw(st.lists(st.integers(0, len(text)), max_size=30))))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=300, deadline=None)
@given(chunked())
def test_streamed_equals_whole(case: tuple[str, list[str]]) -> None:
    text, pieces = case
    assert stream(RW, pieces) == RW.rewrite(text)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(SECRETS), st.integers(1, 8))
def test_secret_split_anywhere_is_redacted(secret: str, step: int) -> None:
    text = f"my number is {secret} thanks"
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    out = stream(RW, pieces)
    assert secret not in out
    assert out.startswith("my number is [")
    assert out.endswith("] thanks")
