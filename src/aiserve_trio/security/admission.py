"""Admission control: per-worker caps on requests in flight and open streams.

Beyond a cap the gateway answers at once with 503 and ``Retry-After`` instead
of queueing: a queue only turns overload into timeouts for everyone, while a
fast refusal lets a load balancer or the client go elsewhere. The check runs
on the request head, before a byte of the body is read. Counting is sans-IO.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import Overloaded, RateLimited


class Admission:
    """Counts requests in flight and open streams in one worker."""

    __slots__ = (
        "by_tenant",
        "inflight",
        "max_inflight",
        "max_streams",
        "retry_after_s",
        "shed",
        "streams",
        "tenant_max_streams",
    )

    def __init__(
        self,
        max_inflight: int,
        max_streams: int,
        retry_after_s: int = 1,
        *,
        tenant_max_streams: int = 0,
    ) -> None:
        self.max_inflight = max_inflight
        self.max_streams = max_streams
        self.retry_after_s = retry_after_s
        #: Open streams one tenant may hold (0: no cap).
        self.tenant_max_streams = tenant_max_streams
        self.inflight = 0
        self.streams = 0
        #: Open streams per tenant (only tenants that hold one).
        self.by_tenant: dict[str, int] = {}
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

    def open_stream(self, tenant: str | None = None) -> None:
        """Take a stream slot (and one of ``tenant``'s); pair with :meth:`close_stream`.

        Raises:
            Overloaded: ``max_streams`` streams are already open.
            RateLimited: ``tenant`` holds ``tenant_max_streams`` already.
        """
        if self.streams >= self.max_streams:
            raise self._refuse("open streams", self.max_streams)
        if tenant is not None and self.tenant_max_streams:
            held = self.by_tenant.get(tenant, 0)
            if held >= self.tenant_max_streams:
                self.shed += 1
                raise RateLimited(
                    f"this tenant has {held} streams open, its limit in this worker",
                    code="tenant_stream_limit",
                    headers={"Retry-After": str(self.retry_after_s)},
                )
            self.by_tenant[tenant] = held + 1
        self.streams += 1

    def close_stream(self, tenant: str | None = None) -> None:
        self.streams -= 1
        if tenant is not None and tenant in self.by_tenant:
            left = self.by_tenant[tenant] - 1
            if left:
                self.by_tenant[tenant] = left
            else:
                del self.by_tenant[tenant]

    @contextmanager
    def stream(self, tenant: str | None = None) -> Iterator[None]:
        """Hold one stream slot for the block (see :meth:`open_stream`)."""
        self.open_stream(tenant)
        try:
            yield
        finally:
            self.close_stream(tenant)
