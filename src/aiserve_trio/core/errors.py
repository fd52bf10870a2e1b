"""The gateway's exception hierarchy.

Every error a client can see is a :class:`GatewayError`: it carries its HTTP
status and the OpenAI error envelope fields (``type``, ``code``, ``param``).
Before the first response byte it becomes an HTTP error response; after the
stream has started it becomes a final SSE ``data: {"error": ...}`` event.
Library exceptions are translated into these at the boundary where they occur
(``raise Ours(...) from exc``); nothing above an adapter sees an HTTP-client or
Redis exception.
"""

from __future__ import annotations

from typing import ClassVar


class GatewayError(Exception):
    """Base class: an error with an HTTP status and an OpenAI error envelope."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    default_code: ClassVar[str | None] = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.headers = headers or {}


class InternalError(GatewayError):
    """An unexpected failure inside the gateway (the detail is logged, not sent)."""

    status = 500
    type = "server_error"
    default_code = "internal_error"


# --- client errors -----------------------------------------------------------


class BadRequest(GatewayError):
    """The request is malformed: bad JSON, a wrong type, a missing field."""

    status = 400
    type = "invalid_request_error"


class Unauthorized(GatewayError):
    """No valid credentials were presented."""

    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"


class Forbidden(GatewayError):
    """The credentials are valid but do not allow this request."""

    status = 403
    type = "permission_error"


class PolicyViolation(GatewayError):
    """An input policy blocked the request; ``code`` names the policy."""

    status = 403
    type = "policy_violation"


class NotFound(GatewayError):
    """No route serves this path."""

    status = 404
    type = "invalid_request_error"
    default_code = "unknown_url"


class MethodNotAllowed(GatewayError):
    """The path exists but not for this HTTP method."""

    status = 405
    type = "invalid_request_error"
    default_code = "method_not_allowed"


class Conflict(GatewayError):
    """The request conflicts with one already under way (e.g. a second profile of a worker)."""

    status = 409
    type = "invalid_request_error"
    default_code = "conflict"


class PayloadTooLarge(GatewayError):
    """The request body is larger than ``limits.max_body_bytes``."""

    status = 413
    type = "invalid_request_error"
    default_code = "request_too_large"


class UnsupportedMediaType(GatewayError):
    """The request body is not ``application/json``."""

    status = 415
    type = "invalid_request_error"
    default_code = "unsupported_media_type"


class Unprocessable(GatewayError):
    """The request is well-formed but its values are not acceptable."""

    status = 422
    type = "invalid_request_error"


class RateLimited(GatewayError):
    """Too many requests; ``Retry-After`` says when to come back."""

    status = 429
    type = "rate_limit_error"
    default_code = "rate_limit_exceeded"


class BudgetExceeded(GatewayError):
    """The API key's or its tenant's spend budget for the period is spent.

    ``param`` names the budget (``key:<id>`` or ``tenant:<name>``), the message
    says when it resets, and ``Retry-After`` carries the seconds until then (none
    for a ``total`` budget, which never resets).
    """

    status = 429
    type = "insufficient_quota"
    default_code = "budget_exceeded"


# --- server side ----------------------------------------------------------------


class Overloaded(GatewayError):
    """The gateway sheds load or is not ready; retry later."""

    status = 503
    type = "server_error"
    default_code = "overloaded"


class Shed(Overloaded):
    """A request shed under overload (``[deadline] queue_share``, ``ttft_ms``): it waited
    past its queue budget, or it is a stream whose first byte cannot come within its
    TTFT budget. ``reason`` is ``"queue"`` or ``"ttft"`` (the metric's label)."""

    default_code = "shed"

    def __init__(self, reason: str, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})
        self.reason = reason


class ReplyCapExceeded(GatewayError):
    """A reply passed one of its route's caps (``max_reply_bytes``, ``max_stream_s``);
    ``code`` and ``param`` name the cap. The upstream is stopped."""

    status = 502
    type = "server_error"
    default_code = "reply_cap_exceeded"


class StageDeadlineExceeded(GatewayError):
    """A pipeline stage did not finish by its cut point; ``param`` names the stage."""

    status = 504
    type = "timeout"
    default_code = "stage_deadline_exceeded"

    def __init__(self, stage: str, message: str | None = None) -> None:
        super().__init__(
            message or f"the {stage} stage did not finish within its deadline budget",
            param=stage,
        )
        self.stage = stage


class StepDeadlineExceeded(StageDeadlineExceeded):
    """A chain step did not finish by its cut point (``chains/``); ``param`` names the step."""

    default_code = "step_deadline_exceeded"

    def __init__(self, step: str, message: str | None = None) -> None:
        super().__init__(
            step,
            message or f"the chain step {step!r} did not finish within its share of the budget",
        )
        self.step = step


class UpstreamError(GatewayError):
    """The model backend failed. Subclasses say how."""

    status = 502
    type = "upstream_error"
    default_code = "upstream_error"


class UpstreamTimeout(UpstreamError):
    """The model backend did not answer in time."""

    status = 504
    type = "timeout"
    default_code = "upstream_timeout"


class UpstreamConnectError(UpstreamError):
    """The model backend could not be reached."""

    default_code = "upstream_connect_error"


class UpstreamTLSError(UpstreamConnectError):
    """TLS with the model backend failed: an unknown CA, an expired certificate, a name
    mismatch, a refused client certificate, no TLS version in common. Retried and
    failed over like a connect error; the message names the adapter and the reason."""

    default_code = "upstream_tls_error"


class UpstreamProtocolError(UpstreamError):
    """The model backend sent something that is not the protocol it should speak."""

    default_code = "upstream_protocol_error"


class UpstreamStatusError(UpstreamError):
    """The model backend answered with an error status (kept in ``upstream_status``)."""

    default_code = "upstream_status_error"

    def __init__(
        self,
        message: str,
        *,
        upstream_status: int,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.upstream_status = upstream_status
        self.retry_after = retry_after


class NoFallbackFits(UpstreamTimeout):
    """A group's tries failed and no candidate left can fit the remaining budget.

    Raised at once instead of starting a try that could not produce a first token
    before the deadline; the message names what failed and what did not fit.
    """

    default_code = "no_fallback_fits"


class NoHealthyDeployment(UpstreamError):
    """Every deployment and fallback of a group is ejected (or none can carry the request)."""

    status = 503
    default_code = "no_healthy_deployment"


class BodyReadTimeout(GatewayError):
    """The request body stopped arriving (``limits.body_read_timeout_ms`` between chunks)."""

    status = 408
    type = "timeout"
    default_code = "body_read_timeout"


class WriteTimeout(GatewayError):
    """The client took no byte of a write for ``limits.write_timeout_ms``; it is dropped."""

    status = 408
    type = "timeout"
    default_code = "write_timeout"


# --- operators ------------------------------------------------------------------


class ConfigError(Exception):
    """The configuration is missing, not TOML, or not a valid gateway config.

    The message names the file and the TOML key. Not a GatewayError: no client
    ever sees it; the server refuses to start (or a reload is refused).
    """
