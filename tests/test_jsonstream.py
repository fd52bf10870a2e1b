"""JsonStringFilter: policies over string values of streamed JSON, for any split."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from aiserve_trio.config import build_policies
from aiserve_trio.policies.base import OutputFilter, PolicyContext
from aiserve_trio.policies.jsonstream import MAX_ESCAPE, JsonStringFilter

from .conftest import make_config

(REDACT,) = build_policies(["gdpr-redact"], make_config())
CTX = PolicyContext(route="chat", channel="app", tenant="t", request_id="r")


def redact_chain() -> list[OutputFilter]:
    flt = REDACT.output_filter(CTX)
    assert flt is not None
    return [flt]


def redact(text: str) -> str:
    """The whole string through gdpr-redact at once."""
    (flt,) = redact_chain()
    return flt.feed(text) + flt.finish()


class Held:
    """A test filter: maps each character with ``fn``, holding back the last ``k``.

    Single use, like the policies' filters: a chain per string value.
    """

    def __init__(self, k: int, fn: Callable[[str], str] = lambda c: c) -> None:
        self.max_holdback = k
        self._fn = fn
        self._buf = ""
        self._done = False

    def feed(self, text: str) -> str:
        assert not self._done, "fed after finish: a chain was reused"
        self._buf += text
        cut = max(len(self._buf) - self.max_holdback, 0)
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return "".join(map(self._fn, out))

    def finish(self) -> str:
        assert not self._done, "finished twice"
        out, self._buf, self._done = self._buf, "", True
        return "".join(map(self._fn, out))


# --- generated JSON ------------------------------------------------------------------

PII = [
    "4111 1111 1111 1111",
    "4111-1111-1111-1111",
    "john.doe@example.com",
    "+86 138 0013 8000",
    "DE89 3704 0044 0532 0130 00",
    "192.168.1.10",
]
SPECIAL = [
    '"',
    "\\",
    "/",
    "\n",
    "\t",
    "\b",
    "\x00",
    "\x1f",
    "\x7f",
    "é",
    "中",
    "😀",
    "\u200b",
    "\u2028",
    "\uff14",  # full-width 4
]
SURROGATES = ["\ud83d", "\ude00", "\udbff"]  # lone ones; adjacent ones may pair up when escaped
STRINGS = st.lists(
    st.sampled_from(PII)
    | st.sampled_from(SPECIAL)
    | st.sampled_from(SURROGATES)
    | st.text(st.characters(codec="utf-8"), max_size=6)
    | st.just(" "),
    max_size=6,
).map("".join)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([13800138000, 4111111111111111, 8613800138000])
    | st.floats(allow_nan=False, allow_infinity=False)
    | STRINGS
)
VALUES = st.recursive(
    SCALARS,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(STRINGS, kids, max_size=4),
    max_leaves=10,
)
CUTS = st.lists(st.integers(0, 10_000), max_size=20)
SHORT = {
    '"': '\\"',
    "\\": "\\\\",
    "/": "\\/",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
}
WS = ["", " ", "\n  ", "\t", "\r\n"]


def spell_char(c: str, rnd: random.Random) -> str:
    """One character of a JSON string, spelled any way JSON allows (surrogates escaped)."""
    options = [] if c in '"\\' or c < " " or "\ud800" <= c <= "\udfff" else [c]
    if c in SHORT:
        options.append(SHORT[c])
    code = ord(c)
    if code < 0x10000:
        options += [f"\\u{code:04x}", f"\\u{code:04X}"]
    else:
        hi, lo = 0xD800 + ((code - 0x10000) >> 10), 0xDC00 + ((code - 0x10000) & 0x3FF)
        options += [f"\\u{hi:04x}\\u{lo:04x}", f"\\u{hi:04X}\\u{lo:04X}"]
    return rnd.choice(options)


def spell(value: Any, rnd: random.Random) -> str:
    """``value`` as JSON text with random escapes and whitespace."""

    def ws() -> str:
        return rnd.choice(WS)

    if isinstance(value, str):
        return '"' + "".join(spell_char(c, rnd) for c in value) + '"'
    if isinstance(value, list):
        return "[" + ws() + ",".join(ws() + spell(v, rnd) + ws() for v in value) + "]"
    if isinstance(value, dict):
        items = (
            ws() + spell(k, rnd) + ws() + ":" + ws() + spell(v, rnd) + ws()
            for k, v in value.items()
        )
        return "{" + ws() + ",".join(items) + "}"
    return json.dumps(value)


@st.composite
def json_texts(draw: st.DrawFn) -> str:
    value = draw(VALUES)
    how = draw(st.sampled_from(["ascii", "unicode", "indent", "spelled"]))
    if how == "spelled":
        return spell(value, draw(st.randoms(use_true_random=False)))
    indent = 2 if how == "indent" else None
    text = json.dumps(value, ensure_ascii=how == "ascii", indent=indent)
    try:
        text.encode()  # what a gateway gets was UTF-8: no raw surrogates
    except UnicodeEncodeError:
        return json.dumps(value, indent=indent)
    return text


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def run(flt: JsonStringFilter, pieces: list[str]) -> str:
    return "".join(flt.feed(p) for p in pieces) + flt.finish()


def as_json(value: Any) -> Any:
    """``value`` as JSON can carry it.

    A lone high surrogate directly followed by a lone low one has no JSON spelling
    but the pair's (e.g. when the redaction drops a zero-width character between them).
    """
    return json.loads(json.dumps(value))


def redact_values(value: Any) -> Any:
    """The expected result: every string value and key redacted whole, and every
    number by its text (one that changes becomes a string)."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, list):
        return [redact_values(v) for v in value]
    if isinstance(value, dict):
        return {redact(k): redact_values(v) for k, v in value.items()}
    if isinstance(value, int | float) and not isinstance(value, bool):
        text = json.dumps(value)
        new = redact(text)
        return value if new == text else new
    return value


