"""Output policies over streamed JSON: rewrite string values, keep the JSON valid.

Tool-call arguments arrive as JSON text in arbitrary fragments. A
:class:`JsonStringFilter` runs the decoded contents of every string -- values
and object keys -- through a fresh chain of :class:`~.base.OutputFilter` and
re-escapes what the chain releases; every number or literal is held until it
ends and run through a fresh chain whole, and one the chain changes becomes a
JSON string of the result (``{"phone": 13800138000}`` gives
``{"phone": "[PHONE]"}``, as the input side does); structure and whitespace
pass through byte for byte, as soon as they are read. Sans-IO; the same result
for any fragmentation. (An empty chain changes nothing: then numbers are not
held either.)

The structure is a small state machine, a table from ``(state, character
class)`` to the next state, plus a stack of open containers. The class of
``,``, ``}`` and ``]`` carries the innermost container (``",{"``: a comma in an
object), so the table alone decides that a comma in an object leads to a key
and in an array to a value::

    VALUE/ARRAY --{--> OBJECT   --[--> ARRAY   --"--> VSTRING   --digit etc.--> SCALAR
    OBJECT/KEY --"--> KSTRING --"--> COLON --:--> VALUE
    VSTRING --"--> AFTER         SCALAR --other--> AFTER (the character is read again)
    AFTER --,{--> KEY   --,[--> VALUE   --}{ / ][--> AFTER (pop)
    OBJECT --}{--> AFTER         ARRAY --][--> AFTER         whitespace: no change

Inside a string, runs without ``"`` or ``\\`` are content as they are; an
escape is decoded at once when the fragment holds all of it, else gathered
until it is decided (``\\uD83D`` waits for a low surrogate, so a pair split
anywhere decodes to one character). Each content piece is kept as
``(decoded, raw)``; a value's pieces go to its chain at the end of each feed.

Escaping: while the chain's output equals its input so far, the original
spelling (``raw``) of the released text is emitted, so an unchanged string
keeps its bytes (an empty chain is the identity). From the first character
where the output differs (a replacement, a normalised character) the rest of
that string is re-escaped canonically (``json.dumps`` with non-ASCII kept,
surrogates as ``\\u`` and four hex digits). Either way the output decodes to the chain's output,
except that a lone high surrogate right before a lone low one can only be
spelled as the pair: JSON has no other spelling for them.

Leniency and broken input: numbers and literals are not checked (a run of
``[0-9A-Za-z+-.]`` is one, up to :attr:`max_holdback` in length) and raw
control characters inside strings are accepted as content (like
``json.loads(strict=False)``). A character that makes no sense where it stands
(a bad escape, a stray ``"`` or ``'``, a mismatched closer, a second top-level
value, ``=``, a literal longer than the holdback) switches to plain text: the
current string's chain is flushed and everything from that character on goes
through one more fresh chain as text (a Python-style dict, two objects back to
back or ``key=value`` are redacted like any text, as the input side does when
arguments are not JSON). :meth:`JsonStringFilter.finish` on a truncated text
flushes the open string's chain and its pending escape (no closing quote is
invented). Nothing raises.
"""

from __future__ import annotations

import enum
import json
import re
from collections import deque
from collections.abc import Callable

from .base import OutputFilter, apply_filters, finish_filters


class _S(enum.Enum):
    VALUE = "a value"
    ARRAY = "a value or ]"
    OBJECT = "a key or }"
    KEY = "a key"
    COLON = "a colon"
    AFTER = "a comma or a closer"
    SCALAR = "in a number or literal"
    KSTRING = "in a key"
    VSTRING = "in a string value"
    BROKEN = "not JSON: plain text"


