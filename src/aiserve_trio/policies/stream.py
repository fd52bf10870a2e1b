"""Streaming-safe pattern rewriting: the sans-IO engine under the output policies.

A :class:`Rewriter` holds an ordered list of :class:`Rule` (a bounded regular
expression and a function deciding what a match becomes). Over a whole text it
behaves like a careful ``re.sub``: scanning left to right, at each position the
first rule whose match its ``replace`` accepts wins, and scanning resumes after
it; a position where no rule is accepted is left as it is.

:class:`RewriteStream` does the same over text arriving in pieces and gives the
same result for any chunking. It decides a position only when no more text can
change the decision:

- a position where no rule can match, even partially (``regex``'s partial
  matching), is emitted at once -- text that cannot be part of a secret flows;
- a rule that matches (fully or partially) at a position is final once the
  text from there is longer than the rule's *reach* (the most characters an
  attempt can read: the pattern's maximum width plus its lookaheads), or once
  the run of the rule's *alphabet* (every character the pattern can consume)
  has ended more than the lookahead width before the end of the buffer.

So the text held back is at most the largest reach of the rules, and patterns
must have a bounded width: an unbounded one (``\\d+``) is refused at start-up.
Patterns have no nested unbounded quantifiers, so matching is linear in the
text (docs/benchmarks.md, policies: 1 MB adversarial inputs).

Text is normalised before matching, character by character (so chunking cannot
change it; :func:`normalize`): every default-ignorable and format character is
dropped (zero-width spaces and joiners, LRM/RLM, bidi embeddings and isolates,
invisible operators such as U+2062, the combining grapheme joiner, variation
selectors, tag characters -- known ways to split a number past a filter), every
decimal digit of any script becomes its ASCII digit (Arabic-Indic,
mathematical bold...), full-width forms and mathematical letters fold to ASCII,
every space separator becomes a space and every dash a hyphen. Matching runs on
the normalised text, but what is emitted is mapped back to the original: text
outside a match keeps its own spelling, ignorable characters included (an emoji
keeps its joiners), and a match is replaced whole, its ignorable characters
with it. The map from normalised to original positions is kept only for the
held-back tail, and at most :data:`MAX_DROPPED_RUN` dropped characters are kept
in a row (more are dropped from the output too), so it stays bounded.
"""

from __future__ import annotations

import bisect
import functools
import importlib
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import regex

from ..core.slices import CHARS_PER_STEP, Steps, text_slices

#: Dropped: invisible characters used to split numbers past filters (the first
#: list; :data:`IGNORABLE` has them all).
ZERO_WIDTH = "\u200b\u200c\u200d\u2060\ufeff\u00ad\u180e"
#: Default-ignorable code points that are not format characters (Unicode's
#: DerivedCoreProperties), and unassigned ranges reserved as ignorable.
_IGNORABLE_RANGES = (
    (0x034F, 0x034F),  # combining grapheme joiner
    (0x115F, 0x1160),  # Hangul fillers
    (0x17B4, 0x17B5),
    (0x180B, 0x180F),  # Mongolian variation selectors
    (0x2060, 0x206F),
    (0x3164, 0x3164),
    (0xFE00, 0xFE0F),  # variation selectors (VS16...)
    (0xFFA0, 0xFFA0),
    (0xFFF0, 0xFFF8),
    (0x1BCA0, 0x1BCA3),
    (0xE0000, 0xE0FFF),  # tags, variation selectors supplement
)
#: Where the table looks for format characters, digits and separators.
_SCAN_TO = 0x20000


def _build_table() -> dict[int, int | None]:
    table: dict[int, int | None] = {}
    for lo, hi in _IGNORABLE_RANGES:
        table.update(dict.fromkeys(range(lo, hi + 1)))
    for cp in range(0x80, _SCAN_TO):
        c = chr(cp)
        cat = unicodedata.category(c)
        if cat == "Cf":
            table[cp] = None
        elif cat == "Nd":
            table[cp] = 0x30 + unicodedata.decimal(c)
        elif cat == "Zs":
            table[cp] = 0x20
        elif cat == "Pd":
            table[cp] = 0x2D
    for cp in range(0xFF01, 0xFF5F):  # full-width ASCII
        if cp not in table:
            table[cp] = cp - 0xFF01 + 0x21
    for cp in range(0x1D400, 0x1D800):  # mathematical letters
        if cp in table:
            continue
        folded = unicodedata.normalize("NFKC", chr(cp))
        if len(folded) == 1 and folded.isascii():
            table[cp] = ord(folded)
    table.update({0x2212: 0x2D, 0xFE63: 0x2D})  # minus signs
    table.update({0x2215: 0x2F, 0x2044: 0x2F})  # division and fraction slashes
    return table


