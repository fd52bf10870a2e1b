"""``[cors]``: which pages on other origins may call the API (``cors.py`` answers them).

A leaf module (msgspec and the decoding helpers): the config imports it.
"""

from __future__ import annotations

import re

import msgspec

from ..core.decoding import Section, field_error

#: ``[cors] allow_headers`` by default: what the API's browser clients send.
CORS_ALLOW_HEADERS = (
    "authorization",
    "content-type",
    "x-session-id",
    "x-channel",
    "x-request-timeout-ms",
    "last-event-id",
)
#: ``[cors] expose_headers`` by default: the response headers a page may read.
CORS_EXPOSE_HEADERS = (
    "x-request-id",
    "x-aiserve-degraded",
    "x-aiserve-trimmed-messages",
    "x-aiserve-cache",
    "x-aiserve-session-events",
    "traceresponse",
    "retry-after",
    "x-aiserve-deployment",
    "x-aiserve-fallback",
    "x-aiserve-steps",
    "x-aiserve-cost",
    "x-aiserve-cache-similarity",
    "x-aiserve-dropped",
)
_HEADER_NAME_RE = re.compile(r"^[a-z0-9!#$%&'*+.^_`|~-]+$")
_ORIGIN_RE = re.compile(
    r"^(?P<scheme>https?)://(?P<host>[^/:?#\[\]@]+|\[[0-9a-f:.]+\])(?::(?P<port>\d{1,5}))?$"
)


def _origin_problem(origin: str) -> str | None:
    """Why ``origin`` can never equal a browser's ``Origin`` header, or None."""
    if origin != origin.lower():
        return f"write {origin!r} in lower case, as browsers send it"
    m = _ORIGIN_RE.match(origin.rstrip("/"))
    if m is None:
        return f"must be scheme://host[:port] (http or https), got {origin!r}"
    if origin.endswith("/"):
        return f"an origin has no path, not even '/': {origin.rstrip('/')!r}"
    if m["port"] is not None and int(m["port"]) == {"http": 80, "https": 443}[m["scheme"]]:
        return f"browsers leave out the default port: {origin.rsplit(':', 1)[0]!r}"
    return None


class CorsConfig(Section):
    """Pages on other origins (off unless the ``[cors]`` table is there)."""

    #: Exact origins (``https://app.example.com``, ``http://127.0.0.1:3000``); ``["*"]``:
    #: any origin, refused while auth is on.
    allow_origins: list[str]
    #: Request headers a page may send (a preflight asking for others is refused).
    allow_headers: list[str] = msgspec.field(default_factory=lambda: list(CORS_ALLOW_HEADERS))
    #: Response headers a page may read (besides the CORS-safelisted ones).
    expose_headers: list[str] = msgspec.field(default_factory=lambda: list(CORS_EXPOSE_HEADERS))
    #: How long a browser may reuse a preflight's answer.
    max_age_s: int = 600

    def __post_init__(self) -> None:
        if not self.allow_origins:
            raise field_error("allow_origins", 'must name at least one origin (or "*")')
        for i, origin in enumerate(self.allow_origins):
            if origin == "*":
                if len(self.allow_origins) > 1:
                    raise field_error(f"allow_origins[{i}]", '"*" must be alone in the list')
                continue
            why = _origin_problem(origin)
            if why is not None:
                raise field_error(f"allow_origins[{i}]", why)
        for key in ("allow_headers", "expose_headers"):
            for i, name in enumerate(getattr(self, key)):
                if not _HEADER_NAME_RE.match(name):
                    why = f"not a lower-case header name: {name!r}"
                    raise field_error(f"{key}[{i}]", why)
        if self.max_age_s < 0:
            raise field_error("max_age_s", "must not be negative")
