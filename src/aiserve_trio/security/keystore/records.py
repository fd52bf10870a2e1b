"""What a database key and a team (or tenant) record carry, and the rule that a key only
narrows what its team and tenant grant (issue 47, item 3). Pure: no I/O.

A grant's lists (``routes``, ``channels``, ``models``) use ``"*"`` for "any"; a list
unset (None) inherits the team's, then the tenant's (none set: any). Numbers (``rpm``, ``tpm``,
``budget``) unset or 0 inherit the parent's limit. A key may narrow (a subset, a lower
limit), never widen: :func:`check_narrows` refuses a list with a member its parent does
not grant and a limit above the parent's.
"""

from __future__ import annotations

import re
import secrets
import string

import msgspec

from ...spend.settings import Period
from ..auth import WILDCARD, Principal, SessionGrant
from ..roles import ADMIN, check_roles

#: Database key ids: ``vk`` and 14 lower-case letters or digits. A config key may not
#: take an id of this shape (``settings.AuthKey``), so the two never share one.
DB_KEY_ID_RE = re.compile(r"^vk[a-z0-9]{14}$")
_ALPHABET = string.ascii_lowercase + string.digits
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
MAX_LABEL = 200
MAX_LIST = 256


def new_key_id() -> str:
    """A fresh database key id (``vk`` + 14 random characters: ~72 bits)."""
    return "vk" + "".join(secrets.choice(_ALPHABET) for _ in range(14))


def is_db_key_id(key_id: str) -> bool:
    return DB_KEY_ID_RE.match(key_id) is not None


class Grant(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What a team or tenant record grants its keys."""

    routes: list[str] | None = None
    channels: list[str] | None = None
    models: list[str] | None = None
    rpm: int = 0
    tpm: int = 0
    budget: float | None = None
    budget_period: Period = "month"


class KeySpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A key's own grant (stored as JSON in ``aiserve_keys.spec``); a list left unset
    inherits (with no record to inherit from: any)."""

    routes: list[str] | None = None
    channels: list[str] | None = None
    models: list[str] | None = None
    rpm: int = 0
    tpm: int = 0
    budget: float | None = None
    budget_period: Period = "month"
    #: Open streams this key may hold in a worker (0: the tenant's cap only).
    max_streams: int = 0
    roles: list[str] = msgspec.field(default_factory=list)
    sessions: SessionGrant = ""


def check_name(what: str, value: str, *, empty: bool = False) -> None:
    """Raise ValueError unless ``value`` is a tenant or team name (``empty``: or "")."""
    if value == "" and empty:
        return
    if not _NAME_RE.match(value):
        raise ValueError(f"`{what}` must be 1-64 lower-case letters, digits, '_', '.', '-'")


def check_spec(spec: KeySpec | Grant) -> None:
    """Raise ValueError for values no key or team may have."""
    for name in ("routes", "channels", "models"):
        values = getattr(spec, name)
        if values is None:
            continue
        if len(values) > MAX_LIST or any(not v or len(v) > 200 for v in values):
            raise ValueError(f"`{name}`: at most {MAX_LIST} names of 1-200 characters")
    if spec.rpm < 0 or spec.tpm < 0:
        raise ValueError("`rpm` and `tpm` must not be negative")
    if spec.budget is not None and not spec.budget >= 0:
        raise ValueError("`budget` must not be negative")
    if isinstance(spec, KeySpec):
        check_roles(spec.roles)
        if spec.max_streams < 0:
            raise ValueError("`max_streams` must not be negative")


def _list_within(name: str, mine: list[str] | None, parent: list[str] | None, whose: str) -> None:
    if mine is None or parent is None or WILDCARD in parent:
        return
    wider = sorted(set(mine) - set(parent))
    if wider:
        raise ValueError(
            f"`{name}` may only narrow the {whose}'s grant: {wider[0]!r} is not in it "
            f"({', '.join(parent) or 'none'})"
        )


def _limit_within(name: str, mine: float, parent: float, whose: str) -> None:
    if parent and (not mine or mine > parent):
        raise ValueError(
            f"`{name}` may only narrow the {whose}'s limit of {parent:g}: "
            f"{'unlimited' if not mine else f'{mine:g}'} is wider"
        )


def check_narrows(child: KeySpec | Grant, parent: Grant | None, whose: str) -> None:
    """Raise ValueError when ``child`` grants more than ``parent`` (a team or tenant
    record; None: no record, nothing to narrow).

    A key that leaves ``models`` unset inherits, and so narrows; 0 ``rpm``/``tpm`` and no
    ``budget`` mean "the parent's" for a key (:func:`effective`), so they do not widen.
    """
    if parent is None:
        return
    _list_within("routes", child.routes, parent.routes, whose)
    _list_within("channels", child.channels, parent.channels, whose)
    _list_within("models", child.models, parent.models, whose)
    if child.rpm:
        _limit_within("rpm", child.rpm, parent.rpm, whose)
    if child.tpm:
        _limit_within("tpm", child.tpm, parent.tpm, whose)
    if child.budget is not None and parent.budget is not None:
        _limit_within("budget", child.budget, parent.budget, whose)


def effective(spec: KeySpec, *parents: Grant | None) -> KeySpec:
    """``spec`` with what it leaves unset taken from its nearest parent (team, then
    tenant) that sets it."""
    routes, channels, models, rpm, tpm, budget, period = (
        spec.routes, spec.channels, spec.models, spec.rpm, spec.tpm, spec.budget,
        spec.budget_period,
    )  # fmt: skip
    for p in parents:
        if p is None:
            continue
        routes = routes if routes is not None else p.routes
        channels = channels if channels is not None else p.channels
        if models is None:
            models = p.models
        rpm = rpm or p.rpm
        tpm = tpm or p.tpm
        if budget is None and p.budget is not None:
            budget, period = p.budget, p.budget_period
    return msgspec.structs.replace(
        spec, routes=routes, channels=channels, models=models, rpm=rpm, tpm=tpm, budget=budget,
        budget_period=period,
    )  # fmt: skip


def principal_of(key_id: str, tenant: str, team: str, spec: KeySpec) -> Principal:
    """The principal a database key (its effective spec) acts as. A database key is never
    a ``global_admin``: that stays in the config."""
    roles = frozenset(spec.roles)
    return Principal(
        key_id=key_id,
        tenant=tenant,
        routes=frozenset(spec.routes if spec.routes is not None else [WILDCARD]),
        channels=frozenset(spec.channels if spec.channels is not None else [WILDCARD]),
        admin=ADMIN in roles,
        rpm=spec.rpm,
        tpm=spec.tpm,
        sessions=spec.sessions,
        team=team,
        roles=roles,
        models=None if spec.models is None or WILDCARD in spec.models else frozenset(spec.models),
        max_streams=spec.max_streams,
    )