_TABLE = _build_table()
#: Every character :func:`normalize` drops.
IGNORABLE = frozenset(chr(cp) for cp, to in _TABLE.items() if to is None)
#: The longest run of dropped characters kept for the output (more are dropped).
MAX_DROPPED_RUN = 32


def _class(chars: set[str] | frozenset[str]) -> str:
    """A character class of ``chars``, as ranges."""
    cps = sorted(ord(c) for c in chars)
    out, i = [], 0
    while i < len(cps):
        j = i
        while j + 1 < len(cps) and cps[j + 1] == cps[j] + 1:
            j += 1
        out.append(f"\\U{cps[i]:08x}" + (f"-\\U{cps[j]:08x}" if j > i else ""))
        i = j + 1
    return "[" + "".join(out) + "]+"


@functools.lru_cache(maxsize=64)
def _drops(boundary: str) -> regex.Pattern[str]:
    """Runs of the characters dropped before matching (and ``boundary``, if any)."""
    return regex.compile(_class(IGNORABLE | set(boundary)))


#: Noncharacters (not text): what joins texts read as one.
_NONCHARACTERS = tuple(chr(cp) for cp in range(0xFDD0, 0xFDF0))
# Compiled now, not inside a request's first step (a few ms each).
_drops("")
_drops(_NONCHARACTERS[0])

#: Patterns wider than this are refused: they would hold back too much text.
MAX_REACH = 1024
_sre: Any = importlib.import_module("re._parser")  # CPython's own regex parser, for widths


def normalize(text: str) -> str:
    """Per-character normalisation applied before matching (chunking-safe)."""
    return text.translate(_TABLE)


def _assert_widths(items: Any, direction: int) -> int:
    """Sum of the maximum widths of the lookarounds (``direction`` 1: ahead, -1: behind)."""
    total = 0
    for op, av in items:
        name = str(op)
        if name in ("ASSERT", "ASSERT_NOT"):
            d, sub = av
            if d == direction:
                total += sub.getwidth()[1]
            total += _assert_widths(sub.data, direction)
        elif name == "SUBPATTERN":
            total += _assert_widths(av[3].data, direction)
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            total += _assert_widths(av[2].data, direction)
        elif name == "BRANCH":
            total += max((_assert_widths(b.data, direction) for b in av[1]), default=0)
        elif name == "ATOMIC_GROUP":
            total += _assert_widths(av.data, direction)
    return total


def pattern_reach(pattern: str) -> tuple[int, int, int]:
    """``(reach, lookahead, lookbehind)`` of a pattern, in characters.

    ``reach`` is the most characters a match attempt at a position can read from
    there (maximum match width plus lookaheads, plus one for ``\\b``-like checks).

    Raises:
        ValueError: the pattern is not a regular expression, or its width is
            unbounded or larger than :data:`MAX_REACH`.
    """
    try:
        tree = _sre.parse(pattern)
    except Exception as exc:  # re.error and friends: the message says what is wrong
        raise ValueError(f"not a regular expression: {exc}") from exc
    width = tree.getwidth()[1]
    if width > MAX_REACH:
        raise ValueError(
            "pattern width is unbounded or too large: use bounded repeats like {1,64}, "
            f"at most {MAX_REACH} characters"
        )
    ahead = _assert_widths(tree.data, 1) + 1
    behind = _assert_widths(tree.data, -1)
    return width + ahead, ahead, behind


