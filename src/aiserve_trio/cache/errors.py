"""The cache's errors (GatewayErrors, as every error of the gateway is)."""

from __future__ import annotations

from ..core.errors import Overloaded, StageDeadlineExceeded, UpstreamError


class CacheUnavailable(Overloaded):
    """The cache's backend failed or did not answer in time.

    Never reaches a client: the request goes on without the cache, and the
    failure is counted (``aiserve_cache_backend_errors_total``).
    """

    default_code = "cache_unavailable"


class SharedReplyLost(UpstreamError):
    """The answer this request shared with identical ones broke off midway.

    Another gateway was producing it and went away after this request had
    received part of it: a second, different answer cannot be spliced on.
    """

    default_code = "shared_reply_lost"


class FlightLate(StageDeadlineExceeded):
    """The answer shared with identical requests did not finish within their time
    (the latest of their inference deadlines, up to what the backend was told).

    A request that still has time and received nothing takes over.
    """

    def __init__(self) -> None:
        super().__init__(
            "inference",
            "the answer shared with identical requests did not finish within their time",
        )
