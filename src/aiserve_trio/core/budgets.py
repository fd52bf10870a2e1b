"""Deadline and stage-budget arithmetic (pure: no I/O, no clock reads).

One request has one absolute deadline, fixed when it arrives::

    deadline = arrival + min(client timeout, route max) - reserve

The time ``T = deadline - arrival`` is carved in pipeline order into cumulative
cut points: the context stage (parse, session context, input policies) must be
done by ``arrival + T * context``, the last upstream token must arrive by
``arrival + T * (context + inference)``, and the stream must be closed by the
deadline. Time a stage does not use rolls over to the next, because each cut
point is absolute rather than a per-stage duration.

``[deadline]`` and ``[budgets]`` (:class:`DeadlineConfig`, :class:`BudgetsConfig`)
are the settings these are computed from.

Two more points, for shedding under overload (both off by default): the *queue
end*, ``arrival + T * queue_share``, past which a request that has not yet reached
its upstream call is refused with 503 and ``Retry-After`` rather than answered
late; and a stream's *first-byte end*, ``arrival + ttft_ms``, by which its upstream
must have started answering (:meth:`Budget.shed`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .decoding import Section, field_error, not_above, positive
from .errors import BadRequest

TIMEOUT_HEADER = "x-request-timeout-ms"
#: How far ``[budgets]`` shares may sum from 1.
BUDGET_TOLERANCE = 0.001
#: The pipeline's stages in order: the cut points below are theirs.
STAGES = ("parse", "context", "inference", "sse")


@dataclass(frozen=True, slots=True)
class Budget:
    """The absolute cut points (in ``trio.current_time()`` seconds) of one request."""

    arrival: float
    context_end: float
    inference_end: float
    deadline: float
    #: Kept back after ``deadline`` to frame and send a final error event.
    reserve: float
    min_inference: float
    #: Past this, a request still waiting to reach its upstream call is shed (inf: never).
    queue_end: float = math.inf
    #: A stream's upstream must have answered by this, or the stream is shed (inf: never).
    first_byte_end: float = math.inf

    def shed(self, now: float, *, stream: bool) -> str | None:
        """Why a request that has not yet started its upstream call at ``now`` is to be
        shed: ``"queue"`` (it waited past its queue budget), ``"ttft"`` (a stream whose
        first byte can no longer come within its TTFT budget), or None."""
        if now >= self.queue_end:
            return "queue"
        if stream and now >= self.first_byte_end:
            return "ttft"
        return None

    def cut(self, stage: str) -> float:
        """The cut point of ``stage`` (parse shares the context cut)."""
        if stage in ("parse", "context"):
            return self.context_end
        if stage == "inference":
            return self.inference_end
        if stage == "sse":
            return self.deadline
        raise ValueError(f"unknown stage {stage!r}")

    @property
    def total(self) -> float:
        return self.deadline - self.arrival


def plan(
    arrival: float,
    timeout_ms: int,
    *,
    reserve_ms: int,
    min_inference_ms: int,
    context: float,
    inference: float,
    queue_share: float = 0.0,
    ttft_ms: int = 0,
) -> Budget:
    """Compute a request's budget.

    Args:
        arrival: when the request arrived (clock seconds).
        timeout_ms: the effective request timeout, already capped by the route.
        reserve_ms: time kept back from the deadline.
        min_inference_ms: the least time worth starting an upstream call with.
        context, inference: the shares of the first two stages (the sse
            stage gets the rest, so the shares need not be re-checked here).
        queue_share: the share of the request time it may wait before its upstream
            call starts (0: no queue budget).
        ttft_ms: the time a stream's first byte may take (0: no TTFT budget).
    """
    total = max(0.0, (timeout_ms - reserve_ms) / 1000.0)
    return Budget(
        queue_end=arrival + total * queue_share if queue_share else math.inf,
        first_byte_end=arrival + ttft_ms / 1000.0 if ttft_ms else math.inf,
        arrival=arrival,
        context_end=arrival + total * context,
        inference_end=arrival + total * (context + inference),
        deadline=arrival + total,
        reserve=reserve_ms / 1000.0,
        min_inference=min_inference_ms / 1000.0,
    )


def effective_timeout_ms(
    header: str | None, *, default_ms: int, max_ms: int, reserve_ms: int
) -> int:
    """The request timeout: the client's ``X-Request-Timeout-Ms`` capped at ``max_ms``.

    Raises:
        BadRequest: the header is not a whole number of milliseconds greater
            than the reserve.
    """
    if header is None:
        return min(default_ms, max_ms)
    value = header.strip()
    if not value.isascii() or not value.isdigit() or len(value) > 12:
        raise BadRequest(
            f"`X-Request-Timeout-Ms` must be a whole number of milliseconds, got {header[:40]!r}",
            param="X-Request-Timeout-Ms",
            code="invalid_timeout",
        )
    ms = int(value)
    if ms <= reserve_ms:
        raise BadRequest(
            f"`X-Request-Timeout-Ms` must exceed the gateway's reserve of {reserve_ms} ms",
            param="X-Request-Timeout-Ms",
            code="invalid_timeout",
        )
    return min(ms, max_ms)


# --- settings: [deadline] and [budgets] --------------------------------------------


class DeadlineConfig(Section):
    #: Request time when the client sends no ``X-Request-Timeout-Ms``.
    default_ms: int = 30_000
    #: Upper bound on any client-requested timeout.
    max_ms: int = 120_000
    #: Kept back from the deadline for scheduling and framing the final event.
    reserve_ms: int = 100
    #: Fail fast instead of starting an upstream call with less time than this.
    min_inference_ms: int = 50
    #: Shed (503, Retry-After) a request that waited longer than this share of its
    #: deadline before its upstream call could start (0: off).
    queue_share: float = 0.0
    #: Shed a stream whose upstream has not started answering this long after it
    #: arrived (0: off).
    ttft_ms: int = 0
    #: Chat requests starting at once in a worker (body, parse, context, up to their
    #: upstream call); the others wait their turn in arrival order, until their queue
    #: budget or context cut (0: no queue; ``http/turns.py``).
    max_starting: int = 128
    #: The fewest the worker lets start at once when its CPU is the bottleneck: between
    #: the two, the bound follows the worker's CPU (``http/turns.py``, ``Pace``); equal
    #: to ``max_starting`` (or above it): a fixed bound.
    min_starting: int = 16

    def __post_init__(self) -> None:
        positive(self, "default_ms", "max_ms")
        if not 0.0 <= self.queue_share <= 1.0:
            raise field_error("queue_share", f"must be in [0, 1], got {self.queue_share}")
        for key in ("reserve_ms", "min_inference_ms", "ttft_ms", "max_starting", "min_starting"):
            if getattr(self, key) < 0:
                raise field_error(key, "must not be negative")
        not_above(self, "default_ms", "max_ms")
        if self.reserve_ms >= self.default_ms:
            raise field_error("reserve_ms", "must be smaller than deadline.default_ms")


class BudgetsConfig(Section):
    context: float = 0.40
    inference: float = 0.35
    sse: float = 0.25

    def __post_init__(self) -> None:
        shares = {"context": self.context, "inference": self.inference, "sse": self.sse}
        for key, share in shares.items():
            if not 0.0 < share <= 1.0:
                raise field_error(key, f"must be in (0, 1], got {share}")
        total = sum(shares.values())
        if abs(total - 1.0) > BUDGET_TOLERANCE:
            raise ValueError(f"shares must sum to 1.0 (±{BUDGET_TOLERANCE}), got {total:.4f}")
