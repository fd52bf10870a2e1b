"""Channel shaping: IVR speakable sentences, WeChat size-bounded messages."""

# ruff: noqa: RUF001

from __future__ import annotations

import itertools

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from aiserve_trio.config import ConfigError, build_policies
from aiserve_trio.policies.base import OutputFilter, PolicyContext
from aiserve_trio.policies.channel import MessageShaper, SpeechShaper, is_emoji, speakable

from .conftest import make_config


def shaper(channel: str, extra: str = "") -> OutputFilter | None:
    (p,) = build_policies(["channel-shaping"], make_config(extra))
    return p.output_filter(PolicyContext(route="r", channel=channel, tenant="t", request_id="x"))


def run(f: OutputFilter, pieces: list[str]) -> list[str]:
    out = [f.feed(p) for p in pieces]
    return [*out, f.finish()]


MD = (
    "## Your options\n\n- **Fixed rate**: see https://bank.example.com/rates. 😀 Call us!\n"
    "- Variable: [details](https://x.y/z)\n\n1. Step one\n`code` and ~~old~~ text. 谢谢！再见"
)


def test_ivr_speakable_sentences() -> None:
    f = shaper("ivr")
    assert isinstance(f, SpeechShaper)
    chunks = run(f, [MD[i : i + 3] for i in range(0, len(MD), 3)])
    text = "".join(chunks)
    assert text == (
        "Your options. Fixed rate: see the link in our app. Call us! Variable: details. "
        "Step one. code and old text. 谢谢！再见"
    )
    for bad in ("*", "#", "http", "😀", "[", "`", "~"):
        assert bad not in text
    # every non-empty chunk but the last is whole sentences
    assert all(c.rstrip().endswith((".", "!", "?", "！", "。")) for c in chunks[:-1] if c)


def test_ivr_keeps_decimals_and_cuts_long_sentences() -> None:
    f = SpeechShaper(max_chars=20)
    words = ["today", "and", "it", "may", "change", "tomorrow", "or", "later"]
    out = run(f, ["The rate is 3.", "85", *(" " + w for w in words)])
    assert "3.85" in "".join(out)
    assert all(len(c) <= 21 for c in out)


def test_wechat_messages_bounded() -> None:
    f = shaper("wechat", '[policies.channel-shaping.wechat]\nstyle = "messages"\nmax_bytes = 60\n')
    assert isinstance(f, MessageShaper)
    text = "这是第一句话，介绍我们的产品。" * 6 + "Short one. " * 8
    out = "".join(run(f, [text[i : i + 5] for i in range(0, len(text), 5)]))
    messages = out.split("\n\n")
    assert len(messages) > 3
    assert all(0 < len(m.encode()) <= 60 for m in messages)
    assert "".join(messages).replace(" ", "") == text.replace(" ", "")


def test_other_channels_untouched() -> None:
    assert shaper("app") is None
    assert shaper("api") is None


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ('[policies.channel-shaping.fax]\nstyle = "speech"\n', "unknown key"),
        ('[policies.channel-shaping.ivr]\nstyle = "song"\n', "speech"),
        ('[policies.channel-shaping.ivr]\nstyle = "speech"\nmax_chars = 0\n', "max_chars"),
        ('[policies.channel-shaping.ivr]\nstyle = "speech"\nmax_bytes = 10\n', "unknown key"),
    ],
)
def test_bad_config_refused(table: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        shaper("ivr", table)


def test_speakable_removes_emoji_and_urls() -> None:
    assert speakable("Visit www.bank.com/x, now 🎉!", "our site") == "Visit our site, now!"


@pytest.mark.parametrize(
    ("sentence", "spoken"),
    [
        ("Write to [EMAIL] 📧.", "Write to [EMAIL]."),
        ("Call [PHONE] 📞, or write to [EMAIL] 😀 .", "Call [PHONE], or write to [EMAIL]."),
        ("🎉 . Done 👍 !", "Done!"),
        ("Your card (💳) ends in [CARD] .", "Your card ends in [CARD]."),
        ("**Rate** 😀: 3.85 % **fixed**.", "Rate: 3.85% fixed."),
        ("已发送到 [EMAIL] 📧 。", "已发送到 [EMAIL]。"),
    ],
)
def test_what_a_removal_leaves_is_tidied(sentence: str, spoken: str) -> None:
    assert speakable(sentence, "the link") == spoken


WORD = st.sampled_from(["Hello", "rate", "3.85", "好", "[EMAIL]", "[PHONE]", "[CARD]"])
NOISE = st.sampled_from(["😀", "📧", "🎉", "**", "`", "~~", " ", "  ", "\n"])
MARKS = (".", ",", "!", "?", ":", "。", "，")
MARK = st.sampled_from(MARKS)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(WORD, NOISE, MARK), max_size=25))
def test_speakable_leaves_no_space_before_a_mark_and_keeps_every_word(parts: list[str]) -> None:
    text = " ".join(parts)
    out = speakable(text, "the link")
    assert not any(is_emoji(ch) for ch in out)
    assert "  " not in out
    assert out == out.strip()
    for mark in MARKS:
        assert f" {mark}" not in out
    assert out[:1] not in MARKS
    # every word and redaction marker is still there, in order
    words = [p for p in parts if p in {"Hello", "rate", "3.85", "好", "[EMAIL]", "[PHONE]", "[CARD]"}]
    at = 0
    for w in words:
        at = out.index(w, at) + len(w)


PIECE = st.sampled_from(
    ["Hello", " ", ". ", "3.85", "**", "# ", "\n", "- ", "https://a.b/c", "😀", "。", "好", "!"]
)


@settings(max_examples=500, deadline=None)
@example(parts=[" ", ". ", "https://a.b/c", "😀", "。", "。"], cuts=[18])  # "。" then "。" in two reads
@example(parts=["Hello"] * 8 + [". "], cuts=[41])  # a sentence one char over max_chars
@example(parts=["Hello"] * 5 + ["**", "Hello", ". "], cuts=[31])  # cut before markdown goes
@given(st.lists(PIECE, max_size=30), st.lists(st.integers(0, 300), max_size=15))
def test_shapers_independent_of_chunking(parts: list[str], cuts: list[int]) -> None:
    text = "".join(parts)
    bounds = [0, *sorted(c for c in set(cuts) if c <= len(text)), len(text)]
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    for make in (lambda: SpeechShaper(max_chars=40), lambda: MessageShaper(max_bytes=30)):
        assert "".join(run(make(), pieces)) == "".join(run(make(), [text]))
