"""``[metrics]`` and ``[observability]``: what the gateway measures, traces and keeps.

A leaf module (msgspec and the decoding helpers): the config imports it.
"""

from __future__ import annotations

from ..core.decoding import Section, field_error, positive


class MetricsConfig(Section):
    enabled: bool = True


class ObservabilityConfig(Section):
    #: Spans per request and stage (no-op unless an SDK provider is configured).
    tracing: bool = True
    #: OTLP/HTTP endpoint (e.g. ``http://127.0.0.1:4318/v1/traces``); needs the ``otel`` extra.
    otlp_endpoint: str | None = None
    service_name: str = "aiserve-trio"
    #: The Trio scheduler-lag probe, and how often it samples.
    scheduler_lag: bool = True
    lag_interval_ms: int = 50
    #: Dynamic P90 baseline: window length, windows kept for the fit, anomaly factor.
    baseline_window_s: float = 300.0
    baseline_history: int = 12
    baseline_min_requests: int = 20
    anomaly_factor: float = 1.5
    #: ``GET /debug/requests/recent``: the slowest recent requests with stage times.
    debug_requests: bool = False
    #: How many slowest requests that list and the console's show (of the last ten times as many).
    debug_keep: int = 50

    def __post_init__(self) -> None:
        if self.lag_interval_ms < 1:
            raise field_error("lag_interval_ms", "must be at least 1")
        positive(self, "baseline_window_s")
        if self.baseline_history < 2:
            raise field_error("baseline_history", "must be at least 2 (the fit needs two windows)")
        if self.anomaly_factor <= 1.0:
            raise field_error("anomaly_factor", "must be greater than 1")
        if self.debug_keep < 1:
            raise field_error("debug_keep", "must be at least 1")
