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
text (the bench checks 1 MB adversarial inputs).

Text is normalised before matching, character by character (so chunking cannot
change it): zero-width characters are dropped (they are a known way to split a
number past a filter) and full-width digits and ``+ @ % - .`` become ASCII.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import regex

from ..slices import CHARS_PER_STEP, Steps, text_slices

#: Dropped: invisible characters used to split numbers past filters.
ZERO_WIDTH = "\u200b\u200c\u200d\u2060\ufeff\u00ad\u180e"
_TABLE: dict[int, int | None] = {ord(c): None for c in ZERO_WIDTH}
_TABLE.update({0xFF10 + i: 0x30 + i for i in range(10)})  # full-width digits
_TABLE.update({0xFF0B: ord("+"), 0xFF20: ord("@"), 0xFF05: ord("%"), 0xFF0D: ord("-")})
_TABLE.update({0xFF0E: ord("."), 0x2011: ord("-"), 0x00A0: ord(" "), 0x202F: ord(" ")})
_TABLE.update({0x2007: ord(" ")})

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

    def stream(self, on_hit: Callable[[str], None] | None = None) -> RewriteStream:
        """A fresh streaming state machine; ``on_hit(rule name)`` is called per rewrite."""
        return RewriteStream(self, on_hit)

    def rewrite(self, text: str, on_hit: Callable[[str], None] | None = None) -> str:
        """Rewrite a whole text (the same result as streaming it in any chunks)."""
        s = self.stream(on_hit)
        return s.feed(text) + s.finish()

    def rewrite_steps(
        self, text: str, on_hit: Callable[[str], None] | None = None
    ) -> Steps[str]:
        """:meth:`rewrite` in steps of :data:`~aiserve_trio.slices.CHARS_PER_STEP` characters.

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


class RewriteStream:
    """Sans-IO streaming rewriter: ``feed(text) -> safe text``, ``finish() -> rest``."""

    __slots__ = ("_base", "_buf", "_ctx", "_on_hit", "_rw", "_skip", "max_holdback")

    def __init__(self, rw: Rewriter, on_hit: Callable[[str], None] | None) -> None:
        self._rw = rw
        self._on_hit = on_hit
        self._buf = ""  # context chars (already emitted) + held-back text
        self._ctx = 0  # how many leading chars of _buf are context only
        self._base = 0  # absolute offset of _buf[0] in the normalised stream
        self._skip: dict[int, int] = {}  # rule index -> absolute end of its last rejection
        self.max_holdback = rw.max_holdback

    @property
    def held(self) -> int:
        """Characters currently held back."""
        return len(self._buf) - self._ctx

    def feed(self, text: str) -> str:
        """Take more reply text; return what is safe to emit now."""
        if not text:
            return ""
        self._buf += normalize(text)
        return self._run(final=False)

    def finish(self) -> str:
        """The end of the reply: decide and return everything still held."""
        out = self._run(final=True)
        self._buf, self._ctx = "", 0
        return out

    def _run(self, *, final: bool) -> str:
        buf = self._buf
        n = len(buf)
        rules = self._rw.rules
        out: list[str] = []
        emit = pos = self._ctx
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
            out.append(buf[emit:s])
            out.append(repl)
            emit = pos = end
        if emit < hold:
            out.append(buf[emit:hold])
        # Keep what lookbehinds may need before the held tail: the original text.
        keep = max(hold - self._rw.context, 0)
        self._base += keep
        self._buf = buf[keep:]
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
