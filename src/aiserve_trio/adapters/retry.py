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
from typing import Protocol

import trio

from ..core.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
)
from ..observability.events import NULL_HOOK, UpstreamHook

#: Upstream statuses worth another attempt: rate limited, and the 5xx family
#: (529: Anthropic's "overloaded").
RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504, 529})


class RetryConfig(Protocol):
    """The retry settings every retrying adapter's config table has."""

    @property
    def max_retries(self) -> int: ...
    @property
    def backoff_base_ms(self) -> int: ...
    @property
    def backoff_max_ms(self) -> int: ...


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_retries: int
    base: float
    cap: float

    @classmethod
    def from_config(cls, config: RetryConfig) -> RetryPolicy:
        """The policy ``max_retries``, ``backoff_base_ms`` and ``backoff_max_ms`` set."""
        return cls(
            max_retries=config.max_retries,
            base=config.backoff_base_ms / 1000.0,
            cap=config.backoff_max_ms / 1000.0,
        )

    def delay(self, retry: int, retry_after: float | None, rng: random.Random) -> float:
        """Seconds to wait before retry number ``retry`` (0-based).

        ``Retry-After`` wins when given (the upstream knows its own recovery
        time); otherwise full jitter over the exponential step.
        """
        if retry_after is not None:
            return max(0.0, retry_after)
        return rng.uniform(0.0, min(self.cap, self.base * 2**retry))


#: One try and no other (the mock adapter: nothing to recover from).
NO_RETRIES = RetryPolicy(max_retries=0, base=0.0, cap=0.0)


def is_retryable(err: UpstreamError) -> bool:
    """Connect failures, connect-phase timeouts, 429 and 5xx statuses."""
    if isinstance(err, UpstreamStatusError):
        return err.upstream_status in RETRYABLE_STATUSES
    return isinstance(err, UpstreamConnectError | UpstreamTimeout)


class Progress:
    """How far the current request's reply has got.

    Attributes:
        started: a delta has been sent to the client (no retry from here on).
        finished: the final delta (the one with a ``finish_reason``) has been sent.
    """

    __slots__ = ("finished", "started")

    def __init__(self) -> None:
        self.started = False
        self.finished = False


async def run_with_retries(
    attempt: Callable[[Progress], Awaitable[None]],
    *,
    policy: RetryPolicy,
    deadline: float,
    rng: random.Random,
    adapter: str = "",
    hook: UpstreamHook = NULL_HOOK,
) -> int:
    """Run ``attempt`` until it succeeds, retrying retryable errors before the first token.

    Args:
        attempt: one upstream call; it sets ``progress.started`` when it sends
            its first delta.
        policy: how many retries and how long to wait.
        deadline: absolute ``trio.current_time()``; no wait is started that
            would end after it.
        rng: jitter source (seeded in tests).
        adapter: the adapter's name, as the hook reports it.
        hook: told of each try (``attempt``, around it), each retry about to
            wait (``retrying``) and the error that ends the call (``failed``).

    Returns:
        The number of attempts made.

    Raises:
        UpstreamError: the last attempt's error, when it may not or need not be retried.
    """
    progress = Progress()
    retries = 0
    while True:
        try:
            with hook.attempt(adapter, retries + 1):
                await attempt(progress)
            return retries + 1
        except UpstreamError as err:
            if progress.started or retries >= policy.max_retries or not is_retryable(err):
                hook.failed(adapter, err)
                raise
            retry_after = err.retry_after if isinstance(err, UpstreamStatusError) else None
            wait = policy.delay(retries, retry_after, rng)
            if trio.current_time() + wait >= deadline:
                hook.failed(adapter, err)
                raise
            hook.retrying(adapter, err)
            retries += 1
        await trio.sleep(wait)
