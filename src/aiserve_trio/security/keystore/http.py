"""``/admin/keys``, ``/admin/teams``, ``/admin/tenants`` and ``/admin/audit`` (issue 47).

The gate has checked the caller's role for the path (``security/roles.py``); here each
handler narrows what the caller reaches: an admin its tenant (a ``global_admin`` every
tenant), a key-manager its team's keys (and the keys it makes get at most the ``user``
role). A key out of reach answers 404, as one that does not exist. Every change writes
one admin audit row in the same transaction (never a secret: the plain key is in the
answer that creates or rotates it, and nowhere else).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from ...core.api import encoder
from ...core.errors import BadRequest, Forbidden, NotFound, StageDeadlineExceeded, Unprocessable
from ...http.body import read_body
from ...http.types import JSON_HEADERS
from .. import roles
from ..auth import hash_key, new_key
from . import db
from .records import (
    Grant,
    KeySpec,
    check_name,
    check_narrows,
    check_spec,
    is_db_key_id,
    new_key_id,
)
from .service import KeyService, audit_row

if TYPE_CHECKING:
    from ...http.endpoints import Request
    from ..auth import Principal
    from ..gate import Gate

MAX_BODY = 65_536
#: The longest grace period a rotation may give the old secret (30 days).
MAX_GRACE_S = 30 * 86_400.0
MAX_LIST = 1000
#: The roles a key-manager may give the keys it makes.
KEY_MANAGER_GIVES = frozenset({roles.USER})
_UNSET: Any = msgspec.UNSET


class KeyCreate(KeySpec, forbid_unknown_fields=True, kw_only=True):
    label: str = ""
    tenant: str = ""
    team: str = ""
    expires_at: float | None = None


class KeyUpdate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    label: str | msgspec.UnsetType = msgspec.UNSET
    expires_at: float | msgspec.UnsetType | None = msgspec.UNSET
    routes: list[str] | msgspec.UnsetType = msgspec.UNSET
    channels: list[str] | msgspec.UnsetType = msgspec.UNSET
    models: list[str] | msgspec.UnsetType | None = msgspec.UNSET
    rpm: int | msgspec.UnsetType = msgspec.UNSET
    tpm: int | msgspec.UnsetType = msgspec.UNSET
    budget: float | msgspec.UnsetType | None = msgspec.UNSET
    budget_period: str | msgspec.UnsetType = msgspec.UNSET
    max_streams: int | msgspec.UnsetType = msgspec.UNSET
    roles: list[str] | msgspec.UnsetType = msgspec.UNSET
    sessions: str | msgspec.UnsetType = msgspec.UNSET


class Rotate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    #: Seconds the old secret stays valid (0: refused at once).
    grace_s: float = 0.0


class TeamPut(Grant, forbid_unknown_fields=True, kw_only=True):
    tenant: str = ""


_spec_decoder = msgspec.json.Decoder(KeySpec)


class KeyEndpoints:
    """The handlers (bound to the worker's :class:`KeyService`)."""

    def __init__(self, service: KeyService) -> None:
        self.service = service

    # --- who and where ------------------------------------------------------------

    @staticmethod
    def _actor(request: Request) -> str:
        p = request.principal
        return p.key_id if p is not None else "loopback"

    @staticmethod
    def _client(gate: Gate, request: Request) -> str | None:
        address = gate.client_address(request.scope, request.headers)
        return address[:64] if address else None

    @staticmethod
    def _tenant_scope(gate: Gate, request: Request) -> str | None:
        """The one tenant the caller acts in; None: every tenant (a global admin, or
        loopback with auth off)."""
        p = request.principal
        return None if p is None or p.global_admin else p.tenant

    @staticmethod
    def _team_scope(request: Request) -> str | None:
        p = request.principal
        return None if p is None else roles.managed_team(p)

    def _reach(self, gate: Gate, request: Request, row: dict[str, Any] | None) -> dict[str, Any]:
        tenant, team = self._tenant_scope(gate, request), self._team_scope(request)
        if (
            row is None
            or (tenant is not None and row["tenant"] != tenant)
            or (team is not None and row["team"] != team)
        ):
            raise NotFound(f"no key {request.params.get('id', '')[:40]!r}", code="key_not_found")
        return row

    async def _row(self, gate: Gate, request: Request) -> dict[str, Any]:
        key_id = request.params["id"]
        if not is_db_key_id(key_id):
            raise NotFound(
                f"no database key {key_id[:40]!r} (config keys are changed in the config)",
                code="key_not_found",
            )
        row = await self.service.read(lambda ex: db.key_row(ex, key_id))
        return self._reach(gate, request, row)

    async def _grants(self, tenant: str, team: str) -> tuple[Grant | None, Grant | None]:
        grants = await self.service.read(lambda ex: db.teams(ex, tenant))
        return (grants.get((tenant, team)) if team else None), grants.get((tenant, ""))

    # --- keys -------------------------------------------------------------------------

    async def list(self, gate: Gate, request: Request) -> None:
        """``GET /admin/keys?team=&revoked=1&limit=&after=``"""
        q = _query(request)
        tenant = self._tenant_scope(gate, request)
        if tenant is None and q.get("tenant"):
            tenant = q["tenant"]
        team = self._team_scope(request)
        if team is None and "team" in q:
            team = q["team"]
        limit = _int(q, "limit", 100, 1, MAX_LIST)
        after = q.get("after", "")
        revoked = q.get("revoked") in ("1", "true")
        rows = await self.service.read(
            lambda ex: db.key_rows(ex, tenant, team, revoked, limit, after)
        )
        out = [_public(r) for r in rows]
        body = {"keys": out, "next": out[-1]["id"] if len(out) == limit else None}
        await _answer(request, 200, body)

    async def show(self, gate: Gate, request: Request) -> None:
        await _answer(request, 200, _public(await self._row(gate, request)))

    async def create(self, gate: Gate, request: Request) -> None:
        """``POST /admin/keys``: the key is in this answer only."""
        spec = await _body(request, KeyCreate)
        p = request.principal
        tenant = self._tenant_scope(gate, request)
        if tenant is not None and spec.tenant and spec.tenant != tenant:
            raise Forbidden(
                f"this key acts for tenant {tenant!r} only", param="tenant", code="tenant_scope"
            )
        tenant = tenant or spec.tenant or (p.tenant if p is not None else gate.default_tenant)
        team = self._team_scope(request)
        if team is not None and spec.team and spec.team != team:
            raise Forbidden(
                f"a key-manager makes keys of its team {team!r} only",
                param="team",
                code="team_scope",
            )
        team = team if team is not None else spec.team
        _check(spec, tenant, team)
        _check_roles_given(p, spec.roles)
        if spec.expires_at is not None and spec.expires_at <= time.time():
            raise Unprocessable("`expires_at` is in the past", param="expires_at")
        team_grant, tenant_grant = await self._grants(tenant, team)
        _narrows(spec, team_grant, tenant_grant)
        key_id = new_key_id()
        plain = new_key(key_id)
        now = time.time()
        grant = KeySpec(**{f: getattr(spec, f) for f in KeySpec.__struct_fields__})
        row = {
            "id": key_id, "hash": hash_key(plain), "old_hash": None, "old_until": None,
            "tenant": tenant, "team": team, "label": spec.label,
            "spec": msgspec.json.encode(grant).decode(), "expires_at": spec.expires_at,
            "created_by": self._actor(request), "created_at": now, "updated_at": now,
            "revoked_at": None, "last_used": None,
        }  # fmt: skip
        detail = {"label": spec.label, "team": team, "expires_at": spec.expires_at,
                  **msgspec.to_builtins(grant)}  # fmt: skip
        arow = self._audit(gate, request, tenant, "key.created", key_id, detail)
        await self.service.change(lambda ex: db.insert_key(ex, row, arow))
        out = _public({**row, "rev": 0})
        out["key"] = plain
        out["warning"] = "the key is shown once: store it now"
        await _answer(request, 201, out)

    async def update(self, gate: Gate, request: Request) -> None:
        """``PATCH /admin/keys/{id}``: the fields sent change; the rest stay."""
        change = await _body(request, KeyUpdate)
        row = await self._row(gate, request)
        if row["revoked_at"] is not None:
            raise Unprocessable("the key is revoked", code="key_revoked")
        spec = _spec_decoder.decode(row["spec"])
        sent = {
            f: v for f in KeyUpdate.__struct_fields__ if (v := getattr(change, f)) is not _UNSET
        }
        grant_changes = {f: v for f, v in sent.items() if f in KeySpec.__struct_fields__}
        try:
            new = msgspec.convert(
                {**msgspec.to_builtins(spec), **grant_changes}, KeySpec, strict=True
            )
        except msgspec.ValidationError as exc:
            raise Unprocessable(str(exc)) from None
        _check(new, row["tenant"], row["team"])
        if "roles" in sent:
            _check_roles_given(request.principal, new.roles)
        team_grant, tenant_grant = await self._grants(row["tenant"], row["team"])
        _narrows(new, team_grant, tenant_grant)
        columns: dict[str, Any] = {
            "spec": msgspec.json.encode(new).decode(),
            "updated_at": time.time(),
        }
        if "label" in sent:
            columns["label"] = _label(sent["label"])
        if "expires_at" in sent:
            columns["expires_at"] = sent["expires_at"]
        old = msgspec.to_builtins(spec)
        detail = {
            f: {"from": row[f] if f in ("label", "expires_at") else old.get(f), "to": v}
            for f, v in sent.items()
        }
        arow = self._audit(gate, request, row["tenant"], "key.updated", row["id"], detail)
        await self.service.change(lambda ex: db.update_key(ex, row["id"], columns, arow))
        await _answer(request, 200, _public({**row, **columns}))

    async def rotate(self, gate: Gate, request: Request) -> None:
        """``POST /admin/keys/{id}/rotate`` ``{"grace_s": 3600}``: a new secret (in this
        answer only); the old one stays valid ``grace_s`` seconds."""
        body = await _body(request, Rotate, empty_ok=True)
        if not (0.0 <= body.grace_s <= MAX_GRACE_S) or math.isnan(body.grace_s):
            raise Unprocessable(f"`grace_s` must be 0 to {MAX_GRACE_S:.0f}", param="grace_s")
        row = await self._row(gate, request)
        if row["revoked_at"] is not None:
            raise Unprocessable("the key is revoked", code="key_revoked")
        plain = new_key(row["id"])
        now = time.time()
        columns = {
            "hash": hash_key(plain), "old_hash": row["hash"], "old_until": now + body.grace_s,
            "updated_at": now,
        }  # fmt: skip
        arow = self._audit(
            gate, request, row["tenant"], "key.rotated", row["id"], {"grace_s": body.grace_s}
        )
        await self.service.change(lambda ex: db.update_key(ex, row["id"], columns, arow))
        out = _public({**row, **columns})
        out["key"] = plain
        out["warning"] = "the new key is shown once: store it now"
        await _answer(request, 200, out)

    async def revoke(self, gate: Gate, request: Request) -> None:
        """``POST /admin/keys/{id}/revoke``: refused by every worker within the bound."""
        row = await self._row(gate, request)
        if row["revoked_at"] is None:
            now = time.time()
            columns = {"revoked_at": now, "updated_at": now}
            arow = self._audit(gate, request, row["tenant"], "key.revoked", row["id"], {})
            await self.service.change(lambda ex: db.update_key(ex, row["id"], columns, arow))
            row = {**row, **columns}
        await _answer(request, 200, _public(row))

    # --- teams and tenants ------------------------------------------------------------

    async def teams(self, gate: Gate, request: Request) -> None:
        """``GET /admin/teams``: the caller's tenant's team and tenant records."""
        tenant = self._tenant_scope(gate, request)
        q = _query(request)
        if tenant is None and q.get("tenant"):
            tenant = q["tenant"]
        team = self._team_scope(request)
        grants = await self.service.read(lambda ex: db.teams(ex, tenant))
        out = [
            {"tenant": t, "team": tm, **msgspec.to_builtins(g)}
            for (t, tm), g in sorted(grants.items())
            if team is None or tm in (team, "")
        ]
        await _answer(request, 200, {"teams": out})

    async def put_team(self, gate: Gate, request: Request) -> None:
        """``PUT /admin/teams/{team}``: a team's grant (admin)."""
        await self._put(gate, request, request.params["team"])

    async def put_tenant(self, gate: Gate, request: Request) -> None:
        """``PUT /admin/tenants/{tenant}``: a tenant's grant, which its teams narrow."""
        await self._put(gate, request, "", tenant=request.params["tenant"])

    async def _put(self, gate: Gate, request: Request, team: str, tenant: str = "") -> None:
        grant = await _body(request, TeamPut)
        scope = self._tenant_scope(gate, request)
        p = request.principal
        own = p.tenant if p is not None else gate.default_tenant
        tenant = tenant or grant.tenant or own
        if scope is not None and tenant != scope:
            raise Forbidden(f"this key acts for tenant {scope!r} only", code="tenant_scope")
        try:
            check_name("tenant", tenant)
            check_name("team", team, empty=True)
            check_spec(grant)
        except ValueError as exc:
            raise Unprocessable(str(exc)) from None
        plain = Grant(**{f: getattr(grant, f) for f in Grant.__struct_fields__})
        if team:
            tenant_grant = (await self._grants(tenant, ""))[1]
            try:
                check_narrows(plain, tenant_grant, "tenant")
            except ValueError as exc:
                raise Unprocessable(str(exc), code="grant_widened") from None
        action = "team.changed" if team else "tenant.changed"
        target = f"{tenant}/{team}" if team else tenant
        arow = self._audit(gate, request, tenant, action, target, msgspec.to_builtins(plain))
        by, now = self._actor(request), time.time()
        await self.service.change(lambda ex: db.put_team(ex, tenant, team, plain, by, now, arow))
        await _answer(request, 200, {"tenant": tenant, "team": team, **msgspec.to_builtins(plain)})

    # --- the admin audit trail --------------------------------------------------------

    async def audit(self, gate: Gate, request: Request) -> None:
        """``GET /admin/audit?actor=&action=&target=&since=&until=&limit=``: newest first;
        an admin of one tenant reads its tenant's rows."""
        q = _query(request)
        now = time.time()
        since = _float(q, "since", now - 7 * 86_400.0)
        until = _float(q, "until", now + 1.0)
        limit = _int(q, "limit", 100, 1, MAX_LIST)
        tenant = self._tenant_scope(gate, request)
        filters: dict[str, str] = {k: q[k] for k in ("actor", "action", "target") if k in q}
        rows = await self.service.read(
            lambda ex: db.audit_rows(ex, filters, since, until, limit, tenant)
        )
        await _answer(request, 200, {"rows": rows})

    def _audit(
        self, gate: Gate, request: Request, tenant: str, action: str, target: str,
        detail: dict[str, Any],
    ) -> tuple[Any, ...]:  # fmt: skip
        return audit_row(
            self._actor(request), tenant, self._client(gate, request), action, target, detail
        )


# --- helpers ----------------------------------------------------------------------------


def _check(spec: KeySpec | KeyCreate, tenant: str, team: str) -> None:
    try:
        check_name("tenant", tenant)
        check_name("team", team, empty=True)
        check_spec(spec)
        if isinstance(spec, KeyCreate):
            _label(spec.label)
    except ValueError as exc:
        raise Unprocessable(str(exc)) from None


def _label(label: str) -> str:
    if len(label) > 200:
        raise Unprocessable("`label` must be at most 200 characters", param="label")
    return label


def _check_roles_given(p: Principal | None, given: list[str]) -> None:
    if p is None or roles.ADMIN in roles.effective(p):
        return
    extra = sorted(set(given) - KEY_MANAGER_GIVES)
    if extra:
        raise Forbidden(
            f"a key-manager gives keys the role user only, not {extra[0]!r}",
            param="roles",
            code="role_not_allowed",
        )


def _narrows(spec: KeySpec, team: Grant | None, tenant: Grant | None) -> None:
    try:
        check_narrows(spec, team, "team")
        check_narrows(spec, tenant, "tenant")
    except ValueError as exc:
        raise Unprocessable(str(exc), code="grant_widened") from None


def _public(row: dict[str, Any]) -> dict[str, Any]:
    """What the API shows of a key: never its hash."""
    now = time.time()
    old_until = row.get("old_until")
    return {
        "id": row["id"],
        "label": row["label"],
        "tenant": row["tenant"],
        "team": row["team"],
        **msgspec.json.decode(row["spec"]),
        "expires_at": row["expires_at"],
        "created_by": row["created_by"],
        "created_at": row["created_at"],
        "updated_at": row["updated_at"],
        "revoked_at": row["revoked_at"],
        "last_used": row["last_used"],
        "old_secret_valid_until": old_until if old_until and old_until > now else None,
    }


async def _body(request: Request, kind: type[Any], *, empty_ok: bool = False) -> Any:
    body: bytes | None = b""
    with trio.move_on_after(30.0) as scope:
        body = await read_body(request.receive, MAX_BODY)
    if scope.cancelled_caught:
        raise StageDeadlineExceeded("parse", "the request body did not arrive in time")
    if not body:
        if empty_ok:
            return kind()
        raise BadRequest("send a JSON body", param="body")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise Unprocessable(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the body is not JSON: {exc}", param="body") from None


async def _answer(request: Request, status: int, body: Any) -> None:
    await request.responder.complete(status, JSON_HEADERS, encoder.encode(body))


def _query(request: Request) -> dict[str, str]:
    from urllib.parse import parse_qs

    raw = request.scope.get("query_string", b"")
    try:
        parsed = parse_qs(raw.decode("ascii"), max_num_fields=16)
    except (UnicodeDecodeError, ValueError):
        raise BadRequest("the query string is not valid") from None
    return {k: v[0][:200] for k, v in parsed.items()}


def _int(q: dict[str, str], name: str, default: int, low: int, high: int) -> int:
    if name not in q:
        return default
    try:
        value = int(q[name])
    except ValueError:
        raise BadRequest(f"`{name}` must be a number", param=name) from None
    if not low <= value <= high:
        raise BadRequest(f"`{name}` must be {low} to {high}", param=name)
    return value


def _float(q: dict[str, str], name: str, default: float) -> float:
    if name not in q:
        return default
    try:
        value = float(q[name])
    except ValueError:
        raise BadRequest(f"`{name}` must be a Unix time", param=name) from None
    if math.isnan(value) or math.isinf(value):
        raise BadRequest(f"`{name}` must be a Unix time", param=name)
    return value


class Routes:
    """The endpoints' handlers by path, dispatching on the method (one endpoint per path)."""

    def __init__(self, endpoints: KeyEndpoints) -> None:
        self.h = endpoints

    async def keys(self, gate: Gate, request: Request) -> None:
        """``GET /admin/keys`` lists, ``POST /admin/keys`` creates."""
        if request.method == "POST":
            await self.h.create(gate, request)
        else:
            await self.h.list(gate, request)

    async def key(self, gate: Gate, request: Request) -> None:
        """``GET /admin/keys/{id}`` shows, ``PATCH`` updates."""
        if request.method == "PATCH":
            await self.h.update(gate, request)
        else:
            await self.h.show(gate, request)
