"""``gdpr-redact``: personal data out of prompts and replies, streaming-safe.

Finds e-mail addresses, phone numbers (``phonenumbers``: CN and international
formats), payment card numbers (Luhn-valid only, ``python-stdnum``), IBANs
(checksum-valid), PRC resident ID numbers (checksum-valid, ``python-stdnum``)
and IP addresses, and replaces each with a token (``[EMAIL]``, ``[PHONE]``,
``[CARD]``, ``[IBAN]``, ``[ID]``, ``[IP]``; configurable). A look-alike that
fails its checksum is left alone. Input: every message is rewritten before it
leaves for the backend. Output: the reply is rewritten in the stream by a
:class:`~.stream.RewriteStream`, so a number split across tokens is still caught.

Config (all optional)::

    [policies.gdpr-redact]
    detect = ["email", "phone", "card", "iban", "cn_id", "ip"]   # and their order
    region = "CN"            # phone numbers without a country code
    input = true
    output = true
    [policies.gdpr-redact.tokens]
    card = "[CARD]"

The matched values are never logged or stored: only the kind is counted.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import phonenumbers
import regex
from stdnum import iban, luhn
from stdnum.cn import ric

from ..core.decoding import field_error
from ..core.errors import PolicyViolation
from ..core.messages import decode_message
from ..core.slices import ITEM_UNITS, Steps, finish
from .base import (
    BuildContext,
    OutputFilter,
    Policy,
    PolicyContext,
    PolicyKind,
    PolicySettings,
    Table,
)
from .reach import Opaque, Walker, decoded_steps
from .stream import Rewriter, Rule, literal, make_rule

if TYPE_CHECKING:
    from ..adapters.base import Message

# Each pattern is bounded (so the held-back tail is) and anchored with
# lookarounds on ASCII classes, so that it starts only at the beginning of a run
# (linear scanning) and works next to CJK text ("电话13800138000"). They match
# the normalised text (:func:`.stream.normalize`): no ignorable characters, ASCII
# digits, folded widths, one space and one hyphen for every space and dash.
#: A character of an internationalised domain name: any but ASCII and the general
#: and CJK punctuation blocks (U+2000-206F, U+3000-303F).
_IDN = r"\u0080-\u1fff\u2070-\u2fff\u3040-\ufeff"
EMAIL = (
    r"(?<![A-Za-z0-9._%+\-])[A-Za-z0-9._%+\-]{1,256}@"
    rf"(?:[A-Za-z0-9\-{_IDN}]{{1,63}}\.){{1,4}}"
    rf"(?:[A-Za-z]{{2,24}}(?![A-Za-z0-9\-])|[A-Za-z0-9\-{_IDN}]{{2,24}}(?![A-Za-z0-9\-{_IDN}]))"
)
CN_ID = (
    r"(?<![0-9A-Za-z])[1-9][0-9]{5}(?:18|19|20)[0-9]{2}(?:0[1-9]|1[0-2])"
    r"(?:0[1-9]|[12][0-9]|3[01])[0-9]{3}[0-9Xx](?![0-9A-Za-z])"
)
#: What may separate the groups of a card number.
_SEP = r"(?:\r\n|[ \t\n\-./])"
CARD = (
    rf"(?<![0-9])(?:[0-9]{{4}}{_SEP}?[0-9]{{6}}{_SEP}?[0-9]{{5}}"
    rf"|[0-9]{{4}}(?:{_SEP}?[0-9]{{4}}){{2}}{_SEP}?[0-9]{{1,4}}(?:{_SEP}?[0-9]{{1,3}})?)(?![0-9])"
)
IBAN = (
    r"(?<![A-Za-z0-9])[A-Za-z]{2}[0-9]{2}(?:[ ]?[A-Za-z0-9]{4}){2,7}"
    r"(?:[ ]?[A-Za-z0-9]{1,3})?(?![A-Za-z0-9])"
)
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
IPV4 = rf"(?<![0-9.]){_OCTET}(?:\.{_OCTET}){{3}}(?![0-9]|\.[0-9])"
IPV6 = r"(?<![0-9A-Za-z:])[0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{0,4}){2,7}(?![0-9A-Za-z:])"
PHONE = r"(?<![0-9A-Za-z+])(?:\+|00)?[0-9(][0-9 ()\-./\t\r\n]{5,20}[0-9](?![0-9])"

DEFAULT_TOKENS = {
    "email": "[EMAIL]",
    "phone": "[PHONE]",
    "card": "[CARD]",
    "iban": "[IBAN]",
    "cn_id": "[ID]",
    "ip": "[IP]",
}
#: Order matters: the first kind accepted at a position wins (a numeric QQ
#: e-mail is an e-mail; an 18-digit ID is an ID even if it passes Luhn).
DEFAULT_DETECT = ("email", "cn_id", "card", "iban", "ip", "phone")
#: Top-level fields that are parameters, not data: their numbers are not personal data.
PARAMETERS = frozenset(
    {
        "temperature",
        "top_p",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "logprobs",
        "top_logprobs",
        "logit_bias",
        "parallel_tool_calls",
        "stream_options",
    }
)
_encoder = msgspec.json.Encoder()
_SEPARATORS = regex.compile(r"[ \t\r\n\-./]+")
_NON_DIGITS = regex.compile(r"[^0-9]")
#: A CN number dialled without a country code: a mobile, or a trunk 0 + area code.
_CN_LOCAL = regex.compile(r"1[3-9][0-9]{9}$|0[1-9][0-9]{8,10}$")
_CN_START = regex.compile(r"1[3-9][0-9]{9}|0[1-9][0-9]{8}")


def _prefixes(text: str) -> list[str]:
    """``text``, then ``text`` without its last separated group, and so on.

    A run of digits can carry a trailing group that is not part of the number
    ("card 4111 1111 1111 1111 2 times"); the longest valid prefix is the hit.
    """
    out = [text]
    cut = [m.start() for m in _SEPARATORS.finditer(text)]
    for at in reversed(cut):
        out.append(text[:at])
    return out


def _checked(token: str, valid: Callable[[str], bool]) -> Callable[[regex.Match[str]], str | None]:
    def replace(m: regex.Match[str]) -> str | None:
        text = m.group()
        for prefix in _prefixes(text):
            if valid(prefix):
                return token + text[len(prefix) :]
        return None

    return replace


def card_valid(text: str) -> bool:
    """A payment card number: 13-19 digits passing the Luhn check."""
    digits = _NON_DIGITS.sub("", text)
    return 13 <= len(digits) <= 19 and luhn.is_valid(digits)


def iban_valid(text: str) -> bool:
    """An IBAN with a valid checksum and country format."""
    return bool(iban.is_valid(text))


def cn_id_valid(text: str) -> bool:
    """A PRC resident identity number with a valid checksum and birth date."""
    return bool(ric.is_valid(text))


def _ip6(token: str) -> Callable[[regex.Match[str]], str | None]:
    def replace(m: regex.Match[str]) -> str | None:
        text = m.group()
        if sum(c.isalnum() for c in text) < 3:  # "::", "::1": not personal data
            return None
        try:
            ipaddress.IPv6Address(text)
        except ValueError:
            return None
        return token

    return replace


def _phone(token: str, region: str) -> Callable[[regex.Match[str]], str | None]:
    def replace(m: regex.Match[str]) -> str | None:
        text = m.group()
        # Every prefix's digits start as the whole's: one cheap check for all.
        local = region == "CN" and not text.startswith(("+", "00"))
        if local and not _CN_START.match(_NON_DIGITS.sub("", text)):
            return None
        # Two trailing groups at most: numbers are written in few groups, and
        # parsing is the slow part (bounded work per candidate keeps it linear).
        for prefix in _prefixes(text)[:3]:
            if phone_valid(prefix, region):
                return token + text[len(prefix) :]
        return None

    return replace


def phone_valid(text: str, region: str = "CN") -> bool:
    """A valid phone number (``phonenumbers``), international or of ``region``."""
    digits = _NON_DIGITS.sub("", text)
    international = text.startswith(("+", "00"))
    if not 7 <= len(digits) <= 17:
        return False
    if region == "CN" and not international and not _CN_LOCAL.match(digits):
        return False  # cheap pre-check: parsing is the slow part
    try:
        number = phonenumbers.parse(text, region)
    except phonenumbers.NumberParseException:
        return False
    return bool(phonenumbers.is_valid_number(number))


def build_rules(
    detect: tuple[str, ...] = DEFAULT_DETECT,
    tokens: Mapping[str, str] | None = None,
    region: str = "CN",
) -> list[Rule]:
    """The detection rules, in priority order.

    Raises:
        ValueError: an unknown kind in ``detect``.
    """
    tok = {**DEFAULT_TOKENS, **(tokens or {})}
    rules: list[Rule] = []
    for kind in detect:
        t = tok.get(kind, "")
        if kind == "email":
            rules.append(
                make_rule("email", EMAIL, literal(t), alphabet=rf"[A-Za-z0-9._%+\-@{_IDN}]")
            )
        elif kind == "cn_id":
            rules.append(make_rule("cn_id", CN_ID, _checked(t, cn_id_valid), alphabet="[0-9Xx]"))
        elif kind == "card":
            rules.append(
                make_rule("card", CARD, _checked(t, card_valid), alphabet=r"[0-9 \t\r\n\-./]")
            )
        elif kind == "iban":
            rules.append(make_rule("iban", IBAN, _checked(t, iban_valid), alphabet="[A-Za-z0-9 ]"))
        elif kind == "ip":
            rules.append(make_rule("ip", IPV4, literal(t), alphabet=r"[0-9.]"))
            rules.append(make_rule("ip", IPV6, _ip6(t), alphabet="[0-9A-Fa-f:]"))
        elif kind == "phone":
            rules.append(
                make_rule(
                    "phone",
                    PHONE,
                    _phone(t, region),
                    alphabet=r"[0-9 ()\-+./\t\r\n]",
                    skip_rejected=True,
                )
            )
        else:
            raise ValueError(f"unknown kind {kind!r} (known: {', '.join(DEFAULT_DETECT)})")
    return rules


class GdprRedact(Policy):
    """Redacts personal data in the request (input) and in the reply (output).

    On input it reaches every string that goes upstream (:mod:`.reach`): each
    message's every field, key and number, URLs in their path and query, and
    the request's other top-level fields (``user``, ``metadata``, ``tools``...).
    A message's text parts are read as one text (a value split across two is
    found; its replacement goes to the part it starts in).
    """

    def __init__(
        self,
        rewriter: Rewriter,
        *,
        on_input: bool = True,
        on_output: bool = True,
        refuse_opaque: bool = False,
    ):
        self.rewriter = rewriter
        self.on_input = on_input
        self.on_output = on_output
        self.refuse_opaque = refuse_opaque

    def check_input(self, messages: list[Message], ctx: PolicyContext) -> list[Message]:
        return finish(self.input_steps(messages, ctx))

    def _walker(self, ctx: PolicyContext) -> Walker:
        hit = lambda _kind: ctx.record(self.name, "redacted")  # noqa: E731
        return Walker(
            lambda text: self.rewriter.rewrite_steps(text, hit),
            refuse_opaque=self.refuse_opaque,
            rewrite_parts=lambda parts: self.rewriter.rewrite_parts_steps(parts, hit),
        )

    @staticmethod
    def _charged(walker: Walker, raw: bytes, items: int) -> bool:
        """Decoding or encoding ``raw`` of ``items`` parts, charged to the walk's meter
        (a byte of JSON costs ~1/400 of a rewritten character; a part, an item)."""
        return walker.meter.charge(len(raw) // 400 + items * ITEM_UNITS)

    def input_steps(self, messages: list[Message], ctx: PolicyContext) -> Steps[list[Message]]:
        if not self.on_input:
            return messages
        walker = self._walker(ctx)
        out = []
        for i, msg in enumerate(messages):
            raw = msg.to_raw()
            value = yield from decoded_steps(raw, f"messages[{i}]", walker.meter)
            parts = len(msg.content) if isinstance(msg.content, list) else 0
            new = yield from self._refusing(walker.value(value, f"messages[{i}]"))
            if new is value:
                out.append(msg)
                continue
            encoded = _encoder.encode(new)
            if self._charged(walker, encoded, 1 + parts):
                yield
            redone = decode_message(msgspec.Raw(encoded), i)
            if walker.meter.items(1 + parts):
                yield
            # A message the gateway made stays one (no client JSON to keep).
            out.append(redone if msg.raw is not None else msgspec.structs.replace(redone, raw=None))
        return out

    def fields_steps(
        self, fields: dict[str, msgspec.Raw], ctx: PolicyContext
    ) -> Steps[dict[str, msgspec.Raw]]:
        if not self.on_input:
            return fields
        walker = self._walker(ctx)
        out: dict[str, msgspec.Raw] = {}
        for key, raw in fields.items():
            if key in PARAMETERS:
                out[key] = raw
                continue
            value = yield from decoded_steps(raw, key, walker.meter)
            new_key = yield from walker.rewrite(key)
            new = yield from self._refusing(walker.value(value, key))
            if new is value:
                out[new_key] = raw
                continue
            out[new_key] = msgspec.Raw(_encoder.encode(new))
            if self._charged(walker, out[new_key], 1):
                yield
        return out

    def _refusing(self, steps: Steps[Any]) -> Steps[Any]:
        try:
            return (yield from steps)
        except Opaque as exc:
            raise PolicyViolation(
                f"`{exc.where}` holds data that {self.name} cannot scan for personal "
                "data (audio, a file, a data: URL); this route does not send it upstream",
                code="unscannable_content",
                param=exc.where,
            ) from None

    def output_filter(self, ctx: PolicyContext) -> OutputFilter | None:
        if not self.on_output:
            return None
        return self.rewriter.stream(lambda _kind: ctx.record(self.name, "redacted"))

    def redact_text(self, text: str, ctx: PolicyContext) -> str:
        # Whatever `input`/`output` say: data written to the session is stored data.
        return self.rewriter.rewrite(text, lambda _kind: ctx.record(self.name, "redacted"))


class Tokens(Table, frozen=True):
    """What each kind of personal data becomes (``[policies.gdpr-redact.tokens]``)."""

    email: str = DEFAULT_TOKENS["email"]
    phone: str = DEFAULT_TOKENS["phone"]
    card: str = DEFAULT_TOKENS["card"]
    iban: str = DEFAULT_TOKENS["iban"]
    cn_id: str = DEFAULT_TOKENS["cn_id"]
    ip: str = DEFAULT_TOKENS["ip"]


class RedactSettings(PolicySettings, frozen=True):
    """``[policies.gdpr-redact]`` (all optional)."""

    #: The kinds to find, in priority order.
    detect: tuple[str, ...] = DEFAULT_DETECT
    tokens: Tokens = msgspec.field(default_factory=Tokens)
    #: Region of phone numbers written without a country code.
    region: str = "CN"
    #: Redact the request's messages / the reply stream.
    input: bool = True
    output: bool = True
    #: What input that cannot be read as text (audio, files, ``data:`` URLs) gets:
    #: ``pass`` sends it as it is, ``refuse`` answers 403 naming the field.
    opaque: Literal["pass", "refuse"] = "pass"

    def __post_init__(self) -> None:
        for i, kind in enumerate(self.detect):
            if kind not in DEFAULT_TOKENS:
                known = ", ".join(DEFAULT_DETECT)
                raise field_error(f"detect[{i}]", f"unknown kind {kind!r} (known: {known})")
        if self.region not in phonenumbers.SUPPORTED_REGIONS:
            raise field_error("region", f"unknown region {self.region!r}")


def gdpr_redact(name: str, settings: RedactSettings, ctx: BuildContext) -> Policy:
    """Factory for ``gdpr-redact`` (and policies with ``kind = "gdpr-redact"``)."""
    rules = build_rules(settings.detect, msgspec.structs.asdict(settings.tokens), settings.region)
    return GdprRedact(
        Rewriter(rules),
        on_input=settings.input,
        on_output=settings.output,
        refuse_opaque=settings.opaque == "refuse",
    )


KINDS: dict[str, PolicyKind[Any]] = {"gdpr-redact": PolicyKind(gdpr_redact, RedactSettings)}


def redacted_sides(policies: Iterable[object]) -> tuple[bool, bool]:
    """Whether these (a route's) policies include a ``gdpr-redact`` that redacts the
    prompt, and one that redacts the reply: what the recorder and the audit log need
    not redact again with the default detectors."""
    on_input = on_output = False
    for p in policies:
        if isinstance(p, GdprRedact):
            on_input = on_input or p.on_input
            on_output = on_output or p.on_output
    return on_input, on_output
