"""Policy kinds by name, the ``[policies.NAME]`` tables decoded, and routes' policies built.

Kinds are the built-in ones (each policy module lists its own in ``KINDS``) and
third-party ones: entry points in the ``aiserve_trio.policies`` group whose
object is a :class:`~.base.PolicyKind`. A built-in kind wins over an entry
point of the same name.

A ``[policies.NAME]`` table gives settings to the policy NAME; with
``kind = "OTHER"`` it defines a new name built by OTHER's factory (e.g. a
second compliance rule pack). The config loader decodes every table into a
:class:`~.base.PolicySpec` (:func:`decode_policies`) and builds each policy a
route names once (:func:`build_policies`), so a bad setting or rule pack stops
the load, naming the key.

The config imports this module; this module does not import the config, not
even for type checking: building a policy takes the decoded specs and a
:class:`~.base.BuildContext` (what a policy needs from the config), which the
config makes (``config.build_policies``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from importlib.metadata import entry_points
from typing import Any

from ..core.decoding import convert
from ..core.errors import ConfigError
from . import antifraud, channel, compliance, redact
from .base import BuildContext, Policy, PolicyKind, PolicySpec

ENTRY_POINT_GROUP = "aiserve_trio.policies"

#: The built-in kinds.
BUILTIN: Mapping[str, PolicyKind[Any]] = {
    **redact.KINDS,
    **antifraud.KINDS,
    **compliance.KINDS,
    **channel.KINDS,
}


def policy_kinds() -> dict[str, PolicyKind[Any]]:
    """Every policy kind: the built-in ones, then those of installed entry points.

    Raises:
        ConfigError: an entry point's object is not a PolicyKind.
    """
    kinds = dict(BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in kinds:
            continue
        kind = ep.load()
        if not isinstance(kind, PolicyKind):
            raise ConfigError(
                f"entry point {ep.name!r} ({ep.value}) of group {ENTRY_POINT_GROUP!r} "
                f"is not a PolicyKind but {type(kind).__name__}"
            )
        kinds[ep.name] = kind
    return kinds


def decode_policies(
    tables: Mapping[str, Mapping[str, Any]], *, source: str, names: Iterable[str] = ()
) -> dict[str, PolicySpec]:
    """Decode ``[policies.NAME]`` tables into specs, one per table.

    Args:
        tables: the raw tables, by name (``kind`` optional in each).
        source: the config file, for messages.
        names: more policy names (e.g. those routes use): each that is a kind
            and has no table gets a spec with its kind's default settings.

    Raises:
        ConfigError: an unknown kind, or settings its kind does not accept,
            naming ``source`` and the key (``policies.NAME.key``).
    """
    kinds = policy_kinds()
    specs = {name: _decode(name, table, kinds, source) for name, table in tables.items()}
    for name in names:
        if name not in specs and name in kinds:
            specs[name] = _decode(name, {}, kinds, source)
    return specs


def _decode(
    name: str, table: Mapping[str, Any], kinds: Mapping[str, PolicyKind[Any]], source: str
) -> PolicySpec:
    key = f"policies.{name}"
    kind = convert(table.get("kind", name), str, source=source, key=f"{key}.kind")
    if kind not in kinds:
        known = ", ".join(sorted(kinds))
        if "kind" in table:
            raise ConfigError(f"{source}: key `{key}.kind`: unknown kind {kind!r} (known: {known})")
        why = f"{name!r} is not a policy kind; say which with `kind` (known: {known})"
        raise ConfigError(f"{source}: key `{key}`: {why}")
    settings = {k: v for k, v in table.items() if k != "kind"}
    decoded = kinds[kind].settings.from_table(settings, source=source, key=key)
    return PolicySpec(name=name, kind=kind, settings=decoded)


def known_policies(specs: Mapping[str, PolicySpec]) -> set[str]:
    """Every policy name a route may use: the kinds and the configured names (``specs``)."""
    return set(policy_kinds()) | set(specs)


def build_policies(
    names: list[str], specs: Mapping[str, PolicySpec], ctx: BuildContext
) -> list[Policy]:
    """Build the policies a route names, in order.

    A name without a decoded spec in ``specs`` (not configured, not used by a
    route) is built with its kind's default settings.

    Raises:
        ConfigError: a name that is not a known policy, or a policy whose
            settings or rule pack are not valid (naming the key).
    """
    kinds = policy_kinds()
    built: list[Policy] = []
    for name in names:
        spec = specs.get(name)
        if spec is None:
            if name not in kinds:
                known = ", ".join(sorted(known_policies(specs)))
                raise ConfigError(f"{ctx.source}: unknown policy {name!r} (known: {known})")
            spec = _decode(name, {}, kinds, ctx.source)
        policy = kinds[spec.kind].factory(name, spec.settings, ctx)
        policy.name = name
        built.append(policy)
    return built
