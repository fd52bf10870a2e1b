"""The inference stage: run the route's adapter within the inference budget.

The adapter streams deltas straight into the channel the sse stage reads, so a
slow client's backpressure reaches the upstream. Before the call starts, a
request with less than ``min_inference_ms`` left fails fast instead of starting
a call that cannot finish.
"""

from __future__ import annotations

import msgspec
import trio

from ..adapters.base import Delta
from ..errors import StageDeadlineExceeded
from .types import Prepared, RequestInfo


class InferenceStage:
    name = "inference"

    def __init__(
        self,
        info: RequestInfo,
        inbox: trio.MemoryReceiveChannel[Prepared],
        out: trio.MemorySendChannel[Delta],
    ) -> None:
        self.info = info
        self.out = out
        self.owned = (out, inbox)

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
        request = prepared.inference
        with info.trace.live_stage("inference") as span:
            carried = info.trace.inject(span)
            if carried:
                forward = {**request.forward_headers, **carried}
                request = msgspec.structs.replace(request, forward_headers=forward)
            await info.route.adapter.stream(request, self.out)

    async def expired(self, prepared: Prepared) -> None:
        raise StageDeadlineExceeded("inference")