@dataclass(frozen=True, slots=True)
class Rule:
    """One pattern and what its matches become.

    ``replace(match)`` returns the replacement, or ``None`` when the match is
    not a hit after all (e.g. a card number failing the Luhn check).
    ``alphabet`` is a character class holding every character the pattern can
    consume; it lets a match be decided as soon as its run of such characters
    has ended. ``skip_rejected``: after a rejected match, do not try this rule
    again inside it (for rules whose ``replace`` already searched the whole match).
    """

    name: str
    pattern: regex.Pattern[str]
    replace: Callable[[regex.Match[str]], str | None]
    reach: int
    ahead: int
    behind: int
    #: The pattern followed by ``(?!)``: matches only partially, at the end.
    tail: regex.Pattern[str]
    alphabet: regex.Pattern[str] | None = None
    skip_rejected: bool = False


def make_rule(
    name: str,
    pattern: str,
    replace: Callable[[regex.Match[str]], str | None],
    *,
    alphabet: str | None = None,
    skip_rejected: bool = False,
    flags: int = 0,
) -> Rule:
    """Compile a :class:`Rule`, measuring its reach.

    Raises:
        ValueError: the pattern is invalid or unbounded (see :func:`pattern_reach`).
    """
    reach, ahead, behind = pattern_reach(pattern)
    try:
        compiled = regex.compile(pattern, flags | regex.VERSION0)
        tail = regex.compile(f"(?:{pattern})(?!)", flags | regex.VERSION0)
    except regex.error as exc:
        raise ValueError(f"not a regular expression: {exc}") from exc
    run = regex.compile(f"{alphabet}{{0,{reach}}}") if alphabet else None
    return Rule(name, compiled, replace, reach, ahead, behind, tail, run, skip_rejected)


def literal(text: str) -> Callable[[regex.Match[str]], str]:
    """A ``replace`` that always gives ``text``."""
    return lambda _m: text


_UNDECIDED = object()
_REJECT = object()


class Rewriter:
    """An ordered rule set, shared by every request; makes per-reply streams."""

    def __init__(self, rules: Sequence[Rule]) -> None:
        if not rules:
            raise ValueError("a rewriter needs at least one rule")
        self.rules = tuple(rules)
        self.max_holdback = max(r.reach for r in rules)
        self.context = max(r.behind for r in rules)

    def stream(
        self, on_hit: Callable[[str], None] | None = None, *, boundary: str = ""
    ) -> RewriteStream:
        """A fresh streaming state machine; ``on_hit(rule name)`` is called per rewrite.

        ``boundary``: a character that joins separate texts -- dropped before
        matching, so a match may span it, and always emitted, after the
        replacement of a match that spans it.
        """
        return RewriteStream(self, on_hit, boundary)

    def rewrite(self, text: str, on_hit: Callable[[str], None] | None = None) -> str:
        """Rewrite a whole text (the same result as streaming it in any chunks)."""
        s = self.stream(on_hit)
        return s.feed(text) + s.finish()

    def rewrite_steps(self, text: str, on_hit: Callable[[str], None] | None = None) -> Steps[str]:
        """:meth:`rewrite` in steps of :data:`~aiserve_trio.core.slices.CHARS_PER_STEP` characters.

        Each step is bounded: the stream is fed one slice at a time, so every
        regular-expression search covers at most a slice and the held-back tail.
        """
        if len(text) <= CHARS_PER_STEP:
            return self.rewrite(text, on_hit)
        s = self.stream(on_hit)
        out = []
        for piece in text_slices(text):
            out.append(s.feed(piece))
            yield
        out.append(s.finish())
        return "".join(out)

    def rewrite_parts_steps(
        self, parts: Sequence[str], on_hit: Callable[[str], None] | None = None
    ) -> Steps[list[str]]:
        """Rewrite texts that are read as one (a message's text blocks): a match
        may span from one part into the next. Its replacement goes to the part it
        starts in; the rest of it is gone from the parts after. In steps.
        """
        if not parts:
            return []
        boundary = _NONCHARACTERS[0]
        if sum(map(len, parts)) < CHARS_PER_STEP:  # short: any free noncharacter
            present = set().union(*parts)
            boundary = next((c for c in _NONCHARACTERS if c not in present), "")
        elif any(boundary in p for p in parts):
            boundary = ""
        if not boundary:  # no free joiner (a client's doing): each part alone
            out = []
            for p in parts:
                out.append((yield from self.rewrite_steps(p, on_hit)))
            return out
        s = self.stream(on_hit, boundary=boundary)
        pieces = []
        for i, p in enumerate(parts):
            for piece in text_slices(boundary + p if i else p):
                pieces.append(s.feed(piece))
                yield
        pieces.append(s.finish())
        return "".join(pieces).split(boundary)


