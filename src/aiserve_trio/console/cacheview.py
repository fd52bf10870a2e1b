"""The console's cache view (``GET /admin/api/cache``): exact and semantic hits by route,
the semantic similarity histogram, and the last semantic hits with both questions, for
an operator to audit what the semantic tier served (pure: metric families in, a dict out).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sized
from typing import Any, Protocol

from prometheus_client.metrics_core import Metric


class SemanticTier(Protocol):
    """What the view reads of the cache's semantic tier (``cache.semantic.Semantic``)."""

    @property
    def index(self) -> Sized: ...

    def listing(self, tenant: str | None = None) -> list[dict[str, Any]]: ...


class CacheLike(Protocol):
    @property
    def semantic(self) -> SemanticTier: ...


def results(families: Iterable[Metric]) -> dict[str, dict[str, int]]:
    """``aiserve_cache_requests_total`` as {route: {result: requests}}."""
    out: dict[str, dict[str, int]] = defaultdict(dict)
    for family in families:
        for s in family.samples:
            if s.name.endswith("_total"):
                out[s.labels["route"]][s.labels["result"]] = round(s.value)
    return dict(out)


def similarity(families: Iterable[Metric]) -> dict[str, Any]:
    """``aiserve_cache_semantic_similarity`` summed over routes: each bucket's upper
    bound, and per result (``hit``, ``miss``) the lookups that fell in it."""
    cumulative: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for family in families:
        for s in family.samples:
            if s.name.endswith("_bucket"):
                cumulative[s.labels["result"]][float(s.labels["le"])] += s.value
    bounds = sorted({le for per in cumulative.values() for le in per})
    counts: dict[str, list[int]] = {}
    for result in ("hit", "miss"):
        per = cumulative.get(result, {})
        running = [per.get(le, 0.0) for le in bounds]
        counts[result] = [round(b - a) for a, b in zip([0.0, *running], running, strict=False)]
    return {"le": [le if le != float("inf") else None for le in bounds], **counts}


def view(
    requests: Iterable[Metric],
    histogram: Iterable[Metric],
    cache: CacheLike | None,
    tenant: str | None = None,
) -> dict[str, Any]:
    """The whole view: results by route, the histogram, the semantic index's size and
    its last hits (newest first); only ``tenant``'s hits unless it is None (a global
    admin's view: every tenant's questions)."""
    return {
        "results": results(requests),
        "similarity": similarity(histogram),
        "semantic_entries": len(cache.semantic.index) if cache is not None else 0,
        "recent": cache.semantic.listing(tenant) if cache is not None else [],
    }
