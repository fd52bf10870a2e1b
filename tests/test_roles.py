"""Roles (issue 47, item 4) and the client header conventions (item 6): what admin,
key-manager, viewer and user may do, decided in security/roles.py, enforced by the gate;
and a key accepted as ``Authorization: Bearer``, ``x-api-key`` and ``api-key`` alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aiserve_trio.config import ConfigError
from aiserve_trio.core.errors import Forbidden
from aiserve_trio.http.endpoints import Auth
from aiserve_trio.security import roles
from aiserve_trio.security.auth import Principal

from .asgi_client import Client, chat_body
from .authcfg import KEY_A, KEY_ADMIN, auth_app, auth_config, auth_toml
from .keyscfg import KEY_KM, KEY_TADMIN, KEY_USER, KEY_VIEW, ROLE_KEYS, h, keys_app
from .sim_gateway import running


def who(**kw: Any) -> Principal:
    return Principal(
        key_id="k", tenant="t", routes=frozenset(["*"]), channels=frozenset(["*"]), **kw
    )


def test_a_key_without_roles_calls_models_and_nothing_else() -> None:
    p = who()
    assert roles.effective(p) == {"user"}
    assert roles.may(p, roles.Action.MODEL_CALL)
    assert not any(roles.may(p, a) for a in roles.Action if a is not roles.Action.MODEL_CALL)


def test_an_admin_key_may_do_everything() -> None:
    assert all(roles.may(who(admin=True), a) for a in roles.Action)


def test_a_viewer_reads_usage_and_audit_only() -> None:
    p = who(roles=frozenset({"viewer"}))
    granted = {a for a in roles.Action if roles.may(p, a)}
    assert granted == {roles.Action.USAGE_READ, roles.Action.AUDIT_READ}


def test_a_key_manager_manages_its_own_team_only() -> None:
    p = who(roles=frozenset({"key-manager"}), team="payments")
    assert roles.may(p, roles.Action.KEYS_WRITE)
    assert not roles.may(p, roles.Action.TEAMS_WRITE)
    assert not roles.may(p, roles.Action.MODEL_CALL)
    assert roles.managed_team(p) == "payments"
    assert roles.managed_team(who(admin=True)) is None
    with pytest.raises(Forbidden):
        roles.managed_team(who(roles=frozenset({"key-manager"})))


@pytest.mark.parametrize(
    ("method", "path", "action"),
    [
        ("GET", "/admin/keys", roles.Action.KEYS_READ),
        ("POST", "/admin/keys", roles.Action.KEYS_WRITE),
        ("GET", "/admin/keys/vkabc", roles.Action.KEYS_READ),
        ("POST", "/admin/keys/vkabc/revoke", roles.Action.KEYS_WRITE),
        ("GET", "/admin/teams", roles.Action.TEAMS_READ),
        ("PUT", "/admin/teams/x", roles.Action.TEAMS_WRITE),
        ("GET", "/admin/usage", roles.Action.USAGE_READ),
        ("GET", "/admin/audit", roles.Action.AUDIT_READ),
        ("POST", "/admin/config/reload", roles.Action.ADMIN),
        ("GET", "/admin/keysx", roles.Action.ADMIN),
        ("GET", "/debug/profile", roles.Action.ADMIN),
    ],
)
def test_each_admin_path_needs_its_action(method: str, path: str, action: roles.Action) -> None:
    assert roles.action_for(method, path) is action


def test_an_unknown_role_is_refused_at_load() -> None:
    bad = ROLE_KEYS.replace('roles = ["viewer"]', 'roles = ["superuser"]')
    with pytest.raises(ConfigError, match="superuser"):
        auth_config(auth_toml() + bad)


async def test_roles_in_the_app() -> None:
    client = Client(auth_app(auth_toml() + ROLE_KEYS))

    def h(key: str) -> dict[str, str]:
        return {"authorization": f"Bearer {key}"}

    # A viewer reads usage, but may neither reload the config nor call a model.
    assert (await client.request("GET", "/admin/usage", headers=h(KEY_VIEW))).status != 403
    r = await client.request("POST", "/admin/config/reload", headers=h(KEY_VIEW))
    assert (r.status, r.json()["error"]["code"]) == (403, "admin_only")
    r = await client.chat(chat_body(), h(KEY_VIEW))
    assert (r.status, r.json()["error"]["code"]) == (403, "role_not_allowed")
    # A key-manager does not read usage; a user calls models.
    r = await client.request("GET", "/admin/usage", headers=h(KEY_KM))
    assert (r.status, r.json()["error"]["code"]) == (403, "admin_only")
    assert (await client.chat(chat_body(), h(KEY_USER))).status == 200
    r = await client.request("GET", "/admin/usage", headers=h(KEY_USER))
    assert r.status == 403


@pytest.mark.parametrize("header", ["authorization", "x-api-key", "api-key"])
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat_body()),
        ("/v1/messages", {"model": "aiserve-mock", "max_tokens": 16, **chat_body()}),
        ("/v1/responses", {"model": "aiserve-mock", "input": "hello"}),
        ("/v1/embeddings", {"model": "aiserve-mock", "input": "hello"}),
        ("/v1/models", None),
    ],
)
async def test_one_key_three_header_conventions(header: str, path: str, body: Any) -> None:
    client = Client(auth_app(auth_toml() + ROLE_KEYS))
    value = f"Bearer {KEY_USER}" if header == "authorization" else KEY_USER
    method = "GET" if body is None else "POST"
    r = await client.request(method, path, json_body=body, headers={header: value})
    assert r.status == 200, (header, path, r.body)
    wrong = KEY_USER[:-4] + "zzzz"
    value = f"Bearer {wrong}" if header == "authorization" else wrong
    r = await client.request(method, path, json_body=body, headers={header: value})
    assert r.status == 401


# --- every admin endpoint, with every role ------------------------------------------

_WALKERS = {
    "global admin": (KEY_ADMIN, Principal("ops", "bank-a", frozenset(), frozenset(), admin=True,
                                          global_admin=True)),
    "tenant admin": (KEY_TADMIN, Principal("tara", "bank-a", frozenset(), frozenset(), admin=True)),
    "key-manager": (KEY_KM, Principal("kim", "bank-a", frozenset(), frozenset(), team="payments",
                                      roles=frozenset({"key-manager"}))),
    "viewer": (KEY_VIEW, Principal("vera", "bank-a", frozenset(), frozenset(),
                                   roles=frozenset({"viewer"}))),
    "user": (KEY_USER, Principal("ulla", "bank-a", frozenset(), frozenset(),
                                 roles=frozenset({"user"}))),
    "no role": (KEY_A, Principal("alice", "bank-a", frozenset(), frozenset())),
}  # fmt: skip
#: Admin endpoints that act for every tenant (the gate's ``_EVERY_TENANT``, and the
#: console's steps editor, which edits the config).
_GLOBAL = ("/admin/config", "/debug/", "/metrics", "/admin/api/routes/steps")
_ADMIN_AUTH = (Auth.ADMIN, Auth.ADMIN_OR_CONSOLE_TOKEN, Auth.METRICS)


def _admin_endpoints(tmp: Path) -> list[tuple[str, str]]:
    app = keys_app(tmp)
    table = app.gateway.runtime.endpoints
    found = sorted(
        (method, ep.path) for ep in table if ep.auth in _ADMIN_AUTH for method in ep.methods
    )
    return found


@pytest.mark.parametrize("role", sorted(_WALKERS))
async def test_each_admin_endpoint_checks_the_role(tmp_path: Path, role: str) -> None:
    """One walk: each admin endpoint of the table (the keys, teams and audit API included)
    with each role's key; a role the endpoint's action is not granted to gets 403."""
    key, principal = _WALKERS[role]
    app = keys_app(tmp_path)
    walked = _admin_endpoints(tmp_path / "other")
    paths = {p for _, p in walked}
    for must in (
        "/admin/keys",
        "/admin/keys/{id}/revoke",
        "/admin/audit",
        "/admin/teams",
        "/admin/usage",
        "/admin/config/reload",
        "/metrics",
        "/admin/api/spend",
    ):
        assert must in paths, must  # fmt: skip
    seen: dict[str, int] = {}
    async with running(app) as client:
        for method, template in walked:
            path = template.replace("{id}", "vk0000000000000a").replace("{team}", "payments")
            path = path.replace("{tenant}", "bank-a")
            action = roles.action_for(method, path)
            allowed = roles.may(principal, action) and (
                principal.global_admin or not path.startswith(_GLOBAL)
            )
            r = await client.request(
                method, path, body=b"{}" if method in ("POST", "PUT", "PATCH") else None,
                headers={**h(key), "content-type": "application/json"},
            )  # fmt: skip
            code = r.json()["error"].get("code") if r.status == 403 else None
            if allowed:
                assert code not in ("admin_only", "global_admin_only"), (role, method, path)
            else:
                assert r.status == 403, (role, method, path, r.status, r.body[:200])
                assert code in ("admin_only", "global_admin_only"), (role, method, path)
            seen[f"{method} {template}"] = r.status
    assert len(seen) == len(walked)
