"""Model routing on one route: the request's ``model`` picks the adapter.

A route with ``adapters = ["claude", "azure", ...]`` is served by a
:class:`ModelRouter`: to the stages it is the route's one adapter, serving the
union of its adapters' models; each request goes to the adapter whose
``models`` has the request's model (the config refuses two adapters claiming
one model, naming the key). A group is an adapter like any other, so a model
can be a group with fallbacks across providers.

The router owns nothing: its adapters are the runtime's (opened, reused
across reloads and closed there). It adds no retries and reports nothing to
the hook itself: the chosen adapter's own :meth:`~.base.Adapter.stream` runs
its retries and reports each try under its own name, so every try is counted
once, per deployment, as on a route with that adapter alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import Adapter, DeltaSink, EmbeddingRequest, InferenceRequest
from .retry import Progress

__all__ = ["ModelRouter"]


class ModelRouter(Adapter):
    """One route's adapters, chosen per request by the model it asks for."""

    def __init__(self, name: str, adapters: Sequence[Adapter]) -> None:
        """Route each model to the first of ``adapters`` that serves it.

        Args:
            name: the route's label (in errors only: the hook hears the chosen adapter).
            adapters: the default adapter first (it answers a request naming no model).
        """
        table: dict[str, Adapter] = {}
        for adapter in adapters:
            for model in adapter.models:
                table.setdefault(model, adapter)
        super().__init__(name, list(table))
        self.table = table
        self.default = adapters[0]
        self.default_model = self.default.models[0] if self.default.models else None

    def serving(self, model: str) -> Adapter:
        """The adapter serving ``model`` (the default one for a model nobody serves)."""
        return self.table.get(model, self.default).serving(model)

    async def prepare(self, request: InferenceRequest) -> InferenceRequest:
        return await self.table.get(request.model, self.default).prepare(request)

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        """The chosen adapter's whole :meth:`~.base.Adapter.stream`: its retries, its hook."""
        await self.table.get(request.model, self.default).stream(request, send)

    async def embed_once(self, request: EmbeddingRequest) -> bytes:
        return await self.table.get(request.model, self.default).embed(request)

    async def ready(self) -> bool:
        return all([await a.ready() for a in dict.fromkeys(self.table.values())])
