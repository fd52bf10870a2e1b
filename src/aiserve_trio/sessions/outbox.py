"""Writing turns back to the bus, and the outbox that keeps them while it is down.

After a reply has been delivered, :meth:`WriteBack.after_request` appends the
user turn and the assistant turn (what the client actually got, marked
``truncated`` if the stream was cut), and the session variables a chain decided
(its intent labels), within the request's remaining budget. If
the bus fails or the budget runs out, the turns go into the :class:`Outbox`: a
bounded, in-process queue keyed by request id, which :meth:`WriteBack.run`
drains with backoff once the bus answers again. The bus's ``append`` is
idempotent per request id, so a write that succeeded but whose reply was lost
is not stored twice when it is retried. When the outbox is full the oldest
pending write is dropped (counted): memory stays bounded while Redis is down.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from .bus import SessionBus, SessionBusError, Turn

if TYPE_CHECKING:
    from ..observability.metrics import Metrics
    from ..stages.outcome import Outcome

log = logging.getLogger("aiserve_trio.sessions")


@dataclass(slots=True)
class PendingWrite:
    tenant: str
    session_id: str
    request_id: str
    turns: list[Turn]
    ttl: int
    #: Session variables the request decided (a chain's intent labels), merged after the turns.
    values: dict[str, str] | None = None

    async def store(self, bus: SessionBus) -> None:
        """Write the turns, then the variables (both idempotent, so a retry is safe)."""
        if self.turns:
            await bus.append(self.tenant, self.session_id, self.turns, self.ttl)
        if self.values:
            await bus.set_vars(self.tenant, self.session_id, self.values, self.ttl)


class Outbox:
    """Pending writes in arrival order, one per request id, at most ``max_items`` (sans-IO)."""

    __slots__ = ("_items", "max_items")

    def __init__(self, max_items: int) -> None:
        self.max_items = max_items
        self._items: OrderedDict[str, PendingWrite] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: PendingWrite) -> list[PendingWrite]:
        """Queue ``item`` (replacing a pending write of the same request).

        Returns the writes dropped to stay within ``max_items``, oldest first.
        """
        self._items[item.request_id] = item
        self._items.move_to_end(item.request_id)
        dropped = []
        while len(self._items) > self.max_items:
            dropped.append(self._items.popitem(last=False)[1])
        return dropped

    def first(self) -> PendingWrite | None:
        return next(iter(self._items.values()), None)

    def remove(self, request_id: str) -> None:
        self._items.pop(request_id, None)


def request_turns(outcome: Outcome) -> list[Turn]:
    """The turns to store for a finished request, or ``[]`` if there is nothing to store.

    What the request added to the conversation (a user question, or tool
    results answering the assistant's calls), as the model saw it, and the
    reply: its content and tool calls. Stored when the reply finished, or when
    something was delivered before the stream was cut (then the assistant turn
    is ``truncated``).
    """
    info, prepared = outcome.info, outcome.prepared
    if info is None or prepared is None or info.session_id is None or not prepared.store:
        return []
    cut = outcome.cut
    if cut and not (outcome.delivered or outcome.tool_calls):
        return []
    flags = dict(prepared.policy.flags)
    if prepared.degraded:
        flags["degraded"] = prepared.degraded
    now = time.time()
    ch, rid = outcome.channel, outcome.request_id
    chain = outcome.chain
    # A chain that transcribed audio stores what was heard, not the audio.
    asked = chain.new_turns if chain is not None and chain.new_turns is not None else None
    turns = [
        Turn(
            role=m.role,
            content=m.text(),
            channel=ch,
            request_id=rid,
            ts=now,
            flags=flags,
            tool_calls=m.tool_calls,
            tool_call_id=m.tool_call_id,
        )
        for m in (asked if asked is not None else prepared.new_turns)
        # An assistant message is new only in a Responses request's own history.
        if m.role in ("user", "tool", "assistant")
    ]
    turns.append(
        Turn(
            role="assistant",
            content=outcome.delivered,
            channel=ch,
            request_id=rid,
            ts=now,
            truncated=cut,
            flags=flags,
            tool_calls=outcome.tool_calls or None,
        )
    )
    return turns


class WriteBack:
    """Appends finished requests' turns; keeps and retries those the bus did not take."""

    def __init__(
        self,
        bus: SessionBus,
        metrics: Metrics,
        *,
        outbox_max: int,
        retry_ms: int = 200,
        retry_max_ms: int = 5_000,
    ) -> None:
        self.bus = bus
        self.metrics = metrics
        self.outbox = Outbox(outbox_max)
        self.retry_s = retry_ms / 1000.0
        self.retry_max_s = retry_max_ms / 1000.0
        self._wake = trio.Event()

    async def after_request(self, outcome: Outcome) -> None:
        """Store a finished request's turns and the variables its chain decided (its
        intent labels), within its remaining budget, or queue them."""
        turns = request_turns(outcome)
        info = outcome.info
        labels = dict(outcome.chain.labels) if outcome.chain is not None else None
        if not (turns or labels) or info is None or info.session_id is None:
            return
        item = PendingWrite(
            info.tenant,
            info.session_id,
            outcome.request_id,
            turns,
            info.route.config.context_ttl,
            labels or None,
        )
        budget = info.budget
        # A cut request still gets its reserve for this write; the outbox takes the rest.
        deadline = max(budget.deadline, trio.current_time() + budget.reserve)
        with trio.move_on_at(deadline):
            try:
                await item.store(self.bus)
                return
            except SessionBusError:
                pass
        self.enqueue(item)

    def enqueue(self, item: PendingWrite) -> None:
        """Keep ``item`` for the retry loop (dropping the oldest if the outbox is full)."""
        for lost in self.outbox.add(item):
            self.metrics.session_outbox_dropped.inc()
            log.warning("session outbox full: dropped the turns of %s", lost.request_id)
        self.metrics.session_outbox_size.set(len(self.outbox))
        self._wake.set()

    async def flush(self) -> None:
        """Try each pending write once, oldest first; stop at the first failure."""
        while (item := self.outbox.first()) is not None:
            try:
                await item.store(self.bus)
            except SessionBusError:
                log.warning("session outbox: %d writes not stored at shutdown", len(self.outbox))
                return
            self.outbox.remove(item.request_id)
            self.metrics.session_outbox_size.set(len(self.outbox))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Drain the outbox for the app's lifetime, backing off while the bus is down."""
        task_status.started()
        delay = self.retry_s
        while True:
            item = self.outbox.first()
            if item is None:
                await self._wake.wait()
                self._wake = trio.Event()
                continue
            stored = False
            # A bus that hangs (not refuses) must not stall the loop either.
            with trio.move_on_after(self.retry_max_s):
                try:
                    await item.store(self.bus)
                    stored = True
                except SessionBusError:
                    pass
            if not stored:
                await trio.sleep(delay)
                delay = min(delay * 2, self.retry_max_s)
                continue
            delay = self.retry_s
            self.outbox.remove(item.request_id)
            self.metrics.session_outbox_size.set(len(self.outbox))
