"""The tenant rule, in one place.

The config checks the tenants it names (auth keys, routes, the default tenant)
and the session bus checks the tenant it keys a session by against the same
rule. A leaf module (standard library only), so that both can import it.
"""

from __future__ import annotations

import re

#: Tenants never contain ':' so that ``tenant:session`` is unambiguous in a Redis key.
TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_tenant(tenant: str) -> str:
    """Return ``tenant`` if it is a valid tenant name (1-64 of letters, digits, ``_ . -``).

    Raises:
        ValueError: it is not.
    """
    if not TENANT_RE.fullmatch(tenant):
        raise ValueError(f"tenant {tenant!r} must match {TENANT_RE.pattern}")
    return tenant
