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

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import regex

from ..errors import ConfigError
from .base import OutputFilter, Policy, PolicyContext, check_settings, read_pack, register, setting
from .stream import Rewriter, Rule, make_rule

if TYPE_CHECKING:
    from ..config import Config


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
            raise ValueError(f"`replace` refers to group {ref!r}, which the pattern lacks")


def parse_pack(table: Mapping[str, Any], source: str, phrase: str | None = None) -> list[Rule]:
    """The rules of a compliance pack, in order.

    Raises:
        ValueError: naming the key that is wrong (including unbounded patterns).
    """
    phrase = phrase if phrase is not None else table.get("phrase", "")
    if not isinstance(phrase, str):
        raise ValueError(f"{source}: `phrase` must be a string")
    raw = table.get("rules")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{source}: `rules` must be a non-empty array of tables")
    rules: list[Rule] = []
    for i, r in enumerate(raw):
        key = f"rules[{i}]"
        if not isinstance(r, dict) or set(r) - {"id", "pattern", "replace", "description"}:
            raise ValueError(f"{source}: `{key}` may have id, pattern, replace, description only")
        rid, pattern = r.get("id"), r.get("pattern")
        replace = r.get("replace", "{phrase}")
        if not (isinstance(rid, str) and isinstance(pattern, str) and isinstance(replace, str)):
            raise ValueError(f"{source}: `{key}` needs string id, pattern and replace")
        try:
            rule = make_rule(rid, pattern, _template(replace, phrase))
            _check_refs(replace, regex.compile(pattern))
        except (ValueError, regex.error) as exc:
            raise ValueError(f"{source}: `{key}.pattern`: {exc}") from exc
        rules.append(rule)
    return rules


class _Filter:
    __slots__ = ("_stream", "max_holdback")

    def __init__(self, rewriter: Rewriter, policy: str, ctx: PolicyContext) -> None:
        self._stream = rewriter.stream(lambda _rule: ctx.record(policy, "rewritten"))
        self.max_holdback = rewriter.max_holdback

    def feed(self, text: str) -> str:
        return self._stream.feed(text)

    def finish(self) -> str:
        return self._stream.finish()


class Compliance(Policy):
    """Rewrites what a rule pack forbids in the reply (output only)."""

    def __init__(self, rewriter: Rewriter) -> None:
        self.rewriter = rewriter

    def rewrite(self, text: str) -> str:
        """Rewrite a whole text (what the stream gives for any chunking)."""
        return self.rewriter.rewrite(text)

    def output_filter(self, ctx: PolicyContext) -> OutputFilter | None:
        return _Filter(self.rewriter, self.name, ctx)


def _build(name: str, settings: Mapping[str, Any], cfg: Config, default_pack: str | None) -> Policy:
    check_settings(name, settings, {"pack", "phrase"}, cfg)
    pack = setting(name, settings, "pack", str, default_pack or "")
    if not pack:
        raise ConfigError(f"{cfg.source}: key `policies.{name}.pack`: a compliance pack is needed")
    table, source = read_pack(pack, cfg)
    phrase = setting(name, settings, "phrase", str, None) if "phrase" in settings else None
    try:
        return Compliance(Rewriter(parse_pack(table, source, phrase)))
    except ValueError as exc:
        raise ConfigError(f"{cfg.source}: policy {name!r}: {exc}") from None


@register("compliance")
def compliance(name: str, settings: Mapping[str, Any], cfg: Config) -> Policy:
    """Factory for ``kind = "compliance"`` policies (``pack`` is required).

    Raises:
        ConfigError: unknown keys, a missing or bad pack.
    """
    return _build(name, settings, cfg, None)


@register("no-rate-figures")
def no_rate_figures(name: str, settings: Mapping[str, Any], cfg: Config) -> Policy:
    """Factory for the shipped ``no-rate-figures`` pack (``pack``/``phrase`` override).

    Raises:
        ConfigError: unknown keys or a bad pack.
    """
    return _build(name, settings, cfg, "no-rate-figures")
