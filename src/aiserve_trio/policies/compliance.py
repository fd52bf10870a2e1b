"""``compliance`` rule packs: rewrite regulated statements in the reply stream.

A pack (TOML, data not code) lists rules: a bounded regular expression and a
``replace`` template (``\\g<name>`` groups and ``{phrase}``, the pack's or the
config's phrase). The reply is rewritten by a :class:`~.stream.RewriteStream`,
so a figure split across tokens is still caught and only a bounded tail waits.

``no-rate-figures`` is the shipped pack: on regulated routes the reply must not
state an interest-rate figure (``3.85%``, ``年利率4.2%``, ``3.85 per cent``).
More packs are named policies of kind ``compliance``::

    [policies.no-guarantees]
    kind = "compliance"
    pack = "policies/no-guarantees.toml"   # relative to the config file
    phrase = "..."                         # optional
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import regex

from ..core.decoding import field_error
from .base import (
    BuildContext,
    OutputFilter,
    Policy,
    PolicyContext,
    PolicyKind,
    PolicySettings,
    Table,
    read_pack,
)
from .stream import Rewriter, Rule, literal, make_rule


def _template(replace: str, phrase: str) -> Callable[[regex.Match[str]], str]:
    escaped = phrase.replace("\\", "\\\\")
    template = replace.replace("{phrase}", escaped)
    return lambda m: m.expand(template)


_REF = regex.compile(r"\\g<([^>]*)>|\\([0-9]{1,2})")


def _check_refs(template: str, pattern: regex.Pattern[str]) -> None:
    """Every ``\\g<name>`` / ``\\N`` in ``template`` names a group of ``pattern``."""
    for m in _REF.finditer(template):
        ref = m.group(1) if m.group(1) is not None else m.group(2)
        known = ref in pattern.groupindex or (ref.isdigit() and int(ref) <= pattern.groups)
        if not known:
            raise ValueError(f"refers to group {ref!r}, which the pattern lacks")


class PackRule(Table, frozen=True):
    """One rule of a compliance pack (``[[rules]]``)."""

    id: str
    #: A bounded regular expression (``regex`` module syntax).
    pattern: str
    #: What a match becomes: ``\\g<name>`` / ``\\N`` groups, and ``{phrase}``.
    replace: str = "{phrase}"
    description: str = ""

    def __post_init__(self) -> None:
        try:
            rule = make_rule(self.id, self.pattern, literal(""))
        except ValueError as exc:
            raise field_error("pattern", str(exc)) from None
        try:
            _check_refs(self.replace, rule.pattern)
        except ValueError as exc:
            raise field_error("replace", str(exc)) from None


class CompliancePack(Table, frozen=True):
    """A compliance rule pack: the rules, tried in order, and the default phrase."""

    rules: list[PackRule]
    phrase: str = ""

    def __post_init__(self) -> None:
        if not self.rules:
            raise field_error("rules", "must be a non-empty array of tables")


def pack_rules(pack: CompliancePack, phrase: str | None = None) -> list[Rule]:
    """The rules of a (validated) compliance pack, in order.

    Args:
        phrase: replaces the pack's own ``phrase`` in the templates.
    """
    phrase = phrase if phrase is not None else pack.phrase
    return [make_rule(r.id, r.pattern, _template(r.replace, phrase)) for r in pack.rules]


class Compliance(Policy):
    """Rewrites what a rule pack forbids in the reply (output only)."""

    def __init__(self, rewriter: Rewriter) -> None:
        self.rewriter = rewriter

    def rewrite(self, text: str) -> str:
        """Rewrite a whole text (what the stream gives for any chunking)."""
        return self.rewriter.rewrite(text)

    def output_filter(self, ctx: PolicyContext) -> OutputFilter | None:
        # The rewrite stream is itself the filter; each hit is recorded.
        return self.rewriter.stream(lambda _rule: ctx.record(self.name, "rewritten"))


class ComplianceSettings(PolicySettings, frozen=True):
    """``[policies.NAME]`` with ``kind = "compliance"``: a pack is required."""

    #: A shipped pack's name, or a file (relative to the config).
    pack: str
    #: Replaces the pack's ``phrase``.
    phrase: str | None = None


class NoRateFiguresSettings(PolicySettings, frozen=True):
    """``[policies.no-rate-figures]``: the shipped pack unless ``pack`` names another."""

    pack: str = "no-rate-figures"
    phrase: str | None = None


def _build(name: str, pack_ref: str, phrase: str | None, ctx: BuildContext) -> Policy:
    pack, _ = read_pack(pack_ref, CompliancePack, policy=name, ctx=ctx)
    return Compliance(Rewriter(pack_rules(pack, phrase)))


def compliance(name: str, settings: ComplianceSettings, ctx: BuildContext) -> Policy:
    """Factory for ``kind = "compliance"`` policies.

    Raises:
        ConfigError: the pack cannot be read or is not valid.
    """
    return _build(name, settings.pack, settings.phrase, ctx)


def no_rate_figures(name: str, settings: NoRateFiguresSettings, ctx: BuildContext) -> Policy:
    """Factory for the shipped ``no-rate-figures`` pack (``pack``/``phrase`` override).

    Raises:
        ConfigError: the pack cannot be read or is not valid.
    """
    return _build(name, settings.pack, settings.phrase, ctx)


KINDS: dict[str, PolicyKind[Any]] = {
    "compliance": PolicyKind(compliance, ComplianceSettings),
    "no-rate-figures": PolicyKind(no_rate_figures, NoRateFiguresSettings),
}
