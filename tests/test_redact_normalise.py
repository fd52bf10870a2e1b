"""gdpr-redact's normalisation (issue 51, item 3): ignorable characters, any digit
script, full widths and wider separators do not hide personal data, in the
prompt or in the reply; text outside a match keeps its own spelling; streamed
equals whole; a message's text parts are read as one."""

# ruff: noqa: RUF001

from __future__ import annotations

import itertools
import json
import unicodedata
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiserve_trio.config import build_policies
from aiserve_trio.core.messages import Message, decode_message
from aiserve_trio.core.slices import finish
from aiserve_trio.policies.base import PolicyContext
from aiserve_trio.policies.redact import build_rules
from aiserve_trio.policies.stream import IGNORABLE, MAX_DROPPED_RUN, Rewriter

from .conftest import make_config

RW = Rewriter(build_rules())
CARD = "4111111111111111"


def stream(pieces: list[str]) -> str:
    s = RW.stream()
    out = []
    for p in pieces:
        out.append(s.feed(p))
        assert s.held <= s.max_holdback
    return "".join(out) + s.finish()


def grouped(sep: str, number: str = CARD) -> str:
    return sep.join(number[i : i + 4] for i in range(0, len(number), 4))


def digits_in(script_zero: int, number: str) -> str:
    return "".join(chr(script_zero + int(d)) if d.isdigit() else d for d in number)


@pytest.mark.parametrize(
    "text",
    [
        # format and default-ignorable characters between the digits
        *(
            f"card {grouped(c)} ok"
            for c in [
                "\u200e",  # LRM
                "\u200f",  # RLM
                "\u202a",  # bidi embeddings and overrides
                "\u202b",
                "\u202c",
                "\u202d",
                "\u202e",
                "\u2066",  # isolates
                "\u2069",
                "\u2062",  # invisible times
                "\u034f",  # combining grapheme joiner
                "\ufe0f",  # VS16
                "\U000e0031",  # tag digit one
                "\u200e\ufe0f\U000e0020",
            ]
        ),
        f"card {CARD[:7]}\u2062{CARD[7:]} ok",
        # separators
        *(
            f"card {grouped(c)} ok"
            for c in ["\u2009", "\u2013", "\u2014", ".", "/", "\t", "\n", "\r\n", "\u3000"]
        ),
        # digits of other scripts
        f"card {digits_in(0x1D7CE, CARD)} ok",  # mathematical bold
        f"card {digits_in(0x0660, CARD)} ok",  # Arabic-Indic
        f"card {digits_in(0x06F0, CARD)} ok",  # extended Arabic-Indic (Persian)
        f"card {digits_in(0x0966, CARD)} ok",  # Devanagari
        "手机 ١٣٨٠٠١٣٨٠٠٠ ok",
        # full-width IBAN letters
        "IBAN ＤＥ８９ ３７０４ ００４４ ０５３２ ０１３０ ００ ok",
        "IBAN ＧＢ８２ＷＥＳＴ１２３４５６９８７６５４３２ ok",
        # phone separators
        "call +1.202.456.1111 ok",
        "call +1/202/456/1111 ok",
        "call 138\u20090013\u20098000 ok",
        "call 138\u20130013\u20138000 ok",
        # e-mail: a local part over 64 characters, an internationalised domain
        "mail " + "a" * 65 + "@example.com ok",
        "mail " + "b" * 200 + "@example.com ok",
        "mail jane@bücher.de ok",
        "mail jane@例子.中国 ok",
        "mail jane@пример.рф ok",
    ],
)
def test_hidden_values_are_redacted(text: str) -> None:
    out = RW.rewrite(text)
    assert out.startswith(text.split(" ")[0] + " [")
    assert out.endswith("] ok")
    assert not any(c.isdigit() for c in out), out
    assert "@" not in out


def test_text_outside_a_match_keeps_its_own_spelling() -> None:
    text = (
        "家庭 👨\u200d👩\u200d👧 ❤\ufe0f, ٣ apples, ４ pears, \u200ethe end\u200f, "
        f"card {grouped(chr(0x200E))}."
    )
    assert RW.rewrite(text) == text[: text.index("card")] + "card [CARD]."
    # a valid prefix's trailing group keeps its spelling too
    assert RW.rewrite(f"card {CARD} ２ times") == "card [CARD] ２ times"


# --- properties ----------------------------------------------------------------------

VALUES = [
    "4111 1111 1111 1111",
    "4111111111111111",
    "+86 138 0013 8000",
    "13800138000",
    "11010519491231002X",
    "DE89 3704 0044 0532 0130 00",
    "john.doe@example.com",
    "192.168.1.10",
]
#: Every character the normalisation drops, sampled (the sets are large).
IGNORABLES = st.sampled_from(sorted(IGNORABLE))
#: The zero of every script's decimal digits.
ZEROS = sorted(
    cp
    for cp in range(0x110000)
    if unicodedata.category(chr(cp)) == "Nd" and unicodedata.decimal(chr(cp)) == 0
)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(VALUES),
    st.lists(st.tuples(st.integers(0, 40), IGNORABLES), min_size=1, max_size=4),
)
def test_an_ignorable_character_anywhere_in_a_value_does_not_hide_it(
    value: str, inserts: list[tuple[int, str]]
) -> None:
    chars = list(value)
    for at, c in inserts:
        chars.insert(at % (len(chars) + 1), c)
    hidden = "".join(chars)
    out = RW.rewrite(f"see {hidden} ok")
    # (one before or after the value is outside the match, and stays)
    visible = "".join(c for c in out if c not in IGNORABLE)
    assert visible.startswith("see [")
    assert visible.endswith("] ok")
    assert len(visible) < 20  # the whole value went


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(VALUES[:5]), st.sampled_from(ZEROS), st.data())
def test_any_digit_script_does_not_hide_a_value(value: str, zero: int, data: st.DataObject) -> None:
    # each digit may be of a different script
    mixed = "".join(
        chr(data.draw(st.sampled_from([zero, 0x30])) + int(c)) if c.isdigit() else c for c in value
    )
    assert RW.rewrite(f"see {mixed} ok").startswith("see [")
    assert RW.rewrite(f"see {mixed} ok").endswith("] ok")


