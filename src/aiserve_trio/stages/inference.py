"""The inference stage: run the route's adapter within the inference budget.

The adapter streams deltas straight into the channel the sse stage reads, so a
slow client's backpressure reaches the upstream. Before the call starts, a
request with less than ``min_inference_ms`` left fails fast instead of starting
a call that cannot finish.
"""

from __future__ import annotations

import trio

from ..adapters.base import Delta, InferenceRequest
from ..errors import StageDeadlineExceeded
from .request import RequestState


async def inference_stage(
    state: RequestState,
    inbox: trio.MemoryReceiveChannel[InferenceRequest],
    out: trio.MemorySendChannel[Delta],
) -> None:
    budget = state.budget
    async with out, inbox:
        with trio.move_on_at(budget.inference_end) as scope:
            try:
                request = await inbox.receive()
            except trio.EndOfChannel:
                return  # an earlier stage failed and says why
            state.mark("inference")
            left = budget.inference_end - trio.current_time()
            if left < budget.min_inference:
                raise StageDeadlineExceeded(
                    "inference",
                    f"only {max(left, 0.0) * 1000:.0f} ms of the inference budget remain, "
                    f"less than the {budget.min_inference * 1000:.0f} ms a call needs",
                )
            state.upstream_started = True
            state.inference = request  # prepared by the adapter: it carries the trimming
            with state.trace.live_stage("inference") as span:
                request.forward_headers.update(state.trace.inject(span))
                await state.route.adapter.stream(request, out)
        if scope.cancelled_caught:
            raise StageDeadlineExceeded("inference")
