"""Model backends behind one small interface (see ``base.py``)."""

from __future__ import annotations

from ..config import AdapterConfig, MockAdapterConfig
from .base import Adapter, Delta, InferenceRequest, Message, Usage

__all__ = ["Adapter", "Delta", "InferenceRequest", "Message", "Usage", "build_adapter"]


def build_adapter(name: str, config: AdapterConfig) -> Adapter:
    """The adapter ``[adapters.NAME]`` configures (its pool opens later, in lifespan)."""
    if isinstance(config, MockAdapterConfig):
        from .mock import MockAdapter

        return MockAdapter(name, config)
    raise ValueError(f"adapter kind {type(config).__name__} is not available")
