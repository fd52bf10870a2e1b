"""The local prompt count a request is billed with when the provider's never came, and
the settling of its extra upstream calls (a group's lost hedges, a chain's steps).

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

from ..adapters.tokens import (
    REPLY_PRIMING,
    count_prompt,
    encoding_name_for,
    load_encoding,
    message_bound,
    text_tokens_steps,
)
from ..core.slices import run_sliced
from .metering import Settled, needs_prompt_count, settle

if TYPE_CHECKING:
    from collections.abc import Iterable

    from ..adapters.base import InferenceRequest
    from ..adapters.sidecalls import SideCall
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
    return await _counted(request, _tokenizer(route))


async def _counted(request: InferenceRequest, tokenizer: str | None) -> int:
    if request.prompt_tokens is not None:
        return request.prompt_tokens
    with trio.CancelScope(shield=True), trio.move_on_after(COUNT_TIMEOUT_S):
        try:
            return await count_prompt(request.messages, request.model, tokenizer)
        except Exception:
            log.exception("the prompt of a request could not be counted; billed at its bound")
    return REPLY_PRIMING + sum(message_bound(m) for m in request.messages)


async def local_completion(text: str, model: str, route: Route) -> int | None:
    """The tokens of a reply's ``text`` as the gateway's tokenizer counts them (the one
    prompts are counted with), for a reply billed without the provider's count: one
    upstream event is one token only for OpenAI-style streams, and Anthropic, Gemini
    and Bedrock send several in one. None if it cannot be counted in time."""
    return await _text_tokens(text, model, _tokenizer(route))


async def _text_tokens(text: str, model: str, tokenizer: str | None) -> int | None:
    if not text:
        return 0
    with trio.CancelScope(shield=True), trio.move_on_after(COUNT_TIMEOUT_S):
        try:
            enc = await load_encoding(encoding_name_for(model, tokenizer))
            return await run_sliced(text_tokens_steps(enc, text))
        except Exception:
            log.exception("the reply of a request could not be counted; billed by its events")
    return None


async def settle_calls(calls: Iterable[SideCall]) -> tuple[tuple[str, Settled], ...]:
    """(model, what it is billed for) of each extra call: the provider's usage when it
    brought a believable one, else its prompt counted here and the tokens that came (its
    events, or its text's tokens where more)."""
    out = []
    for call in calls:
        prompt = None
        generated = call.generated
        if needs_prompt_count(call.usage):
            prompt = await _counted(call.request, call.tokenizer)
        if call.usage is None:  # several tokens may have come in one event
            counted = await _text_tokens(call.text, call.model, call.tokenizer)
            generated = max(generated, counted or 0)
        settled = settle(
            call.usage,
            generated=generated,
            generated_chars=call.generated_chars,
            prompt=prompt,
        )
        out.append((call.model, settled))
    return tuple(out)
