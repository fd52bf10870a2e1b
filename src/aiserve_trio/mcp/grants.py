"""Which MCP tools a caller may see and call (sans-IO).

A grant names ``server/tool``; ``*`` and ``?`` are globs (``tickets/*``: every tool
of ``tickets``; ``*``: every tool of every server). Deny by default: a key without
grants sees and calls nothing. A tenant's ``mcp_tools`` (``[tenants.NAME]``) is the
ceiling of its keys: a tool must be granted by the key *and* by the tenant, so a key
can never widen its tenant's grant (a tenant without ``mcp_tools`` sets no ceiling).
Prompts and resources of a server are a whole server's: visible to a caller granted
``server/*`` (or a glob that covers it).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from dataclasses import dataclass, field


def _compile(patterns: Sequence[str]) -> re.Pattern[str] | None:
    if not patterns:
        return None
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns))


@dataclass(frozen=True, slots=True)
class Grants:
    """What one caller may use: its key's patterns under its tenant's ceiling."""

    key: tuple[str, ...]
    #: The tenant's ceiling; None: the tenant sets none.
    tenant: tuple[str, ...] | None = None
    #: Whose the key's patterns are (named in refusals).
    key_id: str = ""
    tenant_name: str = ""
    #: Auth off: every tool (as every other endpoint with auth off).
    everything: bool = False
    _key_re: re.Pattern[str] | None = field(init=False, repr=False, compare=False)
    _tenant_re: re.Pattern[str] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_key_re", _compile(self.key))
        tenant = self.tenant
        object.__setattr__(self, "_tenant_re", None if tenant is None else _compile(tenant))

    def _by_key(self, subject: str) -> bool:
        k = self._key_re
        return k is not None and k.fullmatch(subject) is not None

    def _by_tenant(self, subject: str) -> bool:
        if self.tenant is None:
            return True
        t = self._tenant_re
        return t is not None and t.fullmatch(subject) is not None

    def tool(self, server: str, tool: str) -> bool:
        """Whether the caller may see and call ``server``'s ``tool``."""
        if self.everything:
            return True
        subject = f"{server}/{tool}"
        return self._by_key(subject) and self._by_tenant(subject)

    def server(self, server: str) -> bool:
        """Whether the caller is granted all of ``server`` (its prompts and resources)."""
        return self.tool(server, "*")

    def refusal(self, server: str, tool: str) -> str:
        """Why :meth:`tool` is False: the grant that is missing, and whose."""
        subject = f"{server}/{tool}"
        if not self._by_key(subject):
            return (
                f"API key {self.key_id!r} has no grant for MCP tool {subject!r}: "
                f"add {subject!r} (or '{server}/*') to its mcp_tools"
            )
        return (
            f"tenant {self.tenant_name!r} does not grant MCP tool {subject!r}: its "
            f"[tenants.{self.tenant_name}] mcp_tools must include it (a key cannot widen "
            "its tenant's grant)"
        )


EVERYTHING = Grants((), everything=True)
