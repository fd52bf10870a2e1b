"""Retries before the first token: which errors, how long to wait, when to give up.

A retry is only safe while the client has seen nothing of the reply: once a
delta has gone into the channel, a second attempt would stream a different
answer after the first one's opening. :class:`Progress` records that moment and
:func:`run_with_retries` stops retrying from then on.

The wait is "full jitter" exponential backoff (uniform in ``[0, min(cap, base *
2**n)]``), or the upstream's ``Retry-After`` when it sent one; a wait that would
pass the request's deadline is not started -- the error is raised instead, so
the client hears the real cause rather than a timeout.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from ..errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
)
from ..observability.tracing import upstream_attempt

#: Upstream statuses worth another attempt: rate limited, and the 5xx family.
RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_retries: int
    base: float
    cap: float

    def delay(self, retry: int, retry_after: float | None, rng: random.Random) -> float:
        """Seconds to wait before retry number ``retry`` (0-based).

        ``Retry-After`` wins when given (the upstream knows its own recovery
        time); otherwise full jitter over the exponential step.
        """
        if retry_after is not None:
            return max(0.0, retry_after)
        return rng.uniform(0.0, min(self.cap, self.base * 2**retry))


def is_retryable(err: UpstreamError) -> bool:
    """Connect failures, connect-phase timeouts, 429 and 5xx statuses."""
    if isinstance(err, UpstreamStatusError):
        return err.upstream_status in RETRYABLE_STATUSES
    return isinstance(err, UpstreamConnectError | UpstreamTimeout)


class Progress:
    """Whether the current request has sent a delta to the client yet."""

    __slots__ = ("started",)

    def __init__(self) -> None:
        self.started = False


async def run_with_retries(
    attempt: Callable[[Progress], Awaitable[None]],
    *,
    policy: RetryPolicy,
    deadline: float,
    rng: random.Random,
    on_retry: Callable[[UpstreamError], None] | None = None,
) -> int:
    """Run ``attempt`` until it succeeds, retrying retryable errors before the first token.

    Args:
        attempt: one upstream call; it sets ``progress.started`` when it sends
            its first delta.
        policy: how many retries and how long to wait.
        deadline: absolute ``trio.current_time()``; no wait is started that
            would end after it.
        rng: jitter source (seeded in tests).
        on_retry: called with the error before each wait (metrics).

    Returns:
        The number of attempts made.

    Raises:
        UpstreamError: the last attempt's error, when it may not or need not be retried.
    """
    progress = Progress()
    retries = 0
    while True:
        try:
            with upstream_attempt(retries + 1) as span:
                try:
                    await attempt(progress)
                except UpstreamError as err:
                    span.set_attribute("aiserve.error_code", err.code or err.type)
                    raise
            return retries + 1
        except UpstreamError as err:
            if progress.started or retries >= policy.max_retries or not is_retryable(err):
                raise
            retry_after = err.retry_after if isinstance(err, UpstreamStatusError) else None
            wait = policy.delay(retries, retry_after, rng)
            if trio.current_time() + wait >= deadline:
                raise
            if on_retry is not None:
                on_retry(err)
            retries += 1
        await trio.sleep(wait)


async def run_reporting(
    attempt: Callable[[Progress], Awaitable[None]],
    *,
    policy: RetryPolicy,
    deadline: float,
    rng: random.Random,
    on_retry: Callable[[UpstreamError], None] | None,
    on_error: Callable[[UpstreamError], None] | None,
) -> int:
    """:func:`run_with_retries`, reporting the error that ends the request to ``on_error``."""
    try:
        return await run_with_retries(
            attempt, policy=policy, deadline=deadline, rng=rng, on_retry=on_retry
        )
    except UpstreamError as err:
        if on_error is not None:
            on_error(err)
        raise
