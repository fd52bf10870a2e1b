"""The policy framework: what a policy is, its settings, and its rule packs.

A route lists policy names in TOML (``policies = ["anti-fraud-v2", "gdpr-redact"]``);
they run in that order. Each name resolves to a :class:`Policy` built at
start-up from a :class:`PolicySpec`: the name, its kind, and the kind's
settings Struct decoded from the ``[policies.NAME]`` table when the config is
loaded. A kind is a :class:`PolicyKind`: a factory and the settings Struct it
takes. :mod:`.registry` maps kind names to kinds (the built-in ones and
third-party ones from entry points) and builds a route's policies.

Input policies see the whole request and return the (possibly rewritten)
messages or raise :class:`~aiserve_trio.core.errors.PolicyViolation`. Output
policies give, per request, an :class:`OutputFilter`: a sans-IO state machine
over the reply text that may hold back a bounded tail.

This module imports no policy and not the config, so that every policy module
and the config can import it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, Self, TypeVar

import msgspec

from ..core.decoding import confined, convert, decode_toml, outside
from ..core.errors import ConfigError
from ..core.slices import Steps

if TYPE_CHECKING:
    from ..adapters.base import Message

#: The ``action`` label values of ``policy_actions_total``.
ACTIONS = ("redacted", "blocked", "flagged", "rewritten")
PACKS_PACKAGE = "aiserve_trio.policies.packs"


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
    #: each once, in the order first taken. Never the values.
    actions: list[tuple[str, str]] = field(default_factory=list)
    #: How many times each pair was taken: counted into ``policy_actions_total``
    #: when the request ends (a megabyte of text can hold many thousand hits).
    counts: dict[tuple[str, str], int] = field(default_factory=dict)

    def record(self, policy: str, action: str) -> None:
        """Note that ``policy`` took ``action`` (one of :data:`ACTIONS`)."""
        key = (policy, action)
        n = self.counts.get(key)
        if n is None:
            self.actions.append(key)
            n = 0
        self.counts[key] = n + 1


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
    #: The output filter shapes how the content reads (channel shaping), so it
    #: applies to the content only; other filters also see reasoning, refusals
    #: and the string values of tool-call arguments.
    content_only: bool = False

    def check_input(self, messages: list[Message], ctx: PolicyContext) -> list[Message]:
        """Return the messages to send on (rewritten or not), or raise PolicyViolation."""
        return messages

    def input_steps(self, messages: list[Message], ctx: PolicyContext) -> Steps[list[Message]]:
        """:meth:`check_input` in bounded steps (the context stage runs them sliced).

        Default: :meth:`check_input` in one step. A policy whose work grows with
        the text overrides this (and makes ``check_input`` run the steps).
        """
        yield from ()
        return self.check_input(messages, ctx)

    def fields_steps(
        self, fields: dict[str, msgspec.Raw], ctx: PolicyContext
    ) -> Steps[dict[str, msgspec.Raw]]:
        """The request's other top-level fields as they go upstream (``user``,
        ``metadata``, ``tools``...), raw JSON by name; rewritten or not.

        Raises:
            PolicyViolation: the policy refuses a field.
        """
        yield from ()
        return fields

    def output_filter(self, ctx: PolicyContext) -> OutputFilter | None:
        """A fresh filter for one reply, or None if this policy does not touch output."""
        return None

    def redact_text(self, text: str, ctx: PolicyContext) -> str:
        """``text`` with what this policy protects taken out (session variables use it).

        Default: unchanged -- only data-protection policies take anything out.
        """
        return text


# --- settings and rule packs: Structs decoded once, at config load -----------------


class Table(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Base for policy tables (settings, rule packs): an unknown key is an error.

    Frozen: decoded once at load, never changed (subclasses repeat ``frozen=True``
    for type checkers). ``__post_init__`` methods raise
    :func:`~aiserve_trio.core.decoding.field_error` to name the key that is wrong.
    """


