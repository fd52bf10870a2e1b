"""The inference stage: run the route's adapter within the inference budget.

The adapter streams deltas straight into the channel the sse stage reads, so a
slow client's backpressure reaches the upstream. Before the call starts, a
request with less than ``min_inference_ms`` left fails fast instead of starting
a call that cannot finish.

On a route with a response cache, the context stage's ticket decides instead:
a stored reply is replayed; a request sharing an answer in flight reads that
flight's pieces (the first to get here launches it: the model through the
route's output filters, see :meth:`InferenceStage._produce`). Either way the
sse stage gets :class:`~aiserve_trio.cache.entry.Replayed` deltas, already
through the output policies.

On a route with steps (``chains/``), the chain runs here, inside the stage's
budget: its steps carve that budget into cut points of their own, the earlier
steps are awaited, and only the streaming step's deltas reach the channel. When
the stage's cut passes, the error names the step that was running.

Under overload (``[deadline] queue_share`` and ``ttft_ms``, both off by default) a
request that reaches this stage past its queue budget, or a stream past its TTFT
budget, is shed at once (:class:`~aiserve_trio.core.errors.Shed`: 503 with
``Retry-After``) instead of starting a call whose answer would come too late; and a
stream whose upstream has not started answering by its TTFT budget (it waited for a
pooled connection, or the backend is slow to start) is cut and shed the same way,
before its head is written.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
import trio

from ..adapters.base import Delta
from ..cache.service import Cache
from ..chains.state import ChainRun
from ..core.errors import GatewayError, Shed, StageDeadlineExceeded, StepDeadlineExceeded
from ..http.turns import end_turn
from .assembler import ResponseAssembler
from .channel import Inbox, Outbox
from .handoff import EagerSink
from .report import InferenceReport
from .types import Prepared, RequestInfo

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..adapters.base import InferenceRequest
    from ..cache.entry import Replayed


def _shed(why: str) -> Shed:
    if why == "queue":
        return Shed(why, "the gateway is overloaded: the request waited past its queue budget")
    return Shed(why, "the gateway is overloaded: the stream's first byte cannot come within "
                "its time-to-first-token budget")


class _FirstByte:
    """The stage's channel as the adapter's sink, lifting the TTFT cut at the first delta."""

    __slots__ = ("_out", "_scope")

    def __init__(self, out: Outbox[Delta], scope: trio.CancelScope) -> None:
        self._out = out
        self._scope: trio.CancelScope | None = scope

    async def send(self, value: Delta, /) -> None:
        if self._scope is not None:
            self._scope.deadline = math.inf
            self._scope = None
        try:
            self._out.send_nowait(value)
        except trio.WouldBlock:
            await self._out.send(value)


class InferenceStage:
    name = "inference"

    def __init__(
        self,
        info: RequestInfo,
        inbox: Inbox[Prepared],
        out: Outbox[Delta],
        cache: Cache | None = None,
    ) -> None:
        self.info = info
        self.out = out
        self.cache = cache
        self.owned = (out, inbox)
        #: What the cache did for this request, once known (the pipeline reads it).
        self.cache_result: str | None = None
        #: What the route's chain did, on a route with steps (the pipeline reads it).
        self.chain: ChainRun | None = None

    async def run(self, prepared: Prepared) -> None:
        """Raises: StageDeadlineExceeded (too little time left), UpstreamError."""
        info = self.info
        budget = info.budget
        left = budget.inference_end - trio.current_time()
        if left < budget.min_inference:
            raise StageDeadlineExceeded(
                "inference",
                f"only {max(left, 0.0) * 1000:.0f} ms of the inference budget remain, "
                f"less than the {budget.min_inference * 1000:.0f} ms a call needs",
            )
        ticket = prepared.cache
        request = prepared.inference
        with info.trace.live_stage("inference") as span:
            if ticket is not None and ticket.entry is not None:
                self.cache_result = await Cache.replay(
                    ticket.entry, self.out, ticket.result, ticket.similarity
                )
                return
            stream = prepared.parsed.stream
            why = budget.shed(trio.current_time(), stream=stream)
            if why is not None:
                raise _shed(why)
            end_turn()  # the gateway's own work is done: the next request may start
            carried = info.trace.inject(span)
            if carried:
                forward = {**request.forward_headers, **carried}
                request = msgspec.structs.replace(request, forward_headers=forward)
            chain = info.route.chain
            if chain is not None:
                self.chain = ChainRun()
                await chain.run(info, prepared, request, self.out, self.chain)
                return
            if ticket is None or ticket.member is None or self.cache is None:
                self.cache_result = ticket.result if ticket is not None else None
                if not stream or budget.first_byte_end == math.inf:
                    await info.route.adapter.stream(request, EagerSink(self.out))
                    return
                # The upstream must start answering within the TTFT budget.
                with trio.CancelScope(deadline=budget.first_byte_end) as first:
                    await info.route.adapter.stream(request, _FirstByte(self.out, first))
                if first.cancelled_caught:
                    raise _shed("ttft")
                return

            async def produce(
                publish: Callable[[Sequence[Replayed]], None], until: float
            ) -> str | None:
                # The flight lasts as long as the latest of the requests sharing it.
                shared = msgspec.structs.replace(request, deadline=until)
                return await self._produce(prepared, shared, publish)

            await self.cache.follow(ticket, produce, request.deadline, self.out, self._told)

    def _told(self, result: str) -> None:
        self.cache_result = result

    async def _produce(
        self,
        prepared: Prepared,
        request: InferenceRequest,
        publish: Callable[[Sequence[Replayed]], None],
    ) -> str | None:
        """The answer for every request sharing it: the model through this request's
        output filters (the route's), each released piece published as it comes.

        Runs in the cache's flight task, not in this request: it goes on if this
        request goes away while others share the answer.

        Returns: the cap that ended the reply early, if one did.
        """
        info = self.info
        asm = ResponseAssembler(
            info.request_id,
            prepared.parsed.model,
            info.created,
            stream=False,
            filters=prepared.filters,
            side_filters=prepared.side_filters,
            max_tokens=request.max_tokens,
            max_bytes=info.route.config.max_reply_bytes,
            record=True,
        )
        send, recv = trio.open_memory_channel[Delta](1)
        adapter = info.route.adapter
        # Errors are kept, not raised inside the nursery (that would group them).
        failure: GatewayError | None = None

        async def upstream() -> None:
            nonlocal failure
            try:
                await adapter.stream(request, send)
            except GatewayError as err:
                failure = failure or err
            finally:
                # Closed without a checkpoint: the error is kept before the reader,
                # seeing the end, cancels this task.
                send.close()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(upstream)
            try:
                async for delta in recv:
                    asm.feed(delta, trio.current_time())
                    publish(asm.take_recorded())
                    if asm.capped is not None:
                        break  # the backend did not stop at the limit: stop it here
            except GatewayError as err:
                # A cap on the reply's bytes: here, not only in each request's sse
                # stage, so that the shared log stays bounded by it too.
                failure = failure or err
            # Cancelled before its channel closes: the call ends cancelled, not broken.
            nursery.cancel_scope.cancel(reason="the reply is over")
        recv.close()
        if failure is not None:
            raise failure
        asm.finish(trio.current_time())
        publish(asm.take_recorded())
        return asm.capped

    def report(self) -> InferenceReport:
        """What the cache and the chain did (the stage's shell asks when it ends)."""
        chain = self.chain.report() if self.chain is not None else None
        return InferenceReport(self.cache_result, chain)

    async def expired(self, prepared: Prepared) -> None:
        """The inference cut passed: on a chain, it names the step that was running."""
        if self.chain is not None and self.chain.last is not None:
            raise StepDeadlineExceeded(self.chain.last)
        raise StageDeadlineExceeded("inference")
