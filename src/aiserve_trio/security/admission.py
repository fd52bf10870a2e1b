"""Admission control: per-worker caps on requests in flight and open streams.

Beyond a cap the gateway answers at once with 503 and ``Retry-After`` instead
of queueing: a queue only turns overload into timeouts for everyone, while a
fast refusal lets a load balancer or the client go elsewhere. The check runs
on the request head, before a byte of the body is read. Counting is sans-IO.

The one queue is ``http/turns.py``'s: chat requests start in arrival order, a bounded
number at a time, each waiting at most until its queue budget or context cut.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

from ..core.errors import Overloaded, RateLimited


class Admission:
    """Counts requests in flight and open streams in one worker."""

    __slots__ = (
        "by_client",
        "by_key",
        "by_tenant",
        "inflight",
        "max_inflight",
        "max_per_client",
        "max_receiving",
        "max_streams",
        "receiving",
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
        max_receiving: int = 0,
        max_per_client: int = 0,
    ) -> None:
        self.configure(
            max_inflight,
            max_streams,
            tenant_max_streams=tenant_max_streams,
            max_receiving=max_receiving,
            max_per_client=max_per_client,
        )
        self.receiving = 0
        self.by_client: dict[str, int] = {}
        self.retry_after_s = retry_after_s
        self.inflight = 0
        self.streams = 0
        #: Open streams per tenant (only tenants that hold one).
        self.by_tenant: dict[str, int] = {}
        #: Open streams per key with a cap of its own (only keys that hold one).
        self.by_key: dict[str, int] = {}
        #: Requests refused so far (for logs and tests).
        self.shed = 0

    def configure(
        self,
        max_inflight: int,
        max_streams: int,
        *,
        tenant_max_streams: int = 0,
        max_receiving: int = 0,
        max_per_client: int = 0,
    ) -> None:
        """Set the caps; the counts are kept (a reloaded config's caps apply to the
        requests admitted from now on, counted with those already in flight)."""
        self.max_inflight = max_inflight
        #: Slots for requests still receiving their body (0: a quarter of max_inflight).
        self.max_receiving = max_receiving or max(1, max_inflight // 4)
        #: Requests in flight per client address (0: no cap).
        self.max_per_client = max_per_client
        self.max_streams = max_streams
        #: Open streams one tenant may hold (0: no cap).
        self.tenant_max_streams = tenant_max_streams

    def _refuse(self, what: str, cap: int) -> Overloaded:
        self.shed += 1
        return Overloaded(
            f"the gateway is at its limit of {cap} {what}; retry shortly",
            headers={"Retry-After": str(self.retry_after_s)},
        )

    def request(self, address: str | None = None) -> Held:
        """Hold one in-flight slot for the block, and one of ``address``'s when given.

        Raises (entering the block):
            Overloaded: ``max_inflight`` requests are already in flight.
            RateLimited: the address has ``max_per_client`` requests in flight.
        """
        return Held(self, address)

    def body(self) -> BodySlot:
        """A slot for a request whose body is still arriving; release it when it has.

        Raises:
            Overloaded: ``max_receiving`` bodies are arriving already.
        """
        if self.receiving >= self.max_receiving:
            raise self._refuse("request bodies arriving", self.max_receiving)
        self.receiving += 1
        return BodySlot(self)

    def open_stream(self, tenant: str | None = None, key: Key | None = None) -> None:
        """Take a stream slot (and one of ``tenant``'s, and of ``key``'s); pair with
        :meth:`close_stream`.

        Raises:
            Overloaded: ``max_streams`` streams are already open.
            RateLimited: ``tenant`` holds ``tenant_max_streams`` already, or ``key``
                (its id and its own cap) holds its cap.
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
        if key is not None and _taken(self.by_key, key[0]) >= key[1]:
            self.shed += 1
            raise RateLimited(
                f"this API key has {key[1]} streams open, its max_streams in this worker",
                code="key_stream_limit",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        if tenant is not None and self.tenant_max_streams:
            self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + 1
        if key is not None:
            self.by_key[key[0]] = self.by_key.get(key[0], 0) + 1
        self.streams += 1

    def close_stream(self, tenant: str | None = None, key: Key | None = None) -> None:
        self.streams -= 1
        if tenant is not None:
            _give_back(self.by_tenant, tenant)
        if key is not None:
            _give_back(self.by_key, key[0])

    @contextmanager
    def stream(self, tenant: str | None = None, key: Key | None = None) -> Iterator[None]:
        """Hold one stream slot for the block (see :meth:`open_stream`)."""
        self.open_stream(tenant, key)
        try:
            yield
        finally:
            self.close_stream(tenant, key)


class Held:
    """The in-flight slot and the client address's slot one request holds (see ``request``)."""

    __slots__ = ("_address", "_adm")

    def __init__(self, adm: Admission, address: str | None) -> None:
        self._adm = adm
        self._address = address if adm.max_per_client else None

    def __enter__(self) -> None:
        adm = self._adm
        if adm.inflight >= adm.max_inflight:
            raise adm._refuse("requests in flight", adm.max_inflight)
        address = self._address
        if address is not None:
            held = adm.by_client.get(address, 0)
            if held >= adm.max_per_client:
                adm.shed += 1
                raise RateLimited(
                    f"this client address has {held} requests in flight, its limit",
                    code="too_many_connections",
                    headers={"Retry-After": str(adm.retry_after_s)},
                )
            adm.by_client[address] = held + 1
        adm.inflight += 1

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        adm = self._adm
        adm.inflight -= 1
        address = self._address
        if address is not None:
            left = adm.by_client[address] - 1
            if left:
                adm.by_client[address] = left
            else:
                del adm.by_client[address]


class BodySlot:
    """One request's place among the bodies arriving; :meth:`release` is idempotent."""

    __slots__ = ("_admission",)

    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission

    def release(self) -> None:
        if self._admission is not None:
            self._admission.receiving -= 1
            self._admission = None

    def __enter__(self) -> BodySlot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class BodyPace:
    """How long a request body may take (sans-IO): it must keep arriving.

    Three rules, each its own bound on when the next chunk must be in: the
    pause between two chunks (``idle``), the whole body (``total``), and a
    floor on the rate -- after a grace second, at least ``min_rate`` bytes per
    second on average (0: none). A client that dribbles a byte a second holds a
    slot for about a second, not for minutes.
    """

    __slots__ = ("grace", "idle", "min_rate", "received", "start", "total")

    def __init__(
        self, start: float, *, idle: float, total: float, min_rate: int, grace: float = 1.0
    ) -> None:
        self.start = start
        self.idle = idle
        self.total = total
        self.min_rate = min_rate
        self.grace = grace
        self.received = 0

    def add(self, n: int) -> None:
        self.received += n

    def deadline(self, now: float) -> tuple[float, str]:
        """When the next chunk must have arrived, and what to say if it has not."""
        bounds = [
            (now + self.idle, "the request body stopped arriving"),
            (self.start + self.total, f"the request body took longer than {self.total:g} s"),
        ]
        if self.min_rate:
            floor = self.start + max(self.grace, self.received / self.min_rate)
            bounds.append((floor, f"the request body arrived slower than {self.min_rate} B/s"))
        return min(bounds)



#: A key with a stream cap of its own: its id and the cap.
Key = tuple[str, int]


def _taken(held: dict[str, int], name: str) -> int:
    return held.get(name, 0)


def _give_back(held: dict[str, int], name: str) -> None:
    left = held.get(name, 0) - 1
    if left > 0:
        held[name] = left
    else:
        held.pop(name, None)
