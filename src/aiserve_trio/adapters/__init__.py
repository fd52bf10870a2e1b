"""Model backends behind one small interface (see ``base.py``)."""

from __future__ import annotations

from ..config import AdapterConfig, MockAdapterConfig, OpenAIAdapterConfig, VllmWsAdapterConfig
from ..observability.events import NULL_HOOK, UpstreamHook
from .base import Adapter, Delta, DeltaSink, InferenceRequest, Message, Usage

__all__ = [
    "Adapter",
    "Delta",
    "DeltaSink",
    "InferenceRequest",
    "Message",
    "Usage",
    "build_adapter",
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
    # Imported here: a config without an openai or vllm_ws adapter does not
    # pay for importing httpx2 or trio-websocket.
    if isinstance(config, MockAdapterConfig):
        from .mock import MockAdapter

        return MockAdapter(name, config, hook=hook)
    if isinstance(config, OpenAIAdapterConfig):
        from .openai import OpenAIAdapter

        return OpenAIAdapter(name, config, hook=hook)
    if isinstance(config, VllmWsAdapterConfig):
        from .vllm_ws import VllmWsAdapter

        return VllmWsAdapter(name, config, hook=hook)
    raise ValueError(f"adapter kind {type(config).__name__} is not available")
