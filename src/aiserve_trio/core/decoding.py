"""TOML into msgspec Structs, with errors that name the file and the TOML key.

Used by the config loader and by the policies (their settings and rule packs),
so that every configuration error reads the same way::

    gateway.toml: key `deadline.default_ms`: must not exceed deadline.max_ms (120000)
    gateway.toml: unknown key `policies.gdpr-redact.colour`

A Struct's ``__post_init__`` may raise :func:`field_error` to name one of its
fields: msgspec adds the Struct's own path, and :func:`describe` joins the two.
A leaf module (msgspec and :mod:`.errors` only), so that the config and the
policies can both import it.
"""

from __future__ import annotations

import os
import re
import typing
from typing import Any, TypeVar

import msgspec

from .errors import ConfigError

T = TypeVar("T")

_AT_RE = re.compile(r"^(?P<msg>.*) - at `\$(?P<path>[^`]*)`$", re.DOTALL)
_UNKNOWN_RE = re.compile(r"^Object contains unknown field `(?P<key>[^`]*)`$")
_FIELD_RE = re.compile(r"^`(?P<key>[^`]+)`: (?P<why>.*)$", re.DOTALL)
#: msgspec's path segment for a value in a dict (it does not say which key).
_ANY_KEY = "[...]"


def field_error(key: str, why: str) -> ValueError:
    """The error a Struct's ``__post_init__`` raises about its field ``key``.

    ``key`` is relative to the Struct (``"default_ms"``, ``"rules[0].pattern"``);
    :func:`describe` prefixes the Struct's own path.
    """
    return ValueError(f"`{key}`: {why}")


def as_field(key: str, check: typing.Callable[[str], object], value: str) -> None:
    """``check(value)``, its ValueError said as one about the Struct's field ``key``."""
    try:
        check(value)
    except ValueError as exc:
        raise field_error(key, str(exc)) from None


class Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base for config tables: an unknown key is an error, not silently ignored.

    ``__post_init__`` methods raise :func:`field_error` (a ValueError); msgspec
    turns it into a ValidationError at the table's path, and the loader into a
    ConfigError naming ``table.field``.
    """


def positive(section: msgspec.Struct, *keys: str) -> None:
    """Each of ``section``'s fields ``keys`` must be above zero."""
    for key in keys:
        if getattr(section, key) <= 0:
            raise field_error(key, "must be positive")


def not_above(section: msgspec.Struct, low: str, high: str) -> None:
    """A default, base or per-step value must not exceed the maximum it pairs with."""
    if getattr(section, low) > getattr(section, high):
        raise field_error(low, f"must not exceed `{high}` ({getattr(section, high)})")


def join_key(*parts: str) -> str:
    """Join TOML key parts: ``("policies.x", "rules[0]", "[1]")`` -> ``policies.x.rules[0][1]``.

    Empty parts are skipped.
    """
    out = ""
    for part in parts:
        if part:
            out = f"{out}{part}" if not out or part.startswith("[") else f"{out}.{part}"
    return out


def describe(message: str, at: str = "") -> str:
    """Turn a msgspec validation message into one naming the TOML key.

    Args:
        message: ``str(msgspec.ValidationError)``, e.g. ``Expected `int` - at `$.a.b[0]` ``.
        at: the key of the value that was decoded (``""``: the whole file).
    """
    m = _AT_RE.match(message)
    path, detail = (m["path"].lstrip("."), m["msg"]) if m else ("", message)
    key = join_key(at, path)
    f = _FIELD_RE.match(detail)
    if f:
        key, detail = join_key(key, f["key"]), f["why"]
    u = _UNKNOWN_RE.match(detail)
    if u:
        return f"unknown key `{join_key(key, u['key'])}`"
    return f"key `{key}`: {detail}" if key else detail


@typing.overload
def convert(value: Any, typ: type[T], *, source: str, key: str) -> T: ...


@typing.overload
def convert(value: Any, typ: Any, *, source: str, key: str) -> Any: ...


def convert(value: Any, typ: Any, *, source: str, key: str) -> Any:
    """Convert a decoded TOML value (a table, usually) to ``typ`` (a type or a union).

    Args:
        source: the file the value came from, for the message.
        key: the value's TOML key, for the message.

    Raises:
        ConfigError: naming ``source`` and the key of the first problem.
    """
    try:
        return msgspec.convert(value, typ)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {describe(str(exc), key)}") from None


def decode_toml(data: bytes, typ: type[T], *, source: str) -> T:
    """Decode a TOML document into ``typ``.

    Raises:
        ConfigError: naming ``source`` and the key of the first problem, or
            saying that it is not TOML.
    """
    try:
        return msgspec.toml.decode(data, type=typ)
    except msgspec.ValidationError as exc:
        message = _name_the_key(str(exc), data, typ)
        raise ConfigError(f"{source}: {describe(message)}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None


def _name_the_key(message: str, data: bytes, typ: type[Any]) -> str:
    """Put the table name into ``- at `$.adapters[...].models` ``.

    msgspec does not say which key of a dict held the bad value; for a dict
    field of the top Struct (``[adapters.NAME]``) each entry is converted again,
    on its own, to find it. Anything else is returned as it is.
    """
    m = _AT_RE.match(message)
    if m is None or _ANY_KEY not in m["path"]:
        return message
    field, _, _ = m["path"].lstrip(".").partition(_ANY_KEY)
    hint = typing.get_type_hints(typ).get(field) if field.isidentifier() else None
    if typing.get_origin(hint) is not dict:
        return message
    value_type = typing.get_args(hint)[1]
    table = msgspec.toml.decode(data).get(field)
    for name, value in table.items() if isinstance(table, dict) else ():
        try:
            msgspec.convert(value, value_type)
        except msgspec.ValidationError as exc:
            inner = _AT_RE.match(str(exc))
            detail, rest = (inner["msg"], inner["path"]) if inner else (str(exc), "")
            return f"{detail} - at `$.{field}.{name}{rest}`"
    return message


# --- what a config file may read ----------------------------------------------------


def config_roots(source: str, base_dir: str, config_paths: list[str]) -> tuple[str, ...] | None:
    """The folders a config's keys file and rule pack files must be inside.

    A config read from a file (``source`` is a path, not ``<...>``) reads only
    from its own folder's tree and the folders of ``[server] config_paths``
    (relative ones from that folder); otherwise the admin API's reload could read,
    and report on, any file the process can open. A config given as text (the
    embedded default, tests) has no folder of its own: None, not confined.
    """
    if source.startswith("<"):
        return None
    base = os.path.realpath(base_dir)
    return (base, *(os.path.realpath(os.path.join(base, p)) for p in config_paths))


def confined(path: str, roots: tuple[str, ...] | None) -> bool:
    """Whether ``path`` (symbolic links followed) is inside one of ``roots``."""
    if roots is None:
        return True
    real = os.path.realpath(path)
    return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def outside(what: str, ref: str) -> str:
    """The message for a file outside the roots: it says nothing about the file itself."""
    return (
        f"{what} {ref!r} is outside the config's folder and `[server] config_paths`; "
        "it is not read"
    )