# --- properties ----------------------------------------------------------------------


@given(json_texts(), CUTS)
def test_string_values_are_redacted_as_whole_strings_however_the_json_is_split(
    text: str, cuts: list[int]
) -> None:
    out = run(JsonStringFilter(redact_chain), split(text, cuts))
    assert json.loads(out) == as_json(redact_values(json.loads(text)))


@given(json_texts(), CUTS)
def test_an_empty_chain_gives_the_input_byte_for_byte_holding_only_escapes(
    text: str, cuts: list[int]
) -> None:
    flt = JsonStringFilter(list)
    got, fed = "", ""
    for piece in split(text, cuts):
        fed += piece
        got += flt.feed(piece)
        assert fed.startswith(got)
        assert len(fed) - len(got) <= MAX_ESCAPE
    assert got + flt.finish() == text


@given(json_texts(), CUTS)
def test_filters_that_change_nothing_keep_the_original_spelling(text: str, cuts: list[int]) -> None:
    flt = JsonStringFilter(lambda: [Held(3), Held(5)])
    assert run(flt, split(text, cuts)) == text


@given(
    st.recursive(
        st.text("ab 1@.", max_size=60),
        lambda kids: (
            st.lists(kids, max_size=3)
            | st.dictionaries(st.text("ab", max_size=3), kids, max_size=3)
        ),
    ),
    CUTS,
)
def test_held_back_text_is_bounded_by_the_chain(value: Any, cuts: list[int]) -> None:
    text = json.dumps(value)
    assert_holds_back_at_most(8, text, split(text, cuts))


def assert_holds_back_at_most(bound: int, text: str, pieces: list[str]) -> None:
    flt = JsonStringFilter(lambda: [Held(3), Held(5)])
    assert flt.max_holdback == 8 + MAX_ESCAPE
    got, fed = "", ""
    for piece in pieces:
        fed += piece
        got += flt.feed(piece)
        assert fed.startswith(got)
        assert len(fed) - len(got) <= bound
    assert got + flt.finish() == text


SPELLED = '{"k\\u00e9": ["\\u00e9' + "x" * 30 + '\\/\\ud83d\\ude00", 1, "' + "y" * 30 + '"]}'


@pytest.mark.parametrize("size", [1, 10])
def test_a_holding_chain_that_changes_nothing_keeps_every_byte(size: int) -> None:
    # fed in pieces longer than the chain holds, plain runs come out in parts
    assert_holds_back_at_most(8 * 12 + size, SPELLED, chunks(SPELLED, size))
    text = '{"k": ["' + "x" * 40 + '"]}'
    assert_holds_back_at_most(8, text, chunks(text, size))


