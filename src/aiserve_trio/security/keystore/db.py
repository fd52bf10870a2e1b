"""The key tables' blocking database calls (SQLite or PostgreSQL, DB-API 2), run by
:class:`~.service.KeyService` in a worker thread, one at a time, never on the event loop.

Every change is one transaction that bumps the change counter (``aiserve_keys_state``),
stamps the rows it changes with the new value (``rev``), and writes its admin audit row:
a change is on record exactly when it is made. A worker loads the rows past the ``rev``
it has (one indexed query; nothing when the counter has not moved).

SQLite: a connection per call (a file that went away is an outage, not a new empty file
-- only :meth:`open` creates it), ``BEGIN IMMEDIATE`` for changes, so two workers on one
file change one at a time. PostgreSQL: one connection, dropped on any failure and made
again on the next call; migrations under an advisory lock.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec

from ...spend.budget import Limit
from .records import Grant, KeySpec, effective, principal_of
from .schema import CREATE_VERSION_TABLE, pending
from .table import Entry

Exec = Callable[[str, Sequence[Any]], list[tuple[Any, ...]]]
KEY_COLUMNS = (
    "id", "hash", "old_hash", "old_until", "tenant", "team", "label", "spec", "expires_at",
    "created_by", "created_at", "updated_at", "revoked_at", "last_used", "rev",
)  # fmt: skip
AUDIT_COLUMNS = ("ts", "actor", "tenant", "client", "action", "target", "detail")
_MIGRATION_LOCK = 0x6B657973  # "keys"
#: A database key's budget alerts (``aiserve_budget_*``) at this share, as a config key's.
BUDGET_ALERT_AT = 0.8
_spec_decoder = msgspec.json.Decoder(KeySpec)
_grant_decoder = msgspec.json.Decoder(Grant)


class Connector(Protocol):
    placeholder: str

    def run(self, fn: Callable[[Exec], Any], *, write: bool, create: bool = False) -> Any:
        """``fn(execute)`` in one transaction (``write``: taking the write lock)."""
        ...

    def close(self) -> None: ...

    def is_conflict(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a constraint the change broke (not an outage)."""
        ...


