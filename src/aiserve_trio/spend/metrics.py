"""The spend counters, fed with every finished request (a sink of the observer)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import Counter

from ..observability.metrics import label_value

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ..stages.outcome import Outcome


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
        # Bounded: tenants, keys, routes and priced models come from the config.
        self._children: dict[tuple[Any, ...], Any] = {}

    def offer(self, outcome: Outcome) -> None:
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
