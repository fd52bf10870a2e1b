"""A text rewrite carried into every string of a request (pure, in slices).

``gdpr-redact`` promises that personal data does not leave for the model, so it
must see every string that goes upstream, not only the message text:

- every string value at any depth, and every object key (``{"jane@x.org": 1}``);
- the text parts of one content list (``[{"type": "text", "text": ...}, ...]``)
  read as one text, so that a value split across two parts is found (its
  replacement goes to the part it starts in), when the walker has a parts rewrite;
- every number, by its decimal text (``"card": 4111111111111111``): one that the
  rewrite changes becomes the rewritten *string*;
- a JSON text inside a string (a tool call's ``arguments``) decoded first, so
  escapes (``\\u0040``) cannot hide anything, and re-encoded valid;
- a URL (``http``/``https``) rewritten in its path segments, its query's names
  and values and its fragment, each percent-decoded first, and in its host only
  where that is personal data itself (an IP address); the scheme stays;
- *opaque* payloads -- a ``data:`` URL, ``input_audio.data``, a file's
  ``file_data`` -- cannot be read as text: passed as they are, or refused naming
  the field (:class:`Opaque`), as the policy's ``opaque`` setting says.

Everything is a :data:`~aiserve_trio.core.slices.Steps` generator: the rewrite of a
long string yields between slices, and the walk itself yields by the work it has
done (a :class:`~aiserve_trio.core.slices.Meter` charged per string, key, number and
element visited and per character rewritten), so a value of a hundred thousand
one-character strings yields as often as one long string does (issue 51).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import msgspec

from ..core.errors import BadRequest
from ..core.slices import ITEM_UNITS, Meter, Steps

#: Rewrites one text in steps (the policy's rewriter).
StepRewrite = Callable[[str], Steps[str]]
#: Rewrites texts read as one, in steps: one result per text.
PartsRewrite = Callable[[list[str]], Steps[list[str]]]
#: Fields holding binary data as base64, per content part type.
OPAQUE_FIELDS = {"input_audio": ("data",), "file": ("file_data",)}
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def decoded(raw: bytes, where: str) -> Any:
    """The JSON value of ``raw`` (already known to be JSON: the parse stage checked).

    Raises:
        BadRequest: ``invalid_json`` -- an integer longer than Python converts
            (``sys.get_int_max_str_digits()``), naming the limit and ``where``.
    """
    try:
        return _decode(raw)
    except msgspec.ValidationError:  # the only one an untyped decode raises
        limit = sys.get_int_max_str_digits()
        raise BadRequest(
            f"`{where}` holds an integer with more than {limit} digits, the limit",
            param=where,
            code="invalid_json",
        ) from None


#: A JSON text longer than this is decoded a level at a time (:func:`decoded_steps`).
DECODE_PIECE = 65_536
#: Bytes of JSON decoded per work unit (a decode costs ~1-5 ns a byte, a unit ~5 us).
DECODE_BYTES_PER_UNIT = 64
_raw_object = msgspec.json.Decoder(dict[str, msgspec.Raw])
_raw_array = msgspec.json.Decoder(list[msgspec.Raw])


def decoded_steps(raw: bytes, where: str, meter: Meter) -> Steps[Any]:
    """:func:`decoded` in steps: a long JSON text a container level at a time.

    A decode is one call that cannot yield: a tool's schema of 24,000 properties
    (700 KB, within every limit) took 34 ms in one piece. Split, each call builds
    one level's raw pieces (no values: ~0.1 us each) or a piece of 64 KB at most,
    and the meter is charged for its bytes.

    Raises:
        BadRequest: as :func:`decoded`.
    """
    if len(raw) <= DECODE_PIECE or bytes(memoryview(raw)[:1]) not in (b"{", b"["):
        value = decoded(raw, where)
        if meter.charge(ITEM_UNITS + len(raw) // DECODE_BYTES_PER_UNIT):  # a call, its bytes
            yield
        return value
    if bytes(memoryview(raw)[:1]) == b"{":
        pieces = _raw_object.decode(raw)
        if meter.items(len(pieces)):
            yield
        out: dict[str, Any] = {}
        for key, piece in pieces.items():
            out[key] = yield from decoded_steps(piece, f"{where}.{key}", meter)
        return out
    items = _raw_array.decode(raw)
    if meter.items(len(items)):
        yield
    values = []
    for i, piece in enumerate(items):
        values.append((yield from decoded_steps(piece, f"{where}[{i}]", meter)))
    return values


class Opaque(Exception):
    """A field holds data that cannot be scanned as text (its path is ``args[0]``)."""

    def __init__(self, where: str) -> None:
        super().__init__(where)
        self.where = where


class Walker:
    """Carries ``rewrite`` into JSON values (see the module docstring).

    Args:
        rewrite: the text rewrite, in steps.
        refuse_opaque: raise :class:`Opaque` on an opaque payload instead of passing it.
        meter: what the walk charges its work to (shared with the caller's other
            walks of the same request, so their steps are bounded together).
        rewrite_parts: rewrites the text parts of a content list as one text
            (without it, each part is rewritten alone).
    """

    def __init__(
        self,
        rewrite: StepRewrite,
        *,
        refuse_opaque: bool = False,
        meter: Meter | None = None,
        rewrite_parts: PartsRewrite | None = None,
    ) -> None:
        self._rewrite = rewrite
        self._rewrite_parts = rewrite_parts
        self.refuse_opaque = refuse_opaque
        self.meter = meter if meter is not None else Meter()

    def rewrite(self, text: str) -> Steps[str]:
        """``text`` rewritten, charged to the meter: an item and its characters
        (a long text's rewrite yields inside too, by its own slices)."""
        new = yield from self._rewrite(text)
        if self.meter.charge(ITEM_UNITS + len(text)):
            yield
        return new

    def visit(self) -> Steps[None]:
        """One item visited that needs no rewrite (``null``, a boolean, an opaque field)."""
        if self.meter.charge():
            yield

    def value(self, v: Any, where: str) -> Steps[Any]:
        """``v`` with every string, key and number rewritten (the same object if unchanged)."""
        if isinstance(v, str):
            return (yield from self.string(v, where))
        if isinstance(v, bool) or v is None:
            yield from self.visit()
            return v
        if isinstance(v, int | float):
            text = repr(v) if isinstance(v, float) else str(v)
            new = yield from self.rewrite(text)
            return v if new == text else new
        if isinstance(v, list):
            joint = yield from self.text_parts(v)
            items = []
            changed = False
            for i, x in enumerate(v):
                if i in joint:
                    y = yield from self.text_part(x, joint[i], f"{where}[{i}]")
                else:
                    y = yield from self.value(x, f"{where}[{i}]")
                changed = changed or y is not x
                items.append(y)
            return items if changed else v
        if isinstance(v, dict):
            return (yield from self.object(v, where))
        yield from self.visit()
        return v

    def text_parts(self, v: list[Any]) -> Steps[dict[int, str]]:
        """The text parts of ``v`` (two or more) rewritten as one: index -> new text."""
        if self._rewrite_parts is None:
            return {}
        at = [
            i
            for i, x in enumerate(v)
            if isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str)
        ]
        if len(at) < 2:
            return {}
        texts = [v[i]["text"] for i in at]
        new = yield from self._rewrite_parts(texts)
        if self.meter.charge(ITEM_UNITS * len(at) + sum(map(len, texts))):
            yield
        return dict(zip(at, new, strict=True))

    def text_part(self, part: dict[str, Any], text: str, where: str) -> Steps[dict[str, Any]]:
        """A text part whose text is rewritten already: its other fields walked."""
        rest = {k: x for k, x in part.items() if k != "text"}
        new = yield from self.object(rest, where)
        if new is rest and text == part["text"]:
            return part
        out: dict[str, Any] = {}
        for k, x in new.items():
            out[k] = x
            if k == "type":
                out["text"] = text
        out.setdefault("text", text)
        return out

    def object(self, obj: dict[str, Any], where: str) -> Steps[dict[str, Any]]:
        kind = obj.get("type")
        opaque = OPAQUE_FIELDS.get(kind, ()) if isinstance(kind, str) else ()
        out: dict[str, Any] = {}
        changed = False
        for key, x in obj.items():
            at = f"{where}.{key}" if where else key
            new_key = yield from self.rewrite(key)
            if opaque and key == kind and isinstance(x, dict):  # {"type": "file", "file": {...}}
                y = yield from self.opaque_object(x, opaque, at)
            elif key == "arguments" and isinstance(x, str):
                y = yield from self.json_text(x, at)
            else:
                y = yield from self.value(x, at)
            changed = changed or y is not x or new_key != key
            out[new_key] = y
        return out if changed else obj

    def opaque_object(self, obj: dict[str, Any], fields: tuple[str, ...], where: str) -> Steps[Any]:
        """A part's payload object (``input_audio``): its binary fields are opaque."""
        out: dict[str, Any] = {}
        changed = False
        for key, x in obj.items():
            at = f"{where}.{key}"
            if key in fields and isinstance(x, str):
                if self.refuse_opaque:
                    raise Opaque(at)
                yield from self.visit()
                y = x
            else:
                y = yield from self.value(x, at)
            changed = changed or y is not x
            out[key] = y
        return out if changed else obj

    def string(self, s: str, where: str) -> Steps[str]:
        head = s[:8].lower()
        if head.startswith("data:"):
            if self.refuse_opaque:
                raise Opaque(where)
            yield from self.visit()
            return s
        if head.startswith(("http://", "https://")) and not any(c.isspace() for c in s):
            new = yield from self.url(s)
        else:
            new = yield from self.rewrite(s)
        return s if new == s else new  # the same object: callers compare by identity

    def json_text(self, text: str, where: str) -> Steps[str]:
        """A JSON text in a string: its values rewritten, still valid JSON; else plain text."""
        try:
            value = _decode(text)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return (yield from self.rewrite(text))
        new = yield from self.value(value, where)
        return text if new is value else _encode(new).decode()

    def url(self, url: str) -> Steps[str]:
        """``url`` with its host, path segments, query and fragment rewritten
        (the last three percent-decoded)."""
        try:
            parts = urlsplit(url)
        except ValueError:
            return (yield from self.rewrite(url))
        # The host stays a host unless it is personal data itself (an IP address,
        # an e-mail address as user info).
        netloc = yield from self.rewrite(parts.netloc)
        changed = netloc != parts.netloc
        segments = []
        for seg in parts.path.split("/"):
            plain = unquote(seg)
            new = yield from self.rewrite(plain)
            if new != plain:
                seg, changed = quote(new, safe=""), True
            segments.append(seg)
        query = parts.query
        if query:
            pairs = []
            q_changed = False
            for k, v in parse_qsl(query, keep_blank_values=True):
                nk = yield from self.rewrite(k)
                nv = yield from self.rewrite(v)
                q_changed = q_changed or nk != k or nv != v
                pairs.append((nk, nv))
            if q_changed:
                query, changed = urlencode(pairs, quote_via=quote), True
        fragment = parts.fragment
        if fragment:
            plain = unquote(fragment)
            new = yield from self.rewrite(plain)
            if new != plain:
                fragment, changed = quote(new, safe=""), True
        if not changed:
            return url
        return urlunsplit((parts.scheme, netloc, "/".join(segments), query, fragment))