class SQLiteConnector:
    placeholder = "?"

    def __init__(self, path: Path, timeout: float = 5.0) -> None:
        self.path = path
        self.timeout = timeout

    def __str__(self) -> str:
        return f"sqlite:{self.path}"

    def run(self, fn: Callable[[Exec], Any], *, write: bool, create: bool = False) -> Any:
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        mode = "rwc" if create else "rw"
        conn = sqlite3.connect(
            f"file:{self.path}?mode={mode}", uri=True, timeout=self.timeout, isolation_level=None
        )
        try:
            if create:
                conn.execute("PRAGMA journal_mode=WAL")

            def execute(sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
                return conn.execute(sql, tuple(params)).fetchall()

            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                result = fn(execute)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return result
        finally:
            conn.close()

    def close(self) -> None:
        pass

    def is_conflict(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.IntegrityError)


class PostgresConnector:
    placeholder = "%s"

    def __init__(self, dsn: str, name: str = "postgres") -> None:
        self._dsn = dsn
        self._name = name
        self._conn: Any = None

    def __str__(self) -> str:
        return self._name

    def run(self, fn: Callable[[Exec], Any], *, write: bool, create: bool = False) -> Any:
        import psycopg  # late: only with this backend

        try:
            if self._conn is None:
                self._conn = psycopg.connect(self._dsn, connect_timeout=3, autocommit=True)
            conn = self._conn

            def execute(sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
                cur = conn.execute(sql.replace("?", "%s"), tuple(params))
                return cur.fetchall() if cur.description is not None else []

            with conn.transaction():
                if create:
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
                return fn(execute)
        except psycopg.IntegrityError:
            raise
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # a broken connection: nothing to close
                conn.close()

    def is_conflict(self, exc: BaseException) -> bool:
        import psycopg

        return isinstance(exc, psycopg.IntegrityError)


# --- the calls -------------------------------------------------------------------


def migrate(ex: Exec) -> int:
    """Apply the pending migrations (in the caller's transaction); the version."""
    ex(CREATE_VERSION_TABLE, ())
    rows = ex("SELECT max(version) FROM aiserve_keys_schema", ())
    current = int(rows[0][0]) if rows and rows[0][0] is not None else 0
    for version, statements in pending(current):
        for stmt in statements:
            ex(stmt, ())
        ex("DELETE FROM aiserve_keys_schema", ())
        ex("INSERT INTO aiserve_keys_schema (version) VALUES (?)", (version,))
        current = version
    return current


def bump(ex: Exec) -> int:
    """The next value of the change counter (inside a write transaction)."""
    ex("UPDATE aiserve_keys_state SET rev = rev + 1", ())
    return int(ex("SELECT rev FROM aiserve_keys_state", ())[0][0])


def audit(ex: Exec, row: tuple[Any, ...]) -> None:
    marks = ", ".join("?" * len(AUDIT_COLUMNS))
    ex(f"INSERT INTO aiserve_admin_audit ({', '.join(AUDIT_COLUMNS)}) VALUES ({marks})", row)


def teams(ex: Exec, tenant: str | None = None) -> dict[tuple[str, str], Grant]:
    sql = "SELECT tenant, team, spec FROM aiserve_teams"
    rows = ex(sql + " WHERE tenant = ?", (tenant,)) if tenant else ex(sql, ())
    return {(t, team): _grant_decoder.decode(spec) for t, team, spec in rows}


def load(ex: Exec, since: int) -> tuple[int, dict[str, Entry | None]]:
    """The change counter and every key changed past ``since``, built for the table
    (here, in the thread: 10,000 principals are not built on the event loop)."""
    rev = int(ex("SELECT rev FROM aiserve_keys_state", ())[0][0])
    if rev == since:
        return rev, {}
    rows = ex(
        "SELECT id, hash, old_hash, old_until, tenant, team, spec, expires_at, revoked_at "
        "FROM aiserve_keys WHERE rev > ?",
        (since,),
    )
    grants = teams(ex) if rows else {}
    changed: dict[str, Entry | None] = {}
    for key_id, hash_, old, old_until, tenant, team, spec, expires, revoked in rows:
        if revoked is not None:
            changed[key_id] = None
            continue
        eff = effective(
            _spec_decoder.decode(spec), grants.get((tenant, team)) if team else None,
            grants.get((tenant, "")),
        )  # fmt: skip
        changed[key_id] = Entry(
            principal=principal_of(key_id, tenant, team, eff),
            digest=bytes.fromhex(hash_.removeprefix("sha256$")),
            old_digest=bytes.fromhex(old.removeprefix("sha256$")) if old else None,
            old_until=float(old_until or 0.0),
            expires_at=expires,
            budget=None
            if eff.budget is None
            else Limit("key", key_id, eff.budget, eff.budget_period, BUDGET_ALERT_AT, tenant),
        )
    return rev, changed


def key_row(ex: Exec, key_id: str) -> dict[str, Any] | None:
    rows = ex(f"SELECT {', '.join(KEY_COLUMNS)} FROM aiserve_keys WHERE id = ?", (key_id,))
    return dict(zip(KEY_COLUMNS, rows[0], strict=True)) if rows else None


def key_rows(
    ex: Exec, tenant: str | None, team: str | None, revoked: bool, limit: int, after: str
) -> list[dict[str, Any]]:
    where, params = ["id > ?"], [after]
    if tenant is not None:
        where.append("tenant = ?")
        params.append(tenant)
    if team is not None:
        where.append("team = ?")
        params.append(team)
    if not revoked:
        where.append("revoked_at IS NULL")
    sql = (
        f"SELECT {', '.join(KEY_COLUMNS)} FROM aiserve_keys WHERE {' AND '.join(where)} "
        f"ORDER BY id LIMIT {int(limit)}"
    )
    return [dict(zip(KEY_COLUMNS, r, strict=True)) for r in ex(sql, params)]


def insert_key(ex: Exec, row: dict[str, Any], audit_row: tuple[Any, ...]) -> int:
    rev = bump(ex)
    values = {**row, "rev": rev}
    marks = ", ".join("?" * len(KEY_COLUMNS))
    ex(
        f"INSERT INTO aiserve_keys ({', '.join(KEY_COLUMNS)}) VALUES ({marks})",
        [values[c] for c in KEY_COLUMNS],
    )
    audit(ex, audit_row)
    return rev


def update_key(ex: Exec, key_id: str, changes: dict[str, Any], audit_row: tuple[Any, ...]) -> int:
    rev = bump(ex)
    sets = ", ".join(f"{c} = ?" for c in changes)
    ex(f"UPDATE aiserve_keys SET {sets}, rev = ? WHERE id = ?", [*changes.values(), rev, key_id])
    audit(ex, audit_row)
    return rev


def put_team(
    ex: Exec, tenant: str, team: str, grant: Grant, by: str, now: float,
    audit_row: tuple[Any, ...],
) -> int:  # fmt: skip
    rev = bump(ex)
    spec = msgspec.json.encode(grant).decode()
    ex("DELETE FROM aiserve_teams WHERE tenant = ? AND team = ?", (tenant, team))
    ex(
        "INSERT INTO aiserve_teams (tenant, team, spec, updated_by, updated_at) "
        "VALUES (?, ?, ?, ?, ?)",
        (tenant, team, spec, by, now),
    )
    # The keys that inherit from it are reloaded by every worker.
    if team:
        ex("UPDATE aiserve_keys SET rev = ? WHERE tenant = ? AND team = ?", (rev, tenant, team))
    else:
        ex("UPDATE aiserve_keys SET rev = ? WHERE tenant = ?", (rev, tenant))
    audit(ex, audit_row)
    return rev


def touch(ex: Exec, used: dict[str, float]) -> None:
    """Record last uses (no change of the counter: nobody needs to reload for it)."""
    for key_id, ts in used.items():
        ex(
            "UPDATE aiserve_keys SET last_used = ? WHERE id = ? "
            "AND (last_used IS NULL OR last_used < ?)",
            (ts, key_id, ts),
        )


def audit_rows(
    ex: Exec, filters: dict[str, str], since: float, until: float, limit: int,
    tenant: str | None,
) -> list[dict[str, Any]]:  # fmt: skip
    where: list[str] = ["ts >= ?", "ts < ?"]
    params: list[Any] = [since, until]
    if tenant is not None:
        where.append("tenant = ?")
        params.append(tenant)
    for column in ("actor", "action", "target"):
        if column in filters:
            where.append(f"{column} = ?")
            params.append(filters[column])
    sql = (
        f"SELECT {', '.join(AUDIT_COLUMNS)} FROM aiserve_admin_audit "
        f"WHERE {' AND '.join(where)} ORDER BY ts DESC LIMIT {int(limit)}"
    )
    out = []
    for row in ex(sql, params):
        item = dict(zip(AUDIT_COLUMNS, row, strict=True))
        item["detail"] = json.loads(item["detail"])
        out.append(item)
    return out
