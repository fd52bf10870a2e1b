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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, PolicyViolation
from .base import Policy, PolicyContext, check_settings, read_pack, register, setting
from .stream import ZERO_WIDTH

if TYPE_CHECKING:
    from ..adapters.base import Message
    from ..config import Config

DEFAULT_PACK = "anti-fraud-v2"
_DROP = {ord(c): None for c in ZERO_WIDTH}
_SPACES = re.compile(r"\s+")


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
        folded = normalize(text)
        hit = [r for r in self.rules if any(p.search(folded) for p in r.patterns)]
        return Score(round(sum(r.weight for r in hit), 6), tuple(r.id for r in hit))


def parse_pack(table: Mapping[str, Any], source: str) -> tuple[FraudScorer, float, float, str]:
    """Decode a rule pack: ``(scorer, flag_threshold, block_threshold, scope)``.

    Raises:
        ValueError: naming the key that is wrong.
    """
    flag = table.get("flag_threshold", 0.5)
    block = table.get("block_threshold", 1.0)
    scope = table.get("scope", "last_user")
    if not isinstance(flag, int | float) or not isinstance(block, int | float):
        raise ValueError(f"{source}: `flag_threshold` and `block_threshold` must be numbers")
    if not 0 < flag <= block:
        raise ValueError(f"{source}: need 0 < flag_threshold <= block_threshold")
    if scope not in ("last_user", "all_user"):
        raise ValueError(f"{source}: `scope` must be 'last_user' or 'all_user'")
    raw = table.get("rules")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{source}: `rules` must be a non-empty array of tables")
    rules: list[FraudRule] = []
    for i, r in enumerate(raw):
        key = f"rules[{i}]"
        if not isinstance(r, dict) or set(r) - {"id", "weight", "patterns", "description"}:
            raise ValueError(f"{source}: `{key}` must have id, weight and patterns only")
        pats = r.get("patterns")
        if not isinstance(r.get("id"), str) or not isinstance(r.get("weight"), int | float):
            raise ValueError(f"{source}: `{key}` needs a string id and a numeric weight")
        if not isinstance(pats, list) or not pats or not all(isinstance(p, str) for p in pats):
            raise ValueError(f"{source}: `{key}.patterns` must be a list of strings")
        try:
            compiled = tuple(re.compile(p, re.IGNORECASE) for p in pats)
        except re.error as exc:
            raise ValueError(
                f"{source}: `{key}.patterns`: not a regular expression: {exc}"
            ) from exc
        rules.append(FraudRule(r["id"], float(r["weight"]), compiled))
    return FraudScorer(rules), float(flag), float(block), scope


class AntiFraud(Policy):
    """Blocks or flags requests by fraud score."""

    def __init__(self, scorer: FraudScorer, flag: float, block: float, scope: str) -> None:
        self.scorer = scorer
        self.flag = flag
        self.block = block
        self.scope = scope

    def _text(self, messages: list[Message]) -> str:
        users = [m.content for m in messages if m.role == "user"]
        if self.scope == "last_user":
            return users[-1] if users else ""
        return "\n".join(users)

    def check_input(self, messages: list[Message], ctx: PolicyContext) -> list[Message]:
        """Score the request.

        Raises:
            PolicyViolation: the score reached ``block_threshold`` (403, code = policy name).
        """
        score = self.scorer.score(self._text(messages))
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


@register("anti-fraud-v2")
def anti_fraud(name: str, settings: Mapping[str, Any], cfg: Config) -> Policy:
    """Factory for ``anti-fraud-v2``: ``pack`` (name or file), threshold overrides.

    Raises:
        ConfigError: unknown keys, an unreadable pack, or a bad rule in it.
    """
    check_settings(name, settings, {"pack", "flag_threshold", "block_threshold", "scope"}, cfg)
    table, source = read_pack(setting(name, settings, "pack", str, DEFAULT_PACK), cfg)
    for key in ("flag_threshold", "block_threshold", "scope"):
        if key in settings:
            table[key] = settings[key]
    try:
        scorer, flag, block, scope = parse_pack(table, source)
    except ValueError as exc:
        raise ConfigError(f"{cfg.source}: policy {name!r}: {exc}") from None
    return AntiFraud(scorer, flag, block, scope)
