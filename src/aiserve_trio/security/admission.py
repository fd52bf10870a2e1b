"""Admission control: per-worker caps on requests in flight and open streams.

Beyond a cap the gateway answers at once with 503 and ``Retry-After`` instead
of queueing: a queue only turns overload into timeouts for everyone, while a
fast refusal lets a load balancer or the client go elsewhere. The check runs
on the request head, before a byte of the body is read. Counting is sans-IO.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import Overloaded


class Admission:
    """Counts requests in flight and open streams in one worker."""

    __slots__ = ("inflight", "max_inflight", "max_streams", "retry_after_s", "shed", "streams")

    def __init__(self, max_inflight: int, max_streams: int, retry_after_s: int = 1) -> None:
        self.max_inflight = max_inflight
        self.max_streams = max_streams
        self.retry_after_s = retry_after_s
        self.inflight = 0
        self.streams = 0
        #: Requests refused so far (for logs and tests).
        self.shed = 0

    def _refuse(self, what: str, cap: int) -> Overloaded:
        self.shed += 1
        return Overloaded(
            f"the gateway is at its limit of {cap} {what}; retry shortly",
            headers={"Retry-After": str(self.retry_after_s)},
        )

    @contextmanager
    def request(self) -> Iterator[None]:
        """Hold one in-flight slot for the block.

        Raises:
            Overloaded: ``max_inflight`` requests are already in flight.
        """
        if self.inflight >= self.max_inflight:
            raise self._refuse("requests in flight", self.max_inflight)
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1

    def open_stream(self) -> None:
        """Take a stream slot; pair with :meth:`close_stream`.

        Raises:
            Overloaded: ``max_streams`` streams are already open.
        """
        if self.streams >= self.max_streams:
            raise self._refuse("open streams", self.max_streams)
        self.streams += 1

    def close_stream(self) -> None:
        self.streams -= 1

    @contextmanager
    def stream(self) -> Iterator[None]:
        """Hold one stream slot for the block (see :meth:`open_stream`)."""
        self.open_stream()
        try:
            yield
        finally:
            self.close_stream()
