"""``anti-fraud-v2``: score a request against weighted fraud signals; flag or block.

The rules are data: a TOML rule pack (shipped as ``packs/anti-fraud-v2.toml``,
also ``configs/policies/``; point ``pack`` at another file to replace it). Each
rule has an id, a weight and patterns (English and Chinese): requests for
one-time passcodes or card PINs, "safe account" transfers, impersonation of bank
staff or police, urgency pressure. The score is the sum of the weights of the
rules that match. At or above ``block_threshold``: 403 ``policy_violation``
with the policy's name as ``code``, and the backend is never called. At or above
``flag_threshold``: served, with the score in ``ctx.flags`` (written to the
session turn) and a ``flagged`` action in the metrics.

:class:`FraudScorer` is pure: text in, :class:`Score` out.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ..core.decoding import field_error
from ..core.errors import ConfigError, PolicyViolation
from ..core.slices import CHARS_PER_STEP, Steps, finish
from .base import BuildContext, Policy, PolicyContext, PolicyKind, PolicySettings, Table, read_pack
from .stream import ZERO_WIDTH

if TYPE_CHECKING:
    from ..adapters.base import Message

DEFAULT_PACK = "anti-fraud-v2"
_DROP = {ord(c): None for c in ZERO_WIDTH}
_SPACES = re.compile(r"\s+")
#: Long text is scored in slices that overlap by this many characters: a phrase
#: this long or shorter is seen whole in some slice, wherever the cuts fall.
OVERLAP = 512


def normalize(text: str) -> str:
    """Fold text for matching: NFKC (full-width to ASCII), no zero-width chars, one space."""
    text = unicodedata.normalize("NFKC", text.translate(_DROP))
    return _SPACES.sub(" ", text).casefold()


@dataclass(frozen=True, slots=True)
class FraudRule:
    id: str
    weight: float
    patterns: tuple[re.Pattern[str], ...]


@dataclass(frozen=True, slots=True)
class Score:
    value: float
    rules: tuple[str, ...]


class FraudScorer:
    """Weighted rules over normalised text."""

    def __init__(self, rules: list[FraudRule]) -> None:
        self.rules = rules

    def score(self, text: str) -> Score:
        return finish(self.score_steps(text))

    def score_steps(self, text: str) -> Steps[Score]:
        """:meth:`score` in steps: overlapping slices of the text (:data:`OVERLAP`)."""
        found: set[int] = set()
        step = CHARS_PER_STEP * 4  # regex searches cost far less per char than redaction
        for lo in range(0, max(len(text), 1), step):
            folded = normalize(text[max(lo - OVERLAP, 0) : lo + step])
            for i, r in enumerate(self.rules):
                if i not in found and any(p.search(folded) for p in r.patterns):
                    found.add(i)
            if lo + step < len(text):
                yield
        hit = [r for i, r in enumerate(self.rules) if i in found]
        return Score(round(sum(r.weight for r in hit), 6), tuple(r.id for r in hit))


class PackRule(Table, frozen=True):
    """One rule of an anti-fraud pack (``[[rules]]``)."""

    id: str
    #: Added to the score when any pattern matches (once per rule).
    weight: float
    #: Python regular expressions, matched case-insensitively on normalised text.
    patterns: list[str]
    description: str = ""

    def __post_init__(self) -> None:
        if not self.patterns:
            raise field_error("patterns", "must be a non-empty list of strings")
        for j, pattern in enumerate(self.patterns):
            try:
                re.compile(pattern, re.IGNORECASE)
            except re.error as exc:
                raise field_error(f"patterns[{j}]", f"not a regular expression: {exc}") from None


class FraudPack(Table, frozen=True):
    """An anti-fraud rule pack: weighted rules and what a score leads to."""

    rules: list[PackRule]
    flag_threshold: float = 0.5
    block_threshold: float = 1.0
    #: ``last_user``: the newest user message; ``all_user``: every user message sent.
    scope: Literal["last_user", "all_user"] = "last_user"

    def __post_init__(self) -> None:
        if not self.rules:
            raise field_error("rules", "must be a non-empty array of tables")


def pack_scorer(pack: FraudPack) -> FraudScorer:
    """The scorer of a (validated) pack's rules."""
    return FraudScorer(
        [
            FraudRule(r.id, r.weight, tuple(re.compile(p, re.IGNORECASE) for p in r.patterns))
            for r in pack.rules
        ]
    )


class AntiFraud(Policy):
    """Blocks or flags requests by fraud score."""

    def __init__(self, scorer: FraudScorer, flag: float, block: float, scope: str) -> None:
        self.scorer = scorer
        self.flag = flag
        self.block = block
        self.scope = scope

    def _text(self, messages: list[Message]) -> str:
        # What people and tools said: tool results can carry a scammer's words too.
        users = [m.text() for m in messages if m.role in ("user", "tool")]
        if self.scope == "last_user":
            return users[-1] if users else ""
        return "\n".join(users)

    def check_input(self, messages: list[Message], ctx: PolicyContext) -> list[Message]:
        """Score the request.

        Raises:
            PolicyViolation: the score reached ``block_threshold`` (403, code = policy name).
        """
        return finish(self.input_steps(messages, ctx))

    def input_steps(self, messages: list[Message], ctx: PolicyContext) -> Steps[list[Message]]:
        score = yield from self.scorer.score_steps(self._text(messages))
        if score.value >= self.block:
            ctx.record(self.name, "blocked")
            ctx.flags[self.name] = f"blocked score={score.value:g} rules={','.join(score.rules)}"
            raise PolicyViolation(
                "the request was refused by the gateway's fraud protection "
                f"(policy {self.name}); if you are being asked for codes or transfers, "
                "please call your bank on its official number",
                code=self.name,
                param="messages",
            )
        if score.value >= self.flag:
            ctx.record(self.name, "flagged")
            ctx.flags[self.name] = f"flagged score={score.value:g} rules={','.join(score.rules)}"
        return messages


class AntiFraudSettings(PolicySettings, frozen=True):
    """``[policies.anti-fraud-v2]``: the pack, and overrides of its thresholds and scope."""

    #: A shipped pack's name, or a file (relative to the config).
    pack: str = DEFAULT_PACK
    flag_threshold: float | None = None
    block_threshold: float | None = None
    scope: Literal["last_user", "all_user"] | None = None


def anti_fraud(name: str, settings: AntiFraudSettings, ctx: BuildContext) -> Policy:
    """Factory for ``anti-fraud-v2``: the pack's rules, thresholds overridden by ``settings``.

    Raises:
        ConfigError: the pack cannot be read or is not valid, or the thresholds
            are not ``0 < flag_threshold <= block_threshold``.
    """
    pack, where = read_pack(settings.pack, FraudPack, policy=name, ctx=ctx)
    flag = pack.flag_threshold if settings.flag_threshold is None else settings.flag_threshold
    block = pack.block_threshold if settings.block_threshold is None else settings.block_threshold
    if not 0 < flag <= block:
        # Name where the thresholds were set: this policy's table, or the pack.
        set_here = settings.flag_threshold is not None or settings.block_threshold is not None
        at = f"key `policies.{name}`" if set_here else f"policy {name!r}: rule pack {where}"
        why = f"need 0 < flag_threshold <= block_threshold, got {flag:g} and {block:g}"
        raise ConfigError(f"{ctx.source}: {at}: {why}")
    return AntiFraud(pack_scorer(pack), flag, block, settings.scope or pack.scope)


KINDS: dict[str, PolicyKind[Any]] = {"anti-fraud-v2": PolicyKind(anti_fraud, AntiFraudSettings)}
