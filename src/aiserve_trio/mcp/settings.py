"""``[mcp]``: the upstream MCP servers the gateway's ``/mcp`` aggregates, and its limits."""

from __future__ import annotations

import os
import re

import msgspec

from ..core.decoding import Section, as_field, field_error
from ..core.tenants import check_tenant

#: A server's name: it prefixes its tools (``name__tool``), so it has no ``_``.
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
#: Header names the gateway sets itself on an upstream request.
_OWN_HEADERS = frozenset(
    {"content-type", "accept", "mcp-session-id", "mcp-protocol-version", "content-length"}
)


class McpTenantCredential(Section):
    """``[mcp.servers.NAME.tenants.TENANT]``: what this tenant's calls send instead."""

    #: Merged over the server's ``headers`` (values may say ``${VAR}``).
    headers: dict[str, str] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.headers:
            if name.lower() in _OWN_HEADERS:
                raise field_error(f"headers.{name}", "is set by the gateway")


class McpServerConfig(Section):
    """One upstream MCP server: a stdio ``command`` (a child of the gateway) or a ``url``."""

    #: argv of a stdio server (its stdin and stdout carry newline-delimited JSON-RPC).
    command: list[str] = msgspec.field(default_factory=list)
    #: Environment added to the child's (values may say ``${VAR}``).
    env: dict[str, str] = msgspec.field(default_factory=dict)
    #: A Streamable HTTP server's endpoint.
    url: str = ""
    #: Sent to the upstream on every request (values may say ``${VAR}``): the gateway's
    #: credential, never shown to clients.
    headers: dict[str, str] = msgspec.field(default_factory=dict)
    #: A ``tools/call``'s deadline unless the client's ``X-Request-Timeout-Ms`` ends first.
    timeout_ms: int = 30_000
    #: A stdio server that exits is started again after this, doubling to ``restart_max_ms``.
    restart_ms: int = 500
    restart_max_ms: int = 30_000
    #: A credential per tenant (an HTTP server): each tenant named here has its own
    #: upstream session with its own headers; the others use ``headers``.
    tenants: dict[str, McpTenantCredential] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if bool(self.command) == bool(self.url):
            raise field_error("command", "set exactly one of `command` (stdio) or `url` (HTTP)")
        if self.url and not self.url.startswith(("http://", "https://")):
            raise field_error("url", f"must be an http:// or https:// URL, got {self.url[:80]!r}")
        if self.headers and not self.url:
            raise field_error("headers", "only an HTTP server (`url`) takes headers")
        for name in self.headers:
            if name.lower() in _OWN_HEADERS:
                raise field_error(f"headers.{name}", "is set by the gateway")
        for key in ("timeout_ms", "restart_ms", "restart_max_ms"):
            if getattr(self, key) <= 0:
                raise field_error(key, "must be positive")
        if self.tenants and not self.url:
            raise field_error("tenants", "only an HTTP server (`url`) takes a tenant's headers")
        for tenant in self.tenants:
            as_field(f"tenants.{tenant}", check_tenant, tenant)

    def for_tenant(self, tenant: str) -> McpServerConfig:
        """The server as ``tenant``'s calls reach it (its headers over the server's)."""
        own = self.tenants[tenant].headers
        return msgspec.structs.replace(self, headers={**self.headers, **own}, tenants={})

    @property
    def transport(self) -> str:
        return "stdio" if self.command else "http"


class McpConfig(Section):
    """``[mcp]``: off (no ``/mcp``) unless a server is named."""

    #: The upstream MCP servers by name (``[mcp.servers.NAME]``); the name prefixes
    #: their tools (``NAME__tool``).
    servers: dict[str, McpServerConfig] = msgspec.field(default_factory=dict)
    #: Policies (``[policies.NAME]`` or built-in names) whose redaction applies to a
    #: tool call's arguments going out and its text results coming back.
    policies: list[str] = msgspec.field(default_factory=list)
    #: A result (its JSON) longer than this many bytes has its text cut, with a marker.
    max_result_bytes: int = 262_144
    #: A request body larger than this is refused before it is decoded.
    max_message_bytes: int = 1_048_576
    #: Messages in one JSON-RPC batch at most.
    max_batch: int = 32
    #: Sessions ended by ``DELETE`` a worker remembers (to answer them 404), the newest;
    #: live sessions cost nothing (their ids are signed, mcp/sessions.py).
    max_sessions: int = 10_000

    def __post_init__(self) -> None:
        for name in self.servers:
            if not NAME_RE.match(name):
                why = f"must match {NAME_RE.pattern} (it prefixes the tools' names), got {name!r}"
                raise field_error(f"servers.{name}", why)
        for key in ("max_result_bytes", "max_message_bytes", "max_batch", "max_sessions"):
            if getattr(self, key) <= 0:
                raise field_error(key, "must be positive")


def expand_env(value: str) -> str:
    """``value`` with each ``${VAR}`` replaced by the environment's value.

    Raises:
        KeyError: naming a variable that is not set (the server is then down, not
            called with a half credential).
    """

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in os.environ:
            raise KeyError(f"${{{name}}} is not set")
        return os.environ[name]

    return _ENV_RE.sub(one, value)
