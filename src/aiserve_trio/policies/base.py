"""The policy framework: named input checks and streaming output filters.

A route lists policy names in TOML (``policies = ["anti-fraud-v2", "gdpr-redact"]``);
they run in that order. Each name resolves to a :class:`Policy` built once at
start-up by a registered factory:

- built-in policies register themselves in :data:`REGISTRY` when their module
  is imported (see :func:`builtin_modules`);
- third-party ones are found through the ``aiserve_trio.policies`` entry point
  group (the entry point's object is a factory);
- ``[policies.NAME]`` tables in the config give settings to a policy, and with
  ``kind = "OTHER"`` define a new name built by OTHER's factory (e.g. a second
  compliance rule pack).

Input policies see the whole request and return the (possibly rewritten)
messages or raise :class:`~aiserve_trio.errors.PolicyViolation`. Output
policies give, per request, an :class:`OutputFilter`: a sans-IO state machine
over the reply text that may hold back a bounded tail.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec

from ..decoding import decode_toml
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..adapters.base import Message
    from ..config import Config

ENTRY_POINT_GROUP = "aiserve_trio.policies"
#: The ``action`` label values of ``policy_actions_total``.
ACTIONS = ("redacted", "blocked", "flagged", "rewritten")


@dataclass(slots=True)
class PolicyContext:
    """What a policy knows about the request besides its text."""

    route: str
    channel: str
    tenant: str
    request_id: str
    #: Notes a policy wants recorded (e.g. a fraud score that flagged the request).
    flags: dict[str, str] = field(default_factory=dict)
    #: ``(policy name, action)`` pairs -- redacted, blocked, flagged, rewritten --
    #: counted into ``policy_actions_total`` when the request ends. Never the values.
    actions: list[tuple[str, str]] = field(default_factory=list)

    def record(self, policy: str, action: str) -> None:
        """Note that ``policy`` took ``action`` (one of :data:`ACTIONS`)."""
        self.actions.append((policy, action))


class OutputFilter(Protocol):
    """A streaming transformer over reply text (sans-IO).

    ``feed`` returns the text that is safe to emit now; ``finish`` returns the rest.
    The text held back between calls is bounded by :attr:`max_holdback` characters.
    """

    max_holdback: int

    def feed(self, text: str) -> str: ...

    def finish(self) -> str: ...


class Policy:
    """Base class: override one or both hooks."""

    name: str = ""

    def check_input(self, messages: list[Message], ctx: PolicyContext) -> list[Message]:
        """Return the messages to send on (rewritten or not), or raise PolicyViolation."""
        return messages

    def output_filter(self, ctx: PolicyContext) -> OutputFilter | None:
        """A fresh filter for one reply, or None if this policy does not touch output."""
        return None


PolicyFactory = Callable[[str, Mapping[str, Any], "Config"], Policy]

#: Policy kinds by name; built-in modules add theirs on import.
REGISTRY: dict[str, PolicyFactory] = {}


def register(name: str) -> Callable[[PolicyFactory], PolicyFactory]:
    """Decorator registering a policy factory under ``name``."""

    def deco(factory: PolicyFactory) -> PolicyFactory:
        REGISTRY[name] = factory
        return factory

    return deco


def builtin_modules() -> tuple[str, ...]:
    """Modules that register the built-in policies when imported."""
    return (".redact", ".antifraud", ".compliance", ".channel")


def _load_registry() -> dict[str, PolicyFactory]:
    for mod in builtin_modules():
        importlib.import_module(mod, __package__)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        REGISTRY.setdefault(ep.name, ep.load())
    return REGISTRY


def _kind_of(name: str, cfg: Config) -> str:
    settings = cfg.policies.get(name, {})
    kind = settings.get("kind", name)
    return kind if isinstance(kind, str) else name


def known_policies(cfg: Config) -> set[str]:
    """Every policy name a route in ``cfg`` may use."""
    registry = _load_registry()
    names = set(registry)
    names.update(n for n in cfg.policies if _kind_of(n, cfg) in registry)
    return names


def build_policies(names: list[str], cfg: Config) -> list[Policy]:
    """Build the policies a route names, in order (names were checked at config load)."""
    registry = _load_registry()
    built: list[Policy] = []
    for name in names:
        settings = {k: v for k, v in cfg.policies.get(name, {}).items() if k != "kind"}
        policy = registry[_kind_of(name, cfg)](name, settings, cfg)
        policy.name = name
        built.append(policy)
    return built


# --- rule packs ------------------------------------------------------------------

PACKS_PACKAGE = "aiserve_trio.policies.packs"


class Table(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Base for policy tables (rule packs, settings): an unknown key is an error.

    Frozen: decoded once at load, never changed (subclasses repeat ``frozen=True``
    for type checkers). ``__post_init__`` methods raise
    :func:`~aiserve_trio.decoding.field_error` to name the key that is wrong.
    """


PackT = TypeVar("PackT", bound=Table)


def read_pack(
    ref: str, typ: type[PackT], *, policy: str, source: str, base_dir: str
) -> tuple[PackT, str]:
    """Load a TOML rule pack into ``typ``: a shipped pack's name, or a file path.

    A bare name (``"anti-fraud-v2"``) is a pack shipped in the package
    (``policies/packs/NAME.toml``, also at ``configs/policies/``); anything with
    a ``/`` or ending in ``.toml`` is a file, relative to ``base_dir``.

    Args:
        policy: the policy the pack is for, and ``source`` its config, for messages.

    Returns:
        the decoded pack and where it came from (for error messages).

    Raises:
        ConfigError: the pack cannot be read, is not TOML, or is not a valid
            ``typ`` (naming the pack and the key in it).
    """
    try:
        if "/" in ref or ref.endswith(".toml"):
            path = Path(ref)
            if not path.is_absolute():
                path = Path(base_dir) / path
            where, data = str(path), path.read_bytes()
        else:
            where = f"<shipped pack {ref}>"
            data = (resources.files(PACKS_PACKAGE) / f"{ref}.toml").read_bytes()
    except OSError as exc:
        why = f"rule pack {ref!r} cannot be read: {exc}"
        raise ConfigError(f"{source}: policy {policy!r}: {why}") from exc
    return decode_toml(data, typ, source=f"{source}: policy {policy!r}: rule pack {where}"), where


def check_settings(name: str, settings: Mapping[str, Any], allowed: set[str], cfg: Config) -> None:
    """Refuse unknown keys in a ``[policies.NAME]`` table.

    Raises:
        ConfigError: naming the first unknown key.
    """
    for key in settings:
        if key not in allowed:
            known = ", ".join(sorted(allowed)) or "none"
            raise ConfigError(f"{cfg.source}: unknown key `policies.{name}.{key}` (known: {known})")


def setting(name: str, settings: Mapping[str, Any], key: str, kind: type, default: Any) -> Any:
    """``settings[key]`` checked to be a ``kind``, or ``default``.

    Raises:
        ConfigError: the value has the wrong type.
    """
    value = settings.get(key, default)
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise ConfigError(f"key `policies.{name}.{key}`: expected {kind.__name__}, got {value!r}")
    return value