class RewriteStream:
    """Sans-IO streaming rewriter: ``feed(text) -> safe text``, ``finish() -> rest``."""

    __slots__ = (
        "_base",
        "_boundary",
        "_buf",
        "_ctx",
        "_drop",
        "_mk",
        "_mo",
        "_oemit",
        "_on_hit",
        "_orig",
        "_run_len",
        "_rw",
        "_skip",
        "max_holdback",
    )

    def __init__(
        self, rw: Rewriter, on_hit: Callable[[str], None] | None, boundary: str = ""
    ) -> None:
        self._rw = rw
        self._on_hit = on_hit
        self._boundary = boundary
        self._drop = _drops(boundary)
        self._buf = ""  # context chars (already emitted) + held-back text, normalised
        self._ctx = 0  # how many leading chars of _buf are context only
        self._base = 0  # absolute offset of _buf[0] in the normalised stream
        self._skip: dict[int, int] = {}  # rule index -> absolute end of its last rejection
        # The original text of _buf (with the characters dropped from it), and
        # where they differ: _buf[_mk[j] + d] is _orig[_mo[j] + d] (until the next mark).
        self._orig = ""
        self._mk = [0]
        self._mo = [0]
        self._oemit = 0  # how much of _orig is emitted
        self._run_len = 0  # dropped characters at the end of _orig
        self.max_holdback = rw.max_holdback

    @property
    def held(self) -> int:
        """Characters currently held back."""
        return len(self._buf) - self._ctx

    def feed(self, text: str) -> str:
        """Take more reply text; return what is safe to emit now."""
        if not text:
            return ""
        norm = text.translate(_TABLE)
        if self._boundary:
            norm = norm.replace(self._boundary, "")
        if len(norm) != len(text):
            text = self._mark_drops(text)
        else:
            self._run_len = 0
        self._buf += norm
        self._orig += text
        return self._run(final=False)

    def _mark_drops(self, text: str) -> str:
        """Record where ``text``'s dropped characters are; ``text`` with runs of
        more than :data:`MAX_DROPPED_RUN` of them cut to that."""
        k, o = len(self._buf), len(self._orig)
        kept: list[str] = []
        at = 0
        for m in self._drop.finditer(text):
            a, b = m.span()
            k += a - at
            o += a - at
            kept.append(text[at:a])
            run = text[a:b]
            before = self._run_len if a == 0 else 0  # a run that goes on from the last feed
            room = max(MAX_DROPPED_RUN - before, 0)
            if len(run) > room:
                joins = run.count(self._boundary) * self._boundary if self._boundary else ""
                run = run[: max(room - len(joins), 0)] + joins
            kept.append(run)
            self._run_len = before + len(run)
            o += len(run)
            at = b
            if self._mk[-1] == k:
                self._mo[-1] = o
            else:
                self._mk.append(k)
                self._mo.append(o)
        kept.append(text[at:])
        if at < len(text):
            self._run_len = 0
        return "".join(kept)

    def _o(self, k: int) -> int:
        """The position in ``_orig`` of normalised ``_buf[k]`` (``len(_orig)`` at the end)."""
        j = bisect.bisect_right(self._mk, k) - 1
        return self._mo[j] + k - self._mk[j]

    def finish(self) -> str:
        """The end of the reply: decide and return everything still held."""
        out = self._run(final=True)
        self._buf, self._ctx, self._orig, self._oemit, self._run_len = "", 0, "", 0, 0
        self._mk, self._mo = [0], [0]
        return out

    def _replaced(self, s: int, e: int, match: str, repl: str) -> str:
        """The output for the match ``_buf[s:e]``: ``repl``, any boundary it
        spans, and a tail of ``repl`` equal to the match's in its original spelling."""
        common = 0
        limit = min(len(match) - 1, len(repl))
        while common < limit and repl[-1 - common] == match[-1 - common]:
            common += 1
        end = self._o(e - 1) + 1  # not the characters dropped after the match
        cut = self._o(e - common) if common else end
        spanned = self._orig[self._o(s) : cut]
        kept = spanned.count(self._boundary) * self._boundary if self._boundary else ""
        return repl[: len(repl) - common] + kept + self._orig[cut:end]

    def _run(self, *, final: bool) -> str:
        buf = self._buf
        n = len(buf)
        rules = self._rw.rules
        out: list[str] = []
        oemit = self._oemit
        pos = self._ctx
        hold = n
        # Per rule, its leftmost candidate at or after the scan point. A rule
        # scans the text once: positions it was cleared of stay cleared while
        # another rule's candidates are decided.
        nxt = [-1] * len(rules)
        while pos < n:
            for i, rule in enumerate(rules):
                if nxt[i] < pos:
                    start = max(pos, self._skip.get(i, 0) - self._base)
                    nxt[i] = _leftmost(rule, buf, start, final) if start < n else n
            s = min(nxt)
            if s >= n:
                break
            verdict = self._decide(buf, s, final, [i for i, c in enumerate(nxt) if c == s])
            if verdict is _UNDECIDED:
                hold = s
                break
            if verdict is _REJECT:
                pos = s + 1
                continue
            assert isinstance(verdict, tuple)
            end: int = verdict[0]
            repl: str = verdict[1]
            os = self._o(s)
            out.append(self._orig[oemit:os])
            out.append(self._replaced(s, end, buf[s:end], repl))
            oemit = self._o(end - 1) + 1
            pos = end
        ohold = self._o(hold)
        if oemit < ohold:
            out.append(self._orig[oemit:ohold])
            oemit = ohold
        # Keep what lookbehinds may need before the held tail: the original text.
        keep = max(hold - self._rw.context, 0)
        okeep = self._o(keep)
        j = bisect.bisect_right(self._mk, keep) - 1
        self._mk = [0] + [k - keep for k in self._mk[j + 1 :]]
        self._mo = [0] + [o - okeep for o in self._mo[j + 1 :]]
        self._base += keep
        self._buf = buf[keep:]
        self._orig = self._orig[okeep:]
        self._oemit = oemit - okeep
        self._ctx = hold - keep
        return "".join(out)

    def _decide(self, buf: str, s: int, final: bool, candidates: list[int]) -> object:
        """Decide position ``s``: a rewrite ``(end, text)``, ``_REJECT`` or ``_UNDECIDED``."""
        rules = self._rw.rules
        for i in candidates:  # in priority order
            rule = rules[i]
            m = rule.pattern.match(buf, s, partial=not final)
            if m is None:
                continue
            if not final and (m.partial or not self._settled(rule, buf, s)):
                return _UNDECIDED
            repl = rule.replace(m)
            if repl is None:
                if rule.skip_rejected:
                    self._skip[i] = self._base + m.end()
                continue
            if self._on_hit is not None:
                self._on_hit(rule.name)
            return m.end(), repl
        return _REJECT

    @staticmethod
    def _settled(rule: Rule, buf: str, s: int) -> bool:
        """Whether more text could still change this rule's match at ``s``."""
        n = len(buf)
        if n - s > rule.reach:
            return True
        if rule.alphabet is None:
            return False
        run = rule.alphabet.match(buf, s)
        end = run.end() if run is not None else s
        return end + rule.ahead < n


def _leftmost(rule: Rule, buf: str, start: int, final: bool) -> int:
    """The leftmost position >= ``start`` where ``rule`` matches, even partially.

    ``len(buf)`` if none. ``regex``'s partial search prefers a full match
    anywhere to a partial one further left, so partial matches are looked for
    with ``rule.tail`` -- the pattern followed by ``(?!)``, which never matches
    fully -- and only near the end, where a match still open can start.
    """
    n = len(buf)
    m = rule.pattern.search(buf, start)
    first: int = m.start() if m is not None else n
    if final:
        return first
    lo = max(start, n - rule.reach)
    if lo < first:
        p = rule.tail.search(buf, lo, partial=True)
        if p is not None and p.start() < first:
            return int(p.start())
    return first
