"""The local prompt count a request is billed with when the provider's never came.

:func:`~aiserve_trio.stages.metering.settle` is pure; this is the one part of billing
that awaits: the gateway's tokenizer (``adapters/tokens.py``), whose table loads in a
thread the first time (the event loop never stalls on it) and counts in slices. It
runs shielded and bounded, since it runs when a request ends -- also after its client
left -- and a request is billed whether or not the count could be made: past
:data:`COUNT_TIMEOUT_S`, or on a tokenizer's error, the prompt's UTF-8 bound stands in.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from ..adapters.tokens import REPLY_PRIMING, count_prompt, message_bound

if TYPE_CHECKING:
    from ..adapters.base import InferenceRequest
    from .types import Route

log = logging.getLogger("aiserve_trio.spend")

#: Seconds the count may take (the first loads a tokenizer table: 0.15-0.4 s).
COUNT_TIMEOUT_S = 5.0


def _tokenizer(route: Route) -> str | None:
    """The route's adapter's ``tokenizer`` setting (None: by model family)."""
    config = getattr(route.adapter, "config", None)
    name = getattr(config, "tokenizer", None)
    return name if isinstance(name, str) else None


async def local_prompt(request: InferenceRequest, route: Route) -> int:
    """The prompt tokens of ``request`` as the gateway counts them: the count fitting
    made already, else the tokenizer's; the UTF-8 bound if that cannot be had."""
    if request.prompt_tokens is not None:
        return request.prompt_tokens
    with trio.CancelScope(shield=True), trio.move_on_after(COUNT_TIMEOUT_S):
        try:
            return await count_prompt(request.messages, request.model, _tokenizer(route))
        except Exception:
            log.exception("the prompt of a request could not be counted; billed at its bound")
    return REPLY_PRIMING + sum(message_bound(m) for m in request.messages)
