"""What a web page may not make the operator's browser do to the gateway (sans-IO).

With auth off (the embedded default, local use) the admin, console, debug and
session endpoints answer clients on loopback, and the operator's browser is one:
any page it opens could drive them. Three rules close that, checked by the gate
on those endpoints (:data:`GUARDED` kinds) before anything else runs:

- a body is ``application/json`` or ``application/toml``: anything a page may
  send cross-origin without a preflight (``text/plain``, a form) is refused;
- an ``Origin`` must be the gateway's own (the ``Host`` it was reached by) or one
  of ``[cors] allow_origins`` (``"*"`` does not count here); without ``Origin``,
  a browser's ``Sec-Fetch-Site`` must say the request is not from another site;
- with auth off, ``Host`` must be a loopback name or address, or one of
  ``[server] allowed_hosts``: a page whose own name was re-pointed at 127.0.0.1
  (DNS rebinding) is same-origin with itself, not with the gateway.

With auth on, the key is what stops a page (a browser sends one cross-origin only
after a preflight the CORS table answers); the first two rules still hold.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from ..core.errors import Forbidden, UnsupportedMediaType

#: Bodies the guarded endpoints take: neither can be sent cross-origin without a preflight.
BODY_TYPES = frozenset({"application/json", "application/toml"})
#: Methods whose request may carry a body.
_WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
#: ``Sec-Fetch-Site`` values of a request that no other site's page started.
_OWN_SITE = frozenset({"same-origin", "none"})


@dataclass(frozen=True, slots=True)
class BrowserGuard:
    """The rules above for one config."""

    #: Auth on: ``Host`` and the client's address are not checked.
    auth_enabled: bool
    #: ``[cors] allow_origins`` without ``"*"``.
    origins: frozenset[str] = frozenset()
    #: ``[server] allowed_hosts``.
    hosts: frozenset[str] = frozenset()

    def check(
        self, method: str, headers: dict[str, str], client: str | None, *, admin: bool
    ) -> None:
        """Refuse what a page in a browser may have sent.

        Args:
            headers: the request's headers (lower-case names).
            client: the connection's peer address (None: unknown).
            admin: an admin, console or debug endpoint: with auth off, only a client
                on loopback may call it.

        Raises:
            Forbidden: auth is off and the client or ``Host`` is not local, or the
                ``Origin`` (``Sec-Fetch-Site``) is another site's.
            UnsupportedMediaType: a body that is neither JSON nor TOML.
        """
        host = headers.get("host")  # hypercorn puts HTTP/2's :authority here
        if not self.auth_enabled:
            if admin and not is_loopback(client):
                raise Forbidden(
                    "with auth off, this endpoint answers only clients on loopback",
                    code="loopback_only",
                )
            if host is not None and not self.local_host(host):
                raise Forbidden(
                    f"with auth off, this endpoint answers only a loopback Host or one of "
                    f"[server] allowed_hosts; got {host[:100]!r}",
                    code="host_not_allowed",
                )
        origin = headers.get("origin")
        if origin is not None:
            own = host is not None and origin.partition("://")[2] == host.lower()
            if not own and origin not in self.origins:
                raise Forbidden(
                    f"requests from pages on {origin[:100]!r} may not call this endpoint; "
                    "list the page's origin in [cors] allow_origins",
                    code="origin_not_allowed",
                )
        elif headers.get("sec-fetch-site", "none") not in _OWN_SITE:
            raise Forbidden(
                "requests from pages on other sites may not call this endpoint",
                code="origin_not_allowed",
            )
        if method in _WRITES and _has_body(headers):
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype not in BODY_TYPES:
                raise UnsupportedMediaType(
                    "the body must be application/json or application/toml; "
                    f"got {ctype[:60] or 'no Content-Type'}"
                )

    def local_host(self, host: str) -> bool:
        """Whether the ``Host`` header ``host`` names this machine (or an allowed host)."""
        name = _hostname(host)
        return name in self.hosts or is_loopback(name) or _loopback_name(name)


def _has_body(headers: dict[str, str]) -> bool:
    length = headers.get("content-length")
    return "transfer-encoding" in headers or "content-type" in headers or length not in (None, "0")


def _hostname(host: str) -> str:
    """``host`` of a ``Host`` header, without its port, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _loopback_name(name: str) -> bool:
    name = name.rstrip(".")
    return name == "localhost" or name.endswith(".localhost")


def is_loopback(address: str | None) -> bool:
    """Whether ``address`` is a loopback IP address (``[::1]`` included)."""
    if not address:
        return False  # a transport without an address (unix socket): not provably local
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False
