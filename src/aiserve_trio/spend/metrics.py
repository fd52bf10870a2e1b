"""The spend counters, fed with every finished request (a sink of the observer).

It also counts the replies whose backend-reported usage the gateway did not believe
(``stages/metering.py``: negative, or more completion tokens than the text holds) and
logs the first of each route and reason.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter

from ..observability.metrics import label_value

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ..stages.outcome import Outcome

log = logging.getLogger("aiserve_trio.spend")


class SpendMetrics:
    """``aiserve_spend_total{tenant,key,route,model}`` and ``aiserve_spend_saved_total``."""

    def __init__(self, registry: CollectorRegistry, currency: str) -> None:
        self.spend = Counter(
            "aiserve_spend",
            f"What requests cost, in {currency} ([pricing]), by the model that answered.",
            ["tenant", "key", "route", "model"],
            registry=registry,
        )
        self.saved = Counter(
            "aiserve_spend_saved",
            f"What the response cache saved, in {currency}: the cost of the hits' answers.",
            ["tenant", "key", "route", "model"],
            registry=registry,
        )
        self.distrusted = Counter(
            "aiserve_usage_distrusted",
            "Replies billed with the gateway's own token count because the usage the "
            "backend reported was negative or more than its text holds (reason: negative, "
            "absurd).",
            ["route", "reason"],
            registry=registry,
        )
        # Bounded: tenants, keys, routes and priced models come from the config.
        self._children: dict[tuple[Any, ...], Any] = {}
        #: (route, reason) already logged: a backend that miscounts is named once.
        self._logged: set[tuple[str, str]] = set()

    def offer(self, outcome: Outcome) -> None:
        if outcome.distrusted is not None:
            self._distrust(outcome, outcome.distrusted)
        if not (outcome.cost or outcome.saved):
            return
        metric = self.spend if outcome.cost else self.saved
        labels = (
            label_value(outcome.tenant or "none"),
            label_value(outcome.key_id or "none"),
            outcome.route,
            label_value(outcome.served_model or "none"),
        )
        child = self._children.get((metric, *labels))
        if child is None:
            child = self._children[(metric, *labels)] = metric.labels(*labels)
        child.inc(outcome.cost or outcome.saved)

    def _distrust(self, outcome: Outcome, reason: str) -> None:
        route = outcome.route
        self.distrusted.labels(route, reason).inc()
        if (route, reason) not in self._logged:
            self._logged.add((route, reason))
            log.warning(
                "route %s: the backend reported a %s usage (model %s, request %s); billed "
                "with the gateway's own count (logged once per route and reason)",
                route,
                reason,
                outcome.served_model,
                outcome.request_id,
            )