_NEXT: dict[tuple[_S, str], _S] = {
    **{
        (s, c): n
        for s in (_S.VALUE, _S.ARRAY)
        for c, n in (("{", _S.OBJECT), ("[", _S.ARRAY), ('"', _S.VSTRING), ("0", _S.SCALAR))
    },
    (_S.OBJECT, '"'): _S.KSTRING,
    (_S.KEY, '"'): _S.KSTRING,
    (_S.COLON, ":"): _S.VALUE,
    (_S.AFTER, ",{"): _S.KEY,
    (_S.AFTER, ",["): _S.VALUE,
    (_S.AFTER, "}{"): _S.AFTER,
    (_S.OBJECT, "}{"): _S.AFTER,
    (_S.AFTER, "]["): _S.AFTER,
    (_S.ARRAY, "]["): _S.AFTER,
    (_S.SCALAR, "0"): _S.SCALAR,
    **{(s, " "): s for s in (_S.VALUE, _S.ARRAY, _S.OBJECT, _S.KEY, _S.COLON, _S.AFTER)},
}
#: Where a string's closing quote leads.
_CLOSED = {_S.KSTRING: _S.COLON, _S.VSTRING: _S.AFTER}
_WS = frozenset(" \t\r\n")
_SCALAR = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ+-.")
_PLAIN = re.compile(r'[^"\\]+')
#: A whole escape, decided without more text (a high surrogate only with its low one).
_WHOLE = re.compile(
    r'\\(?:["\\/bfnrt]|u(?![dD][89abAB])[0-9a-fA-F]{4}'
    r"|u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2})"
)
_HEX = "0123456789abcdefABCDEF"
_SIMPLE = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
#: What each character of a low-surrogate escape may be.
_LOW = ("\\", "u", "dD", "cdefCDEF", _HEX, _HEX)
#: The longest escape text held while undecided: ``\\uD83D\\uDE0``.
MAX_ESCAPE = 11
_SURROGATE = re.compile("[\ud800-\udfff]")


def _cls(c: str, top: str) -> str:
    """The character class of ``c`` for :data:`_NEXT` (``top``: the innermost container)."""
    if c in _WS:
        return " "
    if c in ",}]":
        return c + top
    return "0" if c in _SCALAR else c


def _unescape(esc: str) -> tuple[str, int] | None:
    """Decode the escape ``esc`` starts with: ``(character, raw length)``, or None: need more.

    Raises:
        ValueError: ``esc`` is not a JSON escape.
    """
    if len(esc) < 2:
        return None
    if esc[1] in _SIMPLE:
        return _SIMPLE[esc[1]], 2
    if esc[1] != "u":
        raise ValueError(esc)
    digits = esc[2:6]
    if digits.strip(_HEX):
        raise ValueError(esc)
    if len(digits) < 4:
        return None
    code = int(digits, 16)
    if not 0xD800 <= code < 0xDC00:
        return chr(code), 6
    low = esc[6:12]
    if not all(c in ok for c, ok in zip(low, _LOW, strict=False)):
        return chr(code), 6  # a lone high surrogate: what follows is read again
    if len(low) < 6:
        return None
    return chr(0x10000 + ((code - 0xD800) << 10) + int(low[2:], 16) - 0xDC00), 12


def _common(text: str, i: int, prefix: str) -> int:
    """How many characters of ``prefix`` ``text`` has from ``i`` on."""
    pairs = zip(text[i : i + len(prefix)], prefix, strict=False)
    return next((k for k, (a, b) in enumerate(pairs) if a != b), min(len(text) - i, len(prefix)))


def _escape(text: str) -> str:
    """``text`` as JSON string content (non-ASCII kept, surrogates escaped)."""
    out = json.dumps(text, ensure_ascii=False)[1:-1]
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", out)


