"""What happens when a request ends: SLA metrics, the baseline, the trace, the debug list.

The pipeline calls :meth:`RequestObserver.finish` once per chat request with
its outcome; everything an operator uses to attribute latency (request ->
stage -> upstream attempt) is recorded here, off the stages' own code paths.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from .baseline import BaselineMonitor
from .metrics import STAGES, Metrics
from .tracing import NOOP_TRACE

if TYPE_CHECKING:
    from ..stages.request import RequestState


class RecentRequest(msgspec.Struct, kw_only=True):
    request_id: str
    route: str
    model: str
    channel: str
    outcome: str
    total_ms: float
    ttft_ms: float | None
    #: Milliseconds each stage worked (from getting its input to its end).
    stages_ms: dict[str, float]
    trace_id: str | None = None
    error_stage: str | None = None


class RecentList(msgspec.Struct, kw_only=True):
    requests: list[RecentRequest]


class RequestObserver:
    """Records each finished request; one per app."""

    def __init__(
        self,
        metrics: Metrics,
        baseline: BaselineMonitor | None,
        *,
        keep_recent: int = 0,
    ) -> None:
        self.metrics = metrics
        self.baseline = baseline
        self.keep_recent = keep_recent
        # The slowest are picked from a window ten times the listing's size.
        self._recent: deque[RecentRequest] = deque(maxlen=max(keep_recent * 10, 1))

    def finish(self, state: RequestState, outcome: str) -> None:
        now = trio.current_time()
        arrival = state.budget.arrival
        route = state.route.label
        model = state.model_label()
        m = self.metrics
        ok = outcome == "ok"
        if state.first_token_at is not None:
            ttft = state.first_token_at - arrival
            m.ttft.labels(route).observe(ttft)
            m.model_ttft.labels(route, model).observe(ttft)
        if state.usage is not None:
            for direction, n in (
                ("prompt", state.usage.prompt_tokens),
                ("completion", state.usage.completion_tokens),
            ):
                m.tokens.labels(route, direction).inc(n)
                m.model_tokens.labels(route, model, direction).inc(n)
        if ok:
            m.request_duration.labels(route, model).observe(now - arrival)
            if self.baseline is not None:
                prompt = state.usage.prompt_tokens if state.usage is not None else 0
                self.baseline.record(route, now - arrival, prompt)

        if state.trace is not NOOP_TRACE:
            self._trace(state, outcome, now)
        if self.keep_recent:
            self._remember(state, outcome, now)

    @staticmethod
    def _trace(state: RequestState, outcome: str, now: float) -> None:
        arrival = state.budget.arrival
        stages: dict[str, tuple[float, float]] = {}
        for name in STAGES:
            t0 = state.stage_started.get(name)
            t1 = state.stage_ended.get(name)
            if t0 is not None and t1 is not None and name != "inference":
                stages[name] = (t0, t1)
        anchors = {"gateway_receive_time": arrival, "response_sent_time": now}
        if "inference" in state.stage_started:
            anchors["inference_start_time"] = state.stage_started["inference"]
        if state.first_token_at is not None:
            anchors["first_token_time"] = state.first_token_at
        attrs: dict[str, Any] = {"model": state.model, "channel": state.channel}
        if state.usage is not None:
            attrs["prompt_tokens"] = state.usage.prompt_tokens
            attrs["completion_tokens"] = state.usage.completion_tokens
        error = state.error.message if state.error is not None else None
        state.trace.finish(
            stages=stages, anchors=anchors, end=now, status=outcome, error=error, attributes=attrs
        )

    def _remember(self, state: RequestState, outcome: str, now: float) -> None:
        arrival = state.budget.arrival
        self._recent.append(
            RecentRequest(
                request_id=state.request_id,
                route=state.route.label,
                model=state.model,
                channel=state.channel,
                outcome=outcome,
                total_ms=round((now - arrival) * 1000, 3),
                ttft_ms=round((state.first_token_at - arrival) * 1000, 3)
                if state.first_token_at is not None
                else None,
                stages_ms={
                    name: round((state.stage_ended[name] - t0) * 1000, 3)
                    for name, t0 in state.stage_started.items()
                    if name in state.stage_ended
                },
                trace_id=state.trace.trace_id,
                error_stage=state.error_stage,
            )
        )

    def slowest(self) -> RecentList:
        """The slowest of the recent requests, slowest first."""
        ranked = sorted(self._recent, key=lambda r: r.total_ms, reverse=True)
        return RecentList(requests=ranked[: self.keep_recent])
