"""Model backends behind one small interface (see ``base.py``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, cast

from ..observability.events import NULL_HOOK, UpstreamHook
from .base import Adapter, Delta, DeltaSink, InferenceRequest, Message, Usage
from .settings import KINDS, AdapterConfig, GroupAdapterConfig, MockAdapterConfig, adapter_kind

if TYPE_CHECKING:
    from ..routes import RouteConfig

__all__ = [
    "Adapter",
    "Delta",
    "DeltaSink",
    "InferenceRequest",
    "Message",
    "Usage",
    "build_adapter",
    "build_adapters",
    "route_adapter",
]


def build_adapter(name: str, config: AdapterConfig, hook: UpstreamHook = NULL_HOOK) -> Adapter:
    """The adapter ``[adapters.NAME]`` configures (its pool opens later, in lifespan).

    Args:
        name: the adapter's key in the config.
        config: its table.
        hook: told of each upstream try, retry and final error (metrics, traces).

    Raises:
        ValueError: no adapter of that kind is available.
    """
    kind = KINDS.get(adapter_kind(config))
    if kind is not None and kind.adapter and isinstance(config, kind.settings):
        # Imported here: a config without an openai or vllm_ws adapter does not
        # pay for importing httpx2 or trio-websocket.
        module, _, cls = kind.adapter.partition(":")
        make = getattr(importlib.import_module(f".{module}", __name__), cls)
        return cast(Callable[..., Adapter], make)(name, config, hook=hook)
    raise ValueError(f"adapter kind {type(config).__name__} is not available")


def build_adapters(
    configs: Mapping[str, AdapterConfig],
    hook: UpstreamHook = NULL_HOOK,
    given: Mapping[str, Adapter] | None = None,
) -> dict[str, Adapter]:
    """Every ``[adapters.NAME]``, groups last (a group holds the adapters it names).

    Args:
        configs: the config's adapter tables (checked: groups name configured
            adapters and never loop).
        hook: told of each upstream try, retry and final error.
        given: adapters that replace the configured ones of the same name
            (tests pass fakes); a group uses these too.
    """
    built = {
        n: build_adapter(n, c, hook)
        for n, c in configs.items()
        if not isinstance(c, GroupAdapterConfig) and n not in (given or {})
    }
    built.update(given or {})
    groups = {n: c for n, c in configs.items() if isinstance(c, GroupAdapterConfig)}
    while groups:  # a group may fall back to another group: build those first
        ready = [n for n, c in groups.items() if all(f in built for f in c.fallbacks)]
        if not ready:
            raise ValueError(f"adapter groups fall back to each other: {', '.join(groups)}")
        for n in ready:
            if n not in built:
                built[n] = _group(n, groups[n], configs, built, hook)
            del groups[n]
    return built


def route_adapter(route: RouteConfig, label: str, built: Mapping[str, Adapter]) -> Adapter:
    """The adapter a route's stages call: its ``adapter``, or with ``adapters`` a router
    picking one by the request's model (``router.py``)."""
    if not route.adapters:
        return built[route.adapter]
    from .router import ModelRouter

    # ``adapter`` first, then ``adapters``, once each (as ``routes.route_adapters``).
    return ModelRouter(label, [built[n] for n in dict.fromkeys([route.adapter, *route.adapters])])


def _group(
    name: str,
    config: GroupAdapterConfig,
    configs: Mapping[str, AdapterConfig],
    built: Mapping[str, Adapter],
    hook: UpstreamHook,
) -> Adapter:
    from .group import GroupAdapter, Member

    def prior(adapter: str, ms: float | None) -> float:
        if ms is None:
            own = configs.get(adapter)
            # A mock's TTFT is known: it is its setting (the canned-apology fallback).
            ms = own.ttft_ms if isinstance(own, MockAdapterConfig) else config.ttft_prior_ms
        return ms / 1000.0

    members = [
        Member(built[d.adapter], 0, d.weight, prior(d.adapter, d.ttft_prior_ms))
        for d in config.deployments
    ]
    members += [
        Member(built[f], i, 1.0, prior(f, config.fallback_ttft_prior_ms.get(f)))
        for i, f in enumerate(config.fallbacks, 1)
    ]
    return GroupAdapter(name, config, members, hook=hook)
