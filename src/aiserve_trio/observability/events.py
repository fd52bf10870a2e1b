"""The one event hook the request path reports through (like httpcore's trace hook).

Code on the request path never touches Prometheus, OpenTelemetry, the baseline
or the debug list itself: it calls one of the :class:`Hook` methods at the
moments that matter, and one sink (``observer.RequestObserver``) feeds all of
them. Tests pass a recording hook; a component built without one gets
:data:`NULL_HOOK`, which does nothing.

The moments:

- a stage started / ended (live: the per-stage task gauge moves with them);
- an upstream attempt (a context manager around one try), a retry about to
  happen, the upstream error that ends a request, a TLS handshake (full or resumed);
- a request complete, with its immutable outcome: that method is declared next to
  the outcome it carries (``stages/outcome.py``'s ``RequestHook``), so this module
  names nothing of the stages;
- the response cache's backend failing, and what became of a finished answer
  (stored, or why not).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..core.errors import UpstreamError


class UpstreamHook(Protocol):
    """What an adapter reports: attempts, retries, the error that ends a request."""

    def attempt(self, adapter: str, number: int) -> AbstractContextManager[None]:
        """Wraps one upstream try (``number`` from 1); an exception through it marks it failed."""
        ...

    def retrying(self, adapter: str, error: UpstreamError) -> None:
        """A retryable ``error`` happened before the first token; another try follows."""
        ...

    def failed(self, adapter: str, error: UpstreamError) -> None:
        """``error`` ends the request's upstream call (no more tries)."""
        ...

    def tls_handshake(self, adapter: str, kind: str) -> None:
        """A TLS handshake with the backend finished: ``full``, or ``resumed`` (a session)."""
        ...


class CacheHook(Protocol):
    """What the response cache reports besides each request's result."""

    def cache_error(self, op: str) -> None:
        """A backend call (``get``, ``claim``, ``publish``...) failed, timed out, or
        was skipped while the backend is down; the request went on without it."""
        ...

    def cache_stored(self, route: str, result: str) -> None:
        """A finished answer was ``stored``, or not: ``unfinished``, ``refused``,
        ``capped``, ``too_large``."""
        ...

    def cache_similarity(self, route: str, similarity: float, result: str) -> None:
        """A semantic lookup's nearest question under the guard: its similarity, and
        whether it was served (``hit``) or below the threshold (``miss``)."""
        ...


class Hook(UpstreamHook, CacheHook, Protocol):
    """Everything the request path reports but the outcome (``stages.outcome.RequestHook``)."""

    def stage_started(self, stage: str) -> None:
        """A stage task began (before it has its input)."""
        ...

    def stage_ended(self, stage: str, worked: float | None, expired: str | None) -> None:
        """A stage task ended.

        Args:
            worked: seconds from getting its input to its end; None if it never got any.
            expired: what ran out of time, when it ended by a deadline: the stage (its
                cut point passed, or it refused to start with too little left) or the
                chain step whose share ran out.
        """
        ...


class NullHook:
    """A hook that records nothing."""

    @contextmanager
    def attempt(self, adapter: str, number: int) -> Iterator[None]:
        yield

    def retrying(self, adapter: str, error: UpstreamError) -> None:
        pass

    def failed(self, adapter: str, error: UpstreamError) -> None:
        pass

    def tls_handshake(self, adapter: str, kind: str) -> None:
        pass

    def stage_started(self, stage: str) -> None:
        pass

    def stage_ended(self, stage: str, worked: float | None, expired: str | None) -> None:
        pass

    def cache_error(self, op: str) -> None:
        pass

    def cache_stored(self, route: str, result: str) -> None:
        pass

    def cache_similarity(self, route: str, similarity: float, result: str) -> None:
        pass


NULL_HOOK = NullHook()
