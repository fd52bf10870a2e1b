"""Model backends behind one small interface (see ``base.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import AdapterConfig, MockAdapterConfig, OpenAIAdapterConfig, VllmWsAdapterConfig
from ..observability.events import NULL_HOOK, UpstreamHook
from .base import Adapter, Delta, InferenceRequest, Message, Usage

if TYPE_CHECKING:
    from ..errors import UpstreamError

__all__ = ["Adapter", "Delta", "InferenceRequest", "Message", "Usage", "build_adapter"]


def build_adapter(name: str, config: AdapterConfig, hook: UpstreamHook = NULL_HOOK) -> Adapter:
    """The adapter ``[adapters.NAME]`` configures (its pool opens later, in lifespan).

    Args:
        name: the adapter's key in the config.
        config: its table.
        metrics: when given, upstream retries and errors are counted in
            ``aiserve_upstream_retries`` / ``aiserve_upstream_errors``.
    """
    if isinstance(config, MockAdapterConfig):
        from .mock import MockAdapter

        return MockAdapter(name, config)
    adapter: OpenAIAdapter | VllmWsAdapter
    if isinstance(config, OpenAIAdapterConfig):
        from .openai import OpenAIAdapter

        adapter = OpenAIAdapter(name, config)
    elif isinstance(config, VllmWsAdapterConfig):
        from .vllm_ws import VllmWsAdapter

        adapter = VllmWsAdapter(name, config)
    else:
        raise ValueError(f"adapter kind {type(config).__name__} is not available")

    def on_retry(err: UpstreamError) -> None:
        hook.retrying(name, err)

    def on_error(err: UpstreamError) -> None:
        hook.failed(name, err)

    adapter.on_retry, adapter.on_error = on_retry, on_error
    return adapter


if TYPE_CHECKING:
    from .openai import OpenAIAdapter
    from .vllm_ws import VllmWsAdapter