class PolicySettings(Table, frozen=True):
    """Base for a policy kind's settings: the keys of its ``[policies.NAME]`` table."""

    @classmethod
    def from_table(cls, table: Mapping[str, Any], *, source: str, key: str) -> Self:
        """Decode a ``[policies.NAME]`` table (without its ``kind``).

        A kind whose table is keyed by data (e.g. by channel) overrides this.

        Args:
            source: the config file, and ``key`` the table's TOML key, for messages.

        Raises:
            ConfigError: naming ``source`` and the key of the first problem.
        """
        return convert(table, cls, source=source, key=key)


SettingsT = TypeVar("SettingsT", bound=PolicySettings)


@dataclass(frozen=True, slots=True)
class BuildContext:
    """What building a policy needs from the config (not the whole config)."""

    #: The config file, for error messages.
    source: str
    #: The folder relative pack paths start from.
    base_dir: str
    #: ``server.channels``: the channels a policy may be configured for.
    channels: tuple[str, ...]
    #: The folders pack files must be in (``decoding.config_roots``); None: anywhere.
    roots: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class PolicyKind(Generic[SettingsT]):
    """A policy kind: its factory and the settings Struct the factory takes.

    Third-party kinds are entry points in the ``aiserve_trio.policies`` group
    whose object is a ``PolicyKind``.
    """

    #: ``factory(name, settings, ctx)``; raises ConfigError naming the key.
    factory: Callable[[str, SettingsT, BuildContext], Policy]
    settings: type[SettingsT]


class PolicySpec(msgspec.Struct, frozen=True, kw_only=True):
    """A named policy as configured: its kind and its decoded settings."""

    name: str
    kind: str
    settings: PolicySettings


PackT = TypeVar("PackT", bound=Table)


def read_pack(ref: str, typ: type[PackT], *, policy: str, ctx: BuildContext) -> tuple[PackT, str]:
    """Load a TOML rule pack into ``typ``: a shipped pack's name, or a file path.

    A bare name (``"anti-fraud-v2"``) is a pack shipped in the package
    (``policies/packs/NAME.toml``, also at ``configs/policies/``); anything with
    a ``/`` or ending in ``.toml`` is a file, relative to ``ctx.base_dir``.

    Args:
        policy: the policy the pack is for, for messages.

    Returns:
        the decoded pack and where it came from (for error messages).

    Raises:
        ConfigError: the pack cannot be read, is not TOML, or is not a valid
            ``typ`` (naming the config, the policy, the pack and the key in it).
    """
    try:
        if "/" in ref or ref.endswith(".toml"):
            path = Path(ref)
            if not path.is_absolute():
                path = Path(ctx.base_dir) / path
            if not confined(str(path), ctx.roots):
                why = outside("rule pack", ref)
                raise ConfigError(f"{ctx.source}: policy {policy!r}: {why}")
            where, data = str(path), path.read_bytes()
        else:
            where = f"<shipped pack {ref}>"
            data = (resources.files(PACKS_PACKAGE) / f"{ref}.toml").read_bytes()
    except OSError as exc:
        why = f"rule pack {ref!r} cannot be read: {exc}"
        raise ConfigError(f"{ctx.source}: policy {policy!r}: {why}") from exc
    source = f"{ctx.source}: policy {policy!r}: rule pack {where}"
    return decode_toml(data, typ, source=source), where


def apply_filters(filters: list[OutputFilter], text: str) -> str:
    """``text`` through each output filter in order."""
    for f in filters:
        if not text:
            break
        text = f.feed(text)
    return text


def finish_filters(filters: list[OutputFilter]) -> str:
    """Flush the held-back tails in order, each through the filters after it."""
    out = ""
    for f in filters:
        out = (f.feed(out) if out else "") + f.finish()
    return out


def redact_values(
    values: dict[str, str], policies: list[Policy], ctx: PolicyContext, clear: Collection[str]
) -> Steps[dict[str, str]]:
    """``values`` with every policy's :meth:`Policy.redact_text` applied, but to ``clear`` names.

    In steps, one value (at most ``sessions.bus.MAX_VAR_CHARS``) by one policy each.
    """
    out = {}
    for name, value in values.items():
        if name not in clear:
            for policy in policies:
                value = policy.redact_text(value, ctx)
                yield
        out[name] = value
    return out
