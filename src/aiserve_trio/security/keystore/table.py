"""The worker's in-memory table of database keys: what the gate checks a presented
``vk...`` key against (pure: the database is never touched on the request path).

:meth:`KeyTable.check` costs what :meth:`~..auth.KeyStore.check` costs -- one SHA-256 of
the presented key and one or two constant-time comparisons -- whatever the table's size
(a dict lookup by id) and whether the id exists. The table is changed only by
:meth:`apply`, with entries the refresh built off the event loop.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass

from ...core.errors import Unauthorized
from ...spend.budget import Limit
from ..auth import Principal


@dataclass(frozen=True, slots=True)
class Entry:
    """One live database key as the gate needs it."""

    principal: Principal
    digest: bytes
    #: The secret before a rotation, valid until ``old_until`` (Unix seconds).
    old_digest: bytes | None = None
    old_until: float = 0.0
    expires_at: float | None = None
    #: Its spend budget (its own, or its team's or tenant's cap when it sets none).
    budget: Limit | None = None


class KeyTable:
    """Database keys by id (see the module docstring)."""

    def __init__(self) -> None:
        self._by_id: dict[str, Entry] = {}
        #: Key id -> tenant / principal, for stream and console tokens (kept in step).
        self.tenant_of: dict[str, str] = {}
        self.principals: dict[str, Principal] = {}
        #: Key id -> when it was last used (Unix seconds), until the service writes it.
        self.used: dict[str, float] = {}
        self._nothing = secrets.token_bytes(32)

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, key_id: object) -> bool:
        return key_id in self._by_id

    def get(self, key_id: str) -> Entry | None:
        return self._by_id.get(key_id)

    def budget(self, key_id: str) -> Limit | None:
        """The spend budget of database key ``key_id`` (None: none, or not a database key)."""
        entry = self._by_id.get(key_id)
        return entry.budget if entry is not None else None

    def budgets(self) -> list[Limit]:
        """The budgets of every database key that has one (the ledger seeds and re-reads
        them from the audit log as it does the config's)."""
        return [e.budget for e in self._by_id.values() if e.budget is not None]

    def apply(self, changed: dict[str, Entry | None]) -> None:
        """Put ``changed`` in the table (None: the key is gone -- revoked or deleted)."""
        for key_id, entry in changed.items():
            if entry is None:
                self._by_id.pop(key_id, None)
                self.tenant_of.pop(key_id, None)
                self.principals.pop(key_id, None)
            else:
                self._by_id[key_id] = entry
                self.tenant_of[key_id] = entry.principal.tenant
                self.principals[key_id] = entry.principal

    def check(self, key_id: str, digest: bytes, now: float) -> Principal:
        """The principal of the key whose id is ``key_id`` and whose SHA-256 is ``digest``.

        Raises:
            Unauthorized: an unknown id, a wrong secret, the old secret past its grace
                period, or an expired key (``expired_api_key``).
        """
        entry = self._by_id.get(key_id)
        want = entry.digest if entry is not None else self._nothing
        ok = hmac.compare_digest(digest, want)
        if entry is None:
            raise Unauthorized("the API key is not valid")
        if not ok:
            old = entry.old_digest
            if old is None or not hmac.compare_digest(digest, old) or now >= entry.old_until:
                raise Unauthorized("the API key is not valid")
        if entry.expires_at is not None and now >= entry.expires_at:
            raise Unauthorized("the API key has expired", code="expired_api_key")
        self.used[key_id] = now
        return entry.principal
