"""The app's observability, one for the worker whatever the config: the metrics
registry, tracing, the dynamic baseline, the request observer (the event hook's
one sink), scheduler lag, and the gauges read from the current runtime at scrape
time (deployment states, the response cache's size, flights and server)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import trio
from opentelemetry.trace import TracerProvider

from ..adapters.group import GroupAdapter
from ..config import Config
from ..observability.baseline import BaselineMonitor
from ..observability.metrics import Metrics
from ..observability.observer import RecordSink, RequestObserver
from ..observability.sched import SchedulerLag
from ..observability.tracing import Tracing, configure_otlp
from ..routes import route_label

if TYPE_CHECKING:
    from .generation import Runtime


class Telemetry:
    """Built from the first config; reloads only move the baseline's routes."""

    def __init__(
        self,
        config: Config,
        provider: TracerProvider | None,
        *,
        metrics: Metrics,
        current: Callable[[], Runtime],
        recorder: RecordSink | None = None,
        sinks: Sequence[RecordSink] = (),
    ) -> None:
        """Args:
        provider: an OpenTelemetry provider for the spans; default: the global one,
            or OTLP export when ``[observability]`` names an endpoint.
        metrics: the worker's registry.
        current: the current runtime, whose gauges are read at scrape time.
        recorder, sinks: the observer's takers of every finished request.
        """
        self.metrics = metrics
        ob = config.observability
        if provider is None and ob.otlp_endpoint:
            provider = configure_otlp(ob.otlp_endpoint, ob.service_name)
        self.tracing = Tracing(provider, enabled=ob.tracing)
        self.baseline = BaselineMonitor(
            [route_label(rc) for rc in config.routes],
            0.0,
            window_s=ob.baseline_window_s,
            history=ob.baseline_history,
            anomaly_factor=ob.anomaly_factor,
            min_requests=ob.baseline_min_requests,
        )
        keep = ob.debug_keep  # the console's slow requests; /debug/requests/recent if asked
        self.observer = RequestObserver(
            self.metrics, self.baseline, keep_recent=keep, recorder=recorder, sinks=sinks
        )
        self.sched_lag = SchedulerLag(ob.lag_interval_ms / 1000.0) if ob.scheduler_lag else None
        if self.sched_lag is not None:
            self.metrics.registry.register(self.sched_lag)
        self._current = current
        self.metrics.watch_deployments(self._deployment_states)
        self.metrics.watch_cache(
            self._cache_held, self._cache_flights, self._cache_server, self._cache_semantic
        )

    def _runtime(self) -> Runtime:
        return self._current()

    def _cache_held(self) -> tuple[int, int]:
        cache = self._runtime().cache
        return cache.held() if cache is not None else (0, 0)

    def _cache_semantic(self) -> int:
        cache = self._runtime().cache
        return cache.semantic_held()[0] if cache is not None else 0

    def _cache_flights(self) -> int:
        cache = self._runtime().cache
        return len(cache.flights) if cache is not None else 0

    def _cache_server(self) -> dict[str, float]:
        cache = self._runtime().cache
        return cache.server if cache is not None else {}

    def _deployment_states(self) -> Iterator[tuple[str, str, int]]:
        """(group, deployment, state) of every group of the current config, at scrape time."""
        now = trio.current_time()
        for adapter in self._runtime().adapters.values():
            if isinstance(adapter, GroupAdapter):
                for deployment, state in adapter.states(now):
                    yield adapter.name, deployment, state

    async def baseline_loop(self) -> None:
        """Close a baseline window every ``baseline_window_s`` and publish it."""
        self.baseline.restart(trio.current_time())
        while True:
            await trio.sleep_until(self.baseline.next_roll)
            for route, assessment in self.baseline.roll(trio.current_time()).items():
                self.metrics.publish_baseline(route, assessment)