class JsonStringFilter:
    """Sans-IO: JSON text in, the same JSON out with each string value run through filters.

    ``make_filters()`` gives a fresh chain per string value. ``max_holdback`` is
    the holdback of one chain (made once, here, to measure it) plus
    :data:`MAX_ESCAPE`, in characters of string content. Single use.
    """

    def __init__(self, make_filters: Callable[[], list[OutputFilter]]) -> None:
        self._make = make_filters
        chain = make_filters()
        self._holds = bool(chain)  # an empty chain: numbers pass at once, nothing changes
        self.max_holdback = sum(f.max_holdback for f in chain) + MAX_ESCAPE
        self._scalar_max = self.max_holdback
        self._scalar = ""  # a number or literal being read (when the chain holds)
        self._plain: list[OutputFilter] = []  # the chain after the JSON broke
        self._state = _S.VALUE
        self._stack: list[str] = []
        self._chain: list[OutputFilter] = []
        self._esc = ""  # an escape not decided yet
        self._pieces: list[tuple[str, str]] = []  # (decoded, raw) read in this feed
        self._pending: deque[tuple[str, str]] = deque()  # in the chain, not out yet
        self._same = True  # the chain's output so far equals its input

    def feed(self, fragment: str) -> str:
        """Take more JSON text; return what can be emitted now."""
        out: list[str] = []
        self._read(fragment, out)
        if self._state in _CLOSED:
            self._flush(out)
        return "".join(out)

    def _read(self, text: str, out: list[str]) -> None:
        """Run the state machine over ``text``: structure to ``out``, content to pieces."""
        i = 0
        while i < len(text):
            state = self._state
            if state is _S.BROKEN:
                out.append(apply_filters(self._plain, text[i:]))
                break
            if state in _CLOSED:
                i = self._string(text, i, out)
                continue
            c = text[i]
            key = _cls(c, self._stack[-1] if self._stack else "")
            if state is _S.SCALAR and key != "0":
                self._end_scalar(out)
                state = _S.AFTER
            nxt = _NEXT.get((state, key))
            if nxt is None:
                self._break(out, "")
                continue
            if c in "{[":
                self._stack.append(c)
            elif c in "}]":
                self._stack.pop()
            elif nxt in _CLOSED:
                self._chain, self._same = self._make(), True
                self._pending.clear()
            elif nxt is _S.SCALAR and self._holds:
                if len(self._scalar) >= self._scalar_max:
                    scalar, self._scalar = self._scalar, ""
                    self._break(out, scalar)
                    continue
                self._scalar += c
                self._state = nxt
                i += 1
                continue
            self._state = nxt
            out.append(c)
            i += 1

    def _break(self, out: list[str], text: str) -> None:
        """Not JSON from here: the rest (from ``text``) is plain text through a fresh chain."""
        self._state = _S.BROKEN
        self._plain = self._make()
        if text:
            out.append(apply_filters(self._plain, text))

    def _end_scalar(self, out: list[str]) -> None:
        """A number or literal ended: as it was, or the chain's output as a JSON string."""
        text, self._scalar = self._scalar, ""
        if not text:
            return
        chain = self._make()
        new = apply_filters(chain, text) + finish_filters(chain)
        out.append(text if new == text else '"' + _escape(new) + '"')

    def finish(self) -> str:
        """The end of the text: what is still held (only a truncated string holds text)."""
        out: list[str] = []
        if self._state in _CLOSED:
            self._close(out)
            out.append(self._esc)
        elif self._state is _S.SCALAR:
            self._end_scalar(out)
        elif self._state is _S.BROKEN:
            out.append(finish_filters(self._plain))
        self._state, self._esc, self._plain = _S.BROKEN, "", []
        return "".join(out)

    def _string(self, text: str, i: int, out: list[str]) -> int:
        """Read string content at ``text[i]``; return the position to go on from."""
        c = text[i]
        if self._esc:
            self._esc += c
            try:
                got = _unescape(self._esc)
            except ValueError:
                self._close(out)
                esc, self._esc = self._esc, ""
                self._break(out, esc)
                return i + 1
            if got is None:
                return i + 1
            ch, n = got
            self._pieces.append((ch, self._esc[:n]))
            rest, self._esc = self._esc[n:], ""
            self._read(rest, out)  # after a lone high surrogate: what followed it
            return i + 1
        if c == "\\":
            whole = _WHOLE.match(text, i)
            if whole is None:  # gather it character by character
                self._esc = c
                return i + 1
            got = _unescape(whole.group())
            assert got is not None
            self._pieces.append((got[0], whole.group()))
            return whole.end()
        if c == '"':
            self._close(out)
            out.append(c)
            self._state = _CLOSED[self._state]
            return i + 1
        m = _PLAIN.match(text, i)
        assert m is not None
        self._pieces.append((m.group(), m.group()))
        return m.end()

    def _flush(self, out: list[str]) -> None:
        """Send the pieces read so far through the string's chain."""
        pieces, self._pieces = self._pieces, []
        if pieces:
            if self._same:
                self._pending.extend(pieces)
            self._emit(apply_filters(self._chain, "".join(d for d, _ in pieces)), out)

    def _close(self, out: list[str]) -> None:
        """The string ends (or breaks off): flush it and finish its chain."""
        self._flush(out)
        self._emit(finish_filters(self._chain), out)
        self._chain, self._pending = [], deque()

    def _emit(self, text: str, out: list[str]) -> None:
        """Emit chain output: the original spelling while it matches its input, else escaped."""
        i, pending = 0, self._pending
        while self._same and i < len(text) and pending:
            decoded, raw = pending[0]
            k = len(decoded) if text.startswith(decoded, i) else _common(text, i, decoded)
            if k == len(decoded):
                out.append(raw)
                pending.popleft()
            elif decoded == raw and k and i + k == len(text):  # part of a plain run
                out.append(decoded[:k])
                pending[0] = (decoded[k:], raw[k:])
            else:
                break
            i += k
        if i < len(text):
            self._same = False
            pending.clear()
            out.append(_escape(text[i:]))