PIECES = st.one_of(
    st.sampled_from(VALUES),
    st.sampled_from(["4111 1111", "\u200e", "\ufe0f", "٣", "𝟒", "\u2009", "–", " ", "。", "@"]),
    IGNORABLES,
    st.text(max_size=5),
)


@st.composite
def chunked(draw: st.DrawFn) -> tuple[str, list[str]]:
    text = "".join(draw(st.lists(PIECES, max_size=20)))
    cuts = sorted(set(draw(st.lists(st.integers(0, len(text)), max_size=20))))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=300, deadline=None)
@given(chunked())
def test_streamed_equals_whole_with_ignorables_and_other_digits(
    case: tuple[str, list[str]],
) -> None:
    text, pieces = case
    assert stream(pieces) == RW.rewrite(text)


def test_what_is_held_for_the_map_back_is_bounded() -> None:
    s = RW.stream()
    out = s.feed("card 4111 ")
    for _ in range(2000):
        out += s.feed("\u200b" * 50)
        assert len(s._orig) <= s.max_holdback * (MAX_DROPPED_RUN + 1)
    out += s.feed("1111 1111 1111 ok") + s.finish()
    assert out == "card [CARD] ok"


# --- a message's text parts ----------------------------------------------------------

CTX = PolicyContext(route="r", channel="api", tenant="t", request_id="x")


def message(obj: dict[str, Any]) -> Message:
    return decode_message(msgspec.Raw(json.dumps(obj).encode()), 0)


def redacted(obj: dict[str, Any]) -> Any:
    (policy,) = build_policies(["gdpr-redact"], make_config())
    (out,) = policy.check_input([message(obj)], CTX)
    return json.loads(bytes(out.to_raw()))


@pytest.mark.parametrize(
    ("texts", "expected"),
    [
        (["card 4111 1111", " 1111 1111 ok"], ["card [CARD]", " ok"]),
        (["call 138", "0013", "8000 now"], ["call [PHONE]", "", " now"]),
        (["mail jane.doe@exa", "mple.com"], ["mail [EMAIL]", ""]),
        # a value that ends where its part ends
        (["my card is 4111 1111 1111 1111", "ok"], ["my card is [CARD]", "ok"]),
        (["4111 1111 1111 1111", "", "ok"], ["[CARD]", "", "ok"]),
        # parts that are each fine stay as they are
        (["hello", " world"], ["hello", " world"]),
    ],
)
def test_a_value_split_across_text_parts_is_redacted(texts: list[str], expected: list[str]) -> None:
    content = [{"type": "text", "text": t} for t in texts]
    out = redacted({"role": "user", "content": content})
    assert [p["text"] for p in out["content"]] == expected


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(max_size=3).flatmap(lambda t: PIECES.map(lambda p: t + p)), max_size=6))
def test_parts_rewritten_as_one_are_the_whole_texts_rewrite(parts: list[str]) -> None:
    out = finish(RW.rewrite_parts_steps(parts))
    assert len(out) == len(parts)
    assert "".join(out) == RW.rewrite("".join(parts))


def test_parts_that_hold_every_joiner_are_rewritten_each_alone() -> None:
    taken = "".join(chr(cp) for cp in range(0xFDD0, 0xFDF0))
    parts = [f"{taken} card 4111 1111", " 1111 1111", "x@example.com"]
    assert finish(RW.rewrite_parts_steps(parts)) == [
        f"{taken} card 4111 1111",
        " 1111 1111",
        "[EMAIL]",
    ]
    long = ["\ufdd0" + "a " * 200, "4111 1111 1111 1111"]
    assert finish(RW.rewrite_parts_steps(long)) == [long[0], "[CARD]"]


def test_text_parts_keep_their_other_fields() -> None:
    out = redacted(
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "card 4111 1111", "cache_control": {"type": "ephemeral"}},
                {"type": "image_url", "image_url": {"url": "https://x.org/a.png"}},
                {"type": "text", "text": " 1111 1111"},
            ],
        }
    )
    assert out["content"] == [
        {"type": "text", "text": "card [CARD]", "cache_control": {"type": "ephemeral"}},
        {"type": "image_url", "image_url": {"url": "https://x.org/a.png"}},
        {"type": "text", "text": ""},
    ]


def test_rewrite_parts_of_long_texts_in_steps() -> None:
    parts = ["x " * 5000 + "card 4111 1111", " 1111 1111 " + "y " * 5000]
    steps = RW.rewrite_parts_steps(parts)
    assert finish(steps) == ["x " * 5000 + "card [CARD]", " " + "y " * 5000]
