"""The key tables' schema, versioned in ``aiserve_keys_schema`` like the audit log's
(``audit/schema.py``): start-up applies every migration past the recorded version, each
in one transaction, with statements SQLite and PostgreSQL both accept.

- ``aiserve_keys``: one row per database key; ``hash`` is ``sha256$...`` (the plain key
  is shown once and never stored); ``old_hash``/``old_until`` the previous secret during
  a rotation's grace period; ``spec`` the grant (JSON, ``records.KeySpec``); ``rev`` the
  change counter's value at its last change (workers load the rows past the ``rev``
  they have);
- ``aiserve_teams``: a team's (or, with ``team = ''``, a tenant's) grant;
- ``aiserve_keys_state``: the change counter (one row);
- ``aiserve_admin_audit``: the admin audit trail (who, when, from where, what changed).
"""

from __future__ import annotations

MIGRATIONS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (
        1,
        (
            "CREATE TABLE aiserve_keys_state (rev INTEGER NOT NULL)",
            "INSERT INTO aiserve_keys_state (rev) VALUES (0)",
            """CREATE TABLE aiserve_keys (
                id TEXT PRIMARY KEY,
                hash TEXT NOT NULL,
                old_hash TEXT,
                old_until DOUBLE PRECISION,
                tenant TEXT NOT NULL,
                team TEXT NOT NULL,
                label TEXT NOT NULL,
                spec TEXT NOT NULL,
                expires_at DOUBLE PRECISION,
                created_by TEXT NOT NULL,
                created_at DOUBLE PRECISION NOT NULL,
                updated_at DOUBLE PRECISION NOT NULL,
                revoked_at DOUBLE PRECISION,
                last_used DOUBLE PRECISION,
                rev INTEGER NOT NULL
            )""",
            "CREATE INDEX aiserve_keys_rev ON aiserve_keys (rev)",
            """CREATE TABLE aiserve_teams (
                tenant TEXT NOT NULL,
                team TEXT NOT NULL,
                spec TEXT NOT NULL,
                updated_by TEXT NOT NULL,
                updated_at DOUBLE PRECISION NOT NULL,
                PRIMARY KEY (tenant, team)
            )""",
            """CREATE TABLE aiserve_admin_audit (
                ts DOUBLE PRECISION NOT NULL,
                actor TEXT NOT NULL,
                tenant TEXT NOT NULL,
                client TEXT,
                action TEXT NOT NULL,
                target TEXT NOT NULL,
                detail TEXT NOT NULL
            )""",
            "CREATE INDEX aiserve_admin_audit_ts ON aiserve_admin_audit (ts)",
        ),
    ),
)

VERSION = MIGRATIONS[-1][0]
CREATE_VERSION_TABLE = "CREATE TABLE IF NOT EXISTS aiserve_keys_schema (version INTEGER NOT NULL)"


class KeysSchemaTooNew(Exception):
    """The key tables were migrated by a newer gateway than this one."""


def pending(current: int) -> list[tuple[int, tuple[str, ...]]]:
    """The migrations a database at version ``current`` needs, in order."""
    if current > VERSION:
        raise KeysSchemaTooNew(
            f"the key tables are at schema version {current}; this gateway knows {VERSION}"
        )
    return [(v, stmts) for v, stmts in MIGRATIONS if v > current]