def chunks(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@given(json_texts(), CUTS)
def test_filters_run_in_order_and_their_output_is_re_escaped(text: str, cuts: list[int]) -> None:
    # the second filter sees the first one's output; an emoji is one character
    second = {"b": '"\\\n', "😀": "\ud83d"}

    def chain() -> list[OutputFilter]:
        return [
            Held(2, lambda c: "b" if c == "a" else c),
            Held(4, lambda c: second.get(c, c)),
        ]

    def mapped(text: str) -> str:
        return "".join(second.get(c, c) for c in text.replace("a", "b"))

    def expected(value: Any) -> Any:
        if isinstance(value, str):
            return mapped(value)
        if isinstance(value, list):
            return [expected(v) for v in value]
        if isinstance(value, dict):
            return {mapped(k): expected(v) for k, v in value.items()}
        if value is None or isinstance(value, bool | int | float):  # numbers, literals
            text = json.dumps(value)
            assume(len(text) <= 6 + MAX_ESCAPE)  # longer: not JSON, plain text
            return value if mapped(text) == text else mapped(text)
        return value

    want = as_json(expected(json.loads(text)))
    out = run(JsonStringFilter(chain), split(text, cuts))
    assert json.loads(out) == want
    out.encode()  # a changed string's lone surrogates are escaped, not left raw


BROKEN = st.text(st.sampled_from('{}[]:,"\\u0dDeE8c1a x\n\x00😀\ud83d'), max_size=60)


@st.composite
def broken_texts(draw: st.DrawFn) -> str:
    """Valid JSON cut short or with junk spliced in, or JSON-ish noise."""
    if draw(st.booleans()):
        return draw(BROKEN)
    text = draw(json_texts())
    at = draw(st.integers(0, len(text)))
    return text[:at] + draw(BROKEN) + text[at + draw(st.integers(0, 3)) :]


@given(broken_texts(), CUTS)
def test_broken_json_never_raises_and_passes_through(text: str, cuts: list[int]) -> None:
    assert run(JsonStringFilter(list), split(text, cuts)) == text
    assert isinstance(run(JsonStringFilter(redact_chain), split(text, cuts)), str)


# --- examples ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pieces", "expected"),
    [
        (['{"card": "4111 1111', ' 1111 1111", "n": 3}'], '{"card": "[CARD]", "n": 3}'),
        # keys too (issue 51)
        (['{"4111 1111 1111 1111": "x@example.com"}'], '{"[CARD]": "[EMAIL]"}'),
        (['{"x@exam', 'ple.com": 1}'], '{"[EMAIL]": 1}'),
        # numbers: one that is personal data becomes a string of its redaction
        (['{"phone": 138', "00138000}"], '{"phone": "[PHONE]"}'),
        (["[4111111111111111, 12.5, -3e8, true, null]"], '["[CARD]", 12.5, -3e8, true, null]'),
        (["13800138000"], '"[PHONE]"'),
        (
            ['[["4111 1111 1111 1111"], {"a": ["x@', 'example.com"]}]'],
            '[["[CARD]"], {"a": ["[EMAIL]"]}]',
        ),
        (['"4111 1111 1111 1111"'], '"[CARD]"'),
        # escapes split anywhere: the text released before the first change keeps its
        # spelling, the rest of that string is re-escaped (non-ASCII kept)
        (
            ['{"a": "\\u00e9 \\', "u004", "1 \\ud83d", "\\ude", '00 x@example.com\\n"}'],
            '{"a": "\\u00e9 \\u0041 \\ud83d\\ude00 [EMAIL]\\n"}',
        ),
        (
            ['{"a": "x@example.com \\u00e9 \\', "u004", "1 \\ud83d", "\\ude", '00\\/\\n\\u0000"}'],
            '{"a": "[EMAIL] é A 😀/\\n\\u0000"}',
        ),
        # a lone high surrogate, then a quote
        (['["\\ud83d', '"]'], '["\\ud83d"]'),
        # unchanged strings keep their spelling
        (['{"a\\u00e9": "\\u00e9\\/ok"}'], '{"a\\u00e9": "\\u00e9\\/ok"}'),
        (['["x@example.com", "\\u00e9"]'], '["[EMAIL]", "\\u00e9"]'),
    ],
)
def test_examples(pieces: list[str], expected: str) -> None:
    assert run(JsonStringFilter(redact_chain), pieces) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # a bad escape: the string's chain is flushed, the rest is plain text (issue 51:
        # it passed through unredacted)
        (
            '{"a": "4111 1111 1111 1111 \\x", "b": "4111 1111 1111 1111"}',
            '{"a": "[CARD] \\x", "b": "[CARD]"}',
        ),
        # junk after a value
        ('{"a": "x@example.com" oops "x@example.com"}', '{"a": "[EMAIL]" oops "[EMAIL]"}'),
        # a closer that does not match
        ('["x@example.com"} "x@example.com"', '["[EMAIL]"} "[EMAIL]"'),
        # cut short inside a string and inside an escape
        ('{"a": "x@example.com', '{"a": "[EMAIL]'),
        ('{"a": "x@example.com\\u00', '{"a": "[EMAIL]\\u00'),
        # a second top-level value, two objects back to back
        ('"x@example.com" "x@example.com"', '"[EMAIL]" "[EMAIL]"'),
        ('{"a": 1}{"phone": "13800138000"}', '{"a": 1}{"phone": "[PHONE]"}'),
        # a Python-style dict, key=value
        (
            "{'phone': 13800138000, 'mail': 'x@example.com'}",
            "{'phone': [PHONE], 'mail': '[EMAIL]'}",
        ),
        ("{'4111 1111 1111 1111': 1}", "{'[CARD]': 1}"),
        ("phone=13800138000&card=4111-1111-1111-1111", "phone=[PHONE]&card=[CARD]"),
        # a literal longer than the chain holds is text, not a number
        ("[" + "a" * 600 + " 13800138000]", "[" + "a" * 600 + " [PHONE]]"),
    ],
)
def test_broken_json_falls_back_to_plain_text(text: str, expected: str) -> None:
    assert run(JsonStringFilter(redact_chain), [text]) == expected
    assert run(JsonStringFilter(redact_chain), list(text)) == expected
