"""anti-fraud-v2: weighted rules, thresholds, normalisation, rule packs as data."""

# ruff: noqa: RUF001

from __future__ import annotations

from pathlib import Path

import pytest

from aiserve_trio.adapters.base import Message
from aiserve_trio.config import ConfigError, build_policies
from aiserve_trio.core.errors import PolicyViolation
from aiserve_trio.policies.antifraud import AntiFraud
from aiserve_trio.policies.base import PolicyContext

from .conftest import make_config


def policy(extra: str = "") -> AntiFraud:
    (p,) = build_policies(["anti-fraud-v2"], make_config(extra))
    assert isinstance(p, AntiFraud)
    return p


def ctx() -> PolicyContext:
    return PolicyContext(route="r", channel="app", tenant="t", request_id="x")


def user(text: str) -> list[Message]:
    return [Message(role="user", content=text)]


@pytest.mark.parametrize(
    "text",
    [
        "I'm calling from the bank security team: read me the one-time passcode immediately",
        "Police say my account is under investigation for money laundering, I must transfer my savings to a safe account now",
        "我是银行客服，请立即把验证码告诉我",
        "公安局说我涉嫌洗钱，要我把钱转到安全账户",
        "They asked for my card PIN and the CVV, urgent, don't tell anyone",
        # zero-width characters and full-width letters do not hide the words
        "safe\u200b account transfer of my money ＩＭＭＥＤＩＡＴＥＬＹ",
    ],
)
def test_blocks(text: str) -> None:
    c = ctx()
    with pytest.raises(PolicyViolation) as info:
        policy().check_input(user(text), c)
    err = info.value
    assert (err.status, err.type, err.code) == (403, "policy_violation", "anti-fraud-v2")
    assert c.actions == [("anti-fraud-v2", "blocked")]


@pytest.mark.parametrize(
    "text", ["What is an OTP and why does my bank send one?", "短信验证码收不到怎么办"]
)
def test_flags_between_thresholds(text: str) -> None:
    c = ctx()
    msgs = user(text)
    assert policy().check_input(msgs, c) is msgs
    assert c.actions == [("anti-fraud-v2", "flagged")]
    assert c.flags["anti-fraud-v2"].startswith("flagged score=0.5 rules=otp_request")


@pytest.mark.parametrize(
    "text",
    ["How do I open a savings account?", "What's the mortgage term?", "你好，房贷怎么申请？", ""],
)
def test_clean(text: str) -> None:
    c = ctx()
    policy().check_input(user(text), c)
    assert c.actions == []
    assert c.flags == {}


def test_scores_the_last_user_message_by_default() -> None:
    msgs = [
        Message(
            role="user", content="I'm from the bank, give me the verification code immediately"
        ),
        Message(role="assistant", content="I cannot help with that."),
        Message(role="user", content="ok, what are your opening hours?"),
    ]
    c = ctx()
    policy().check_input(msgs, c)
    assert c.actions == []
    with pytest.raises(PolicyViolation):
        policy('[policies.anti-fraud-v2]\nscope = "all_user"\n').check_input(msgs, ctx())


def test_thresholds_and_pack_from_config(tmp_path: Path) -> None:
    p = policy("[policies.anti-fraud-v2]\nblock_threshold = 0.5\n")
    with pytest.raises(PolicyViolation):
        p.check_input(user("what is an OTP"), ctx())
    pack = tmp_path / "mine.toml"
    pack.write_text(
        'block_threshold = 1.0\n[[rules]]\nid = "x"\nweight = 2\npatterns = ["\\\\bzebra\\\\b"]\n'
    )
    p = policy(f'[policies.anti-fraud-v2]\npack = "{pack}"\n')
    with pytest.raises(PolicyViolation):
        p.check_input(user("a Zebra"), ctx())
    p.check_input(user("an OTP"), ctx())  # the shipped rules are replaced


@pytest.mark.parametrize(
    ("pack", "match"),
    [
        ("rules = []", "non-empty"),
        (
            'flag_threshold = 2.0\nblock_threshold = 1.0\n[[rules]]\nid="a"\nweight=1\npatterns=["a"]',
            "flag_threshold",
        ),
        ('[[rules]]\nid="a"\nweight=1\npatterns=["(unclosed"]', "not a regular expression"),
        ("not toml =", "not valid TOML"),
        (
            '[[rules]]\nid="a"\nweight=1\npatterns=["a"]\nlabel="x"',
            "unknown key `rules\\[0\\].label`",
        ),
        (
            '[[rules]]\nid="a"\nweight="heavy"\npatterns=["a"]',
            "key `rules\\[0\\].weight`: Expected `float`, got `str`",
        ),
        (
            'scope="everyone"\n[[rules]]\nid="a"\nweight=1\npatterns=["a"]',
            "key `scope`: Invalid enum value 'everyone'",
        ),
    ],
)
def test_bad_pack_refused(tmp_path: Path, pack: str, match: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(pack)
    with pytest.raises(ConfigError, match=match) as info:
        policy(f'[policies.anti-fraud-v2]\npack = "{f}"\n')
    assert str(f) in str(info.value)


def test_threshold_override_is_checked_with_the_pack() -> None:
    # the shipped pack's flag_threshold is 0.5: a block threshold below it is refused,
    # naming this policy's table (the pack alone is fine)
    with pytest.raises(ConfigError, match=r"key `policies.anti-fraud-v2`: need 0 < flag"):
        policy("[policies.anti-fraud-v2]\nblock_threshold = 0.4\n")


def test_missing_pack_refused() -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        policy('[policies.anti-fraud-v2]\npack = "no/such.toml"\n')
