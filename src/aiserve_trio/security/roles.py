"""What each role may do: the one place that says it (issue 47, item 4).

A principal -- a config key, a database key, a signed-in person or service (a JWT's
claims mapped to roles) -- carries ``admin`` and a set of ``roles``. Its *effective*
roles are those, plus ``admin`` when the key is an admin key, plus ``user`` when it
names no role at all (a key of before roles existed calls models, as it did):

========== ================================================================
role       may
========== ================================================================
admin      everything (its own tenant; every tenant with ``global_admin``)
key-manager read and change the keys of its own team (``/admin/keys``), read teams
viewer     read usage (``/admin/usage``) and the admin audit trail (``/admin/audit``)
user       call models (the chat, messages, responses and embeddings routes)
========== ================================================================

The gate asks :func:`check` with the :class:`Action` an endpoint needs
(:func:`action_for` maps the admin paths); the keys API asks :func:`managed_team`
which keys a principal may manage. Pure: no I/O, no state.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from ..core.errors import Forbidden

if TYPE_CHECKING:
    from .auth import Principal

ADMIN = "admin"
KEY_MANAGER = "key-manager"
VIEWER = "viewer"
USER = "user"
#: Every role a key, a team claim mapping or a JWT may name.
ROLES = frozenset({ADMIN, KEY_MANAGER, VIEWER, USER})


class Action(enum.Enum):
    """What a request does, as far as roles are concerned."""

    #: A model call: a chat, Messages, Responses or embeddings route.
    MODEL_CALL = "model.call"
    KEYS_READ = "keys.read"
    KEYS_WRITE = "keys.write"
    TEAMS_READ = "teams.read"
    TEAMS_WRITE = "teams.write"
    USAGE_READ = "usage.read"
    AUDIT_READ = "audit.read"
    #: Everything else an admin does: the config and its reload, the console, ``/debug/``,
    #: ``/metrics``.
    ADMIN = "admin"


#: Role -> the actions it grants.
GRANTS: dict[str, frozenset[Action]] = {
    ADMIN: frozenset(Action),
    KEY_MANAGER: frozenset({Action.KEYS_READ, Action.KEYS_WRITE, Action.TEAMS_READ}),
    VIEWER: frozenset({Action.USAGE_READ, Action.AUDIT_READ}),
    USER: frozenset({Action.MODEL_CALL}),
}


def check_roles(roles: list[str] | tuple[str, ...] | frozenset[str]) -> None:
    """Raise ValueError unless every name in ``roles`` is a role (config and API input)."""
    unknown = sorted(set(roles) - ROLES)
    if unknown:
        raise ValueError(f"unknown role {unknown[0]!r}: one of {', '.join(sorted(ROLES))}")


def effective(principal: Principal) -> frozenset[str]:
    """The roles ``principal`` acts with (see the module docstring)."""
    roles = principal.roles
    if principal.admin:
        roles = roles | {ADMIN}
    if not roles:
        roles = frozenset({USER})
    return roles


def may(principal: Principal, action: Action) -> bool:
    """Whether one of ``principal``'s roles grants ``action``."""
    return any(action in GRANTS.get(r, frozenset()) for r in effective(principal))


def holders(action: Action) -> list[str]:
    """The roles that grant ``action`` (for messages and docs)."""
    return sorted(r for r, grants in GRANTS.items() if action in grants)


def check(principal: Principal, action: Action, what: str) -> None:
    """Raises Forbidden (``admin_only``) unless ``principal`` may do ``action`` on ``what``."""
    if may(principal, action):
        return
    if action is Action.ADMIN:
        raise Forbidden(f"{what[:200]} needs an admin API key", code="admin_only")
    if action is Action.MODEL_CALL:
        raise Forbidden(
            f"this key's roles ({', '.join(sorted(effective(principal)))}) do not include "
            "calling models (role `user`)",
            code="role_not_allowed",
        )
    raise Forbidden(
        f"{what[:200]} needs one of the roles {', '.join(holders(action))}",
        code="admin_only",
    )


def action_for(method: str, path: str) -> Action:
    """What an admin-area request (``/admin/``, ``/debug/``, ``/metrics``) does."""
    read = method in ("GET", "HEAD")
    if path == "/admin/keys" or path.startswith("/admin/keys/"):
        return Action.KEYS_READ if read else Action.KEYS_WRITE
    if path == "/admin/teams" or path.startswith("/admin/teams/"):
        return Action.TEAMS_READ if read else Action.TEAMS_WRITE
    if path == "/admin/usage" and read:
        return Action.USAGE_READ
    if path == "/admin/audit" and read:
        return Action.AUDIT_READ
    return Action.ADMIN


def managed_team(principal: Principal) -> str | None:
    """The one team whose keys ``principal`` may manage; None: every team of its tenant
    (an admin).

    Raises:
        Forbidden: a key-manager without a team manages no key.
    """
    if ADMIN in effective(principal):
        return None
    if not principal.team:
        raise Forbidden(
            "a key-manager without a team manages no keys: give it `team`",
            code="admin_only",
        )
    return principal.team
