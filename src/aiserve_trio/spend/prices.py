"""What a request cost: prices per model applied to its usage (pure: no I/O).

A request is priced at the model that answered (the first delta names it,
``Delta.model``): a group that fell back to another model is charged at that
model's price, not at what the client asked for. A model without a price costs
0 (start-up names the served models that have none: :func:`unpriced_models`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from ..adapters.base import Usage
    from ..config import Config
    from .settings import ModelPrice, PricingConfig

MTOK = 1_000_000.0


class _Details(msgspec.Struct):
    """What ``completion_tokens_details`` says that is priced."""

    reasoning_tokens: int = 0


_details = msgspec.json.Decoder(_Details)
_NONE = _Details()


def _read(raw: msgspec.Raw | None) -> _Details:
    if raw is None:
        return _NONE
    try:
        return _details.decode(raw)
    except msgspec.DecodeError:
        return _NONE


@dataclass(frozen=True, slots=True)
class Rate:
    """A model's prices per token (not per million)."""

    input: float
    output: float
    cache_read: float
    cache_write: float
    reasoning: float

    @classmethod
    def of(cls, price: ModelPrice) -> Rate:
        read = price.cache_read_per_mtok
        write = price.cache_write_per_mtok
        reasoning = price.reasoning_per_mtok
        return cls(
            input=price.input_per_mtok / MTOK,
            output=price.output_per_mtok / MTOK,
            cache_read=(price.input_per_mtok if read is None else read) / MTOK,
            cache_write=(price.input_per_mtok if write is None else write) / MTOK,
            reasoning=(price.output_per_mtok if reasoning is None else reasoning) / MTOK,
        )


def cached(usage: Usage) -> tuple[int, int]:
    """(cache reads, cache writes) of ``usage``, bounded so that together they are at most
    its prompt tokens (a backend's miscount never makes the uncached part negative)."""
    prompt = max(0, usage.prompt_tokens)
    read = min(max(0, usage.cache_read_tokens), prompt)
    return read, min(max(0, usage.cache_write_tokens), prompt - read)


class Pricing:
    """``[pricing]``: a request's cost from its usage."""

    def __init__(self, config: PricingConfig) -> None:
        self.currency = config.currency
        self._rates = {model: Rate.of(price) for model, price in config.models.items()}

    def cost(self, model: str, usage: Usage | None) -> float:
        """What ``usage`` of ``model`` cost in :attr:`currency` (0 without a price or usage):
        uncached input at the input rate, cache reads and cache writes at theirs, output
        (reasoning at its own rate)."""
        rate = self._rates.get(model)
        if rate is None or usage is None:
            return 0.0
        read, write = cached(usage)
        reasoning = min(
            max(0, _read(usage.completion_details).reasoning_tokens), usage.completion_tokens
        )
        return (
            (usage.prompt_tokens - read - write) * rate.input
            + read * rate.cache_read
            + write * rate.cache_write
            + (usage.completion_tokens - reasoning) * rate.output
            + reasoning * rate.reasoning
        )

    def cache_cost(self, model: str, usage: Usage | None) -> float:
        """The part of :meth:`cost` paid for cache reads and cache writes."""
        rate = self._rates.get(model)
        if rate is None or usage is None:
            return 0.0
        read, write = cached(usage)
        return read * rate.cache_read + write * rate.cache_write

    def charge(self, model: str, usage: Usage | None, cache: str | None) -> tuple[float, float]:
        """(what a request answered by ``model`` cost, what the cache saved)."""
        cost = self.cost(model, usage)
        return (0.0, cost) if free(cache) else (cost, 0.0)

    def unpriced(self, models: Iterable[str]) -> list[str]:
        """The ``models`` without a price, sorted."""
        return sorted({m for m in models if m not in self._rates})


def free(cache: str | None) -> bool:
    """The reply came from the response cache (stored, or shared with an identical request,
    or stored for a question worded differently: a semantic hit)."""
    return cache in ("hit", "semantic-hit", "coalesced")


def decimal(cost: float) -> str:
    """``cost`` as the ``X-Aiserve-Cost`` header writes it: a plain decimal, no exponent."""
    text = f"{cost:.10f}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def build_pricing(config: Config) -> Pricing | None:
    """The pricing of ``config`` (None when ``[pricing]`` prices no model)."""
    return Pricing(config.pricing) if config.pricing.models else None


def served_models(config: Config, adapters: Iterable[str]) -> set[str]:
    """The models ``adapters`` may answer with: their own and, for a group, its members'
    and fallbacks'."""
    seen: set[str] = set()
    todo = list(adapters)
    models: set[str] = set()
    while todo:
        name = todo.pop()
        adapter = config.adapters.get(name)
        if name in seen or adapter is None:
            continue
        seen.add(name)
        models.update(getattr(adapter, "models", None) or [])
        todo += [d.adapter for d in getattr(adapter, "deployments", [])]
        todo += list(getattr(adapter, "fallbacks", []))
    return models


def dearest(config: Config, models: Iterable[str]) -> tuple[float, float]:
    """The highest price per prompt token and per completion token of ``models`` (the
    cache and reasoning rates included), 0 for models without a price."""
    rates = [Rate.of(p) for m, p in config.pricing.models.items() if m in set(models)]
    prompt = max((max(r.input, r.cache_read, r.cache_write) for r in rates), default=0.0)
    completion = max((max(r.output, r.reasoning) for r in rates), default=0.0)
    return prompt, completion


def unpriced_models(config: Config) -> list[str]:
    """The models ``config``'s routes may answer with that ``[pricing]`` has no price for:
    their adapters' models and, for a group, its members' and fallbacks'."""
    models = served_models(config, [route.adapter for route in config.routes])
    return Pricing(config.pricing).unpriced(models)
