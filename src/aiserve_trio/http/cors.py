"""CORS for pages on other origins (``[cors]``), sans-IO: which headers, which answer.

The app asks two things of :class:`Cors` per request, before the gate:

- :meth:`Cors.response_headers`, once: the headers every response head to this
  request carries (the :class:`~.responder.Responder` adds them to whatever it
  sends, JSON, error envelope or event stream): ``Access-Control-Allow-Origin``
  and ``Access-Control-Expose-Headers`` for an allowed origin, and always
  ``Vary: Origin`` when the answer depends on the origin;
- :meth:`Cors.is_preflight` / :meth:`Cors.preflight`: an ``OPTIONS`` with
  ``Origin`` and ``Access-Control-Request-Method`` is answered here, 204 or a
  403 envelope, without a key, an admission slot or the pipeline. The answer is
  the same for every path, so a preflight does not tell which paths exist.

Requests from an origin that is not allowed are served as usual, without the
allow headers: the browser withholds the answer from the page.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..core.errors import Forbidden
from .settings import CorsConfig
from .types import Headers

_ALLOW_ORIGIN = b"access-control-allow-origin"
_VARY = (b"vary", b"origin")


class Cors:
    """The CORS policy of one app, from ``[cors]`` and the methods its endpoints take."""

    __slots__ = ("_any", "_expose", "_origins", "_preflight", "allow_headers", "methods")

    def __init__(self, config: CorsConfig, methods: Iterable[str]) -> None:
        self._any = config.allow_origins == ["*"]
        self._origins = frozenset(config.allow_origins)
        self.allow_headers = frozenset(config.allow_headers)
        self.methods = frozenset(methods)
        self._expose = (b"access-control-expose-headers", ", ".join(config.expose_headers).encode())
        self._preflight: Headers = [
            (b"access-control-allow-methods", ", ".join(sorted(self.methods)).encode()),
            (b"access-control-allow-headers", ", ".join(config.allow_headers).encode()),
            (b"access-control-max-age", str(config.max_age_s).encode()),
        ]

    def allows(self, origin: str) -> bool:
        return self._any or origin in self._origins

    def response_headers(self, origin: str | None) -> Headers:
        """The CORS headers of every response to a request with this ``Origin``."""
        if self._any:
            return [(_ALLOW_ORIGIN, b"*"), self._expose]
        if origin is None or origin not in self._origins:
            return [_VARY]
        return [(_ALLOW_ORIGIN, origin.encode("latin-1")), _VARY, self._expose]

    @staticmethod
    def is_preflight(method: str, headers: dict[str, str]) -> bool:
        return method == "OPTIONS" and "origin" in headers and (
            "access-control-request-method" in headers
        )

    def preflight(self, headers: dict[str, str]) -> Headers:
        """The headers a 204 answer to this preflight adds to :meth:`response_headers`.

        Raises:
            Forbidden: the origin, the method or a requested header is not allowed.
        """
        origin = headers["origin"]
        if not self.allows(origin):
            raise Forbidden(
                f"origin {origin[:100]!r} may not call this API (see [cors] allow_origins)",
                code="cors_origin_not_allowed",
            )
        method = headers["access-control-request-method"].strip()
        if method not in self.methods:
            raise Forbidden(
                f"method {method[:20]!r} is not one of {', '.join(sorted(self.methods))}",
                code="cors_method_not_allowed",
            )
        asked_for = headers.get("access-control-request-headers", "")
        asked = (h.strip().lower() for h in asked_for.split(","))
        refused = ", ".join(h for h in asked if h and h not in self.allow_headers)
        if refused:
            raise Forbidden(
                f"request headers not allowed (see [cors] allow_headers): {refused[:200]}",
                code="cors_header_not_allowed",
            )
        return self._preflight
