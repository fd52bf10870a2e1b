"""What each stage did, as values, and the :class:`~.outcome.Outcome` made of them.

A stage hands its report to the shell it runs in when it ends (``report()``, called in
the shell's ``finally``, whatever happened), and the pipeline keeps it; once the
request's nursery has joined, the pipeline reads nothing of the stages but these.
:func:`outcome_of` is a pure function of the reports and of what the pipeline itself
saw (:class:`RequestEnd`: the first failure, a disconnect, the stages' times, the I/O
counts), so how a request ended is decided in one place, testable without a request.

A stage that never ran (its task never started, or the pipeline failed before its
stages did) leaves the empty report: nothing parsed, prepared or answered.

The reports are frozen msgspec structs, as the other values made on every request
are (``Delta``, ``Usage``): a frozen dataclass sets each field through
``object.__setattr__``, and one of nine fields took 2.2 us to make where the struct
took 0.3 us -- five of them a request were a cost the app's own benchmark could see
(docs/benchmarks.md, app cost).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import msgspec

from ..core.errors import ReplyCapExceeded
from .metering import Settled, needs_prompt_count, settle
from .outcome import Outcome, status_of

if TYPE_CHECKING:
    from ..adapters.base import Delta, ServedBy, Usage
    from ..cache.service import Ticket
    from ..chains.plan import ChainReport
    from ..core.errors import GatewayError
    from ..core.messages import ToolCall
    from ..policies.base import PolicyContext
    from .types import Prepared, RequestInfo

log = logging.getLogger("aiserve_trio.spend")


class ParseReport(msgspec.Struct, frozen=True):
    """What the parse stage decoded."""

    #: The model the client asked for; "" if the body was never decoded.
    model: str = ""
    stream: bool = False


class ContextReport(msgspec.Struct, frozen=True):
    """What the context stage prepared and decided."""

    #: What it handed on, if it got that far.
    prepared: Prepared | None = None
    #: The policies' notes and actions (made before they run, so a block is counted).
    policy: PolicyContext | None = None
    #: What the request does with the response cache (the pipeline releases it).
    ticket: Ticket | None = None


class InferenceReport(msgspec.Struct, frozen=True):
    """What the inference stage found out."""

    #: What the response cache did for this request, once known (``hit``, ``miss``,
    #: ``coalesced``...); None when the stage never got as far.
    cache: str | None = None
    #: What the route's chain did, on a route with steps.
    chain: ChainReport | None = None


class SSEReport(msgspec.Struct, frozen=True):
    """What the sse stage wrote: the reply as the client got it."""

    #: The model the reply names, "" when nothing answered.
    served_model: str = ""
    #: Which deployment of a group answered (from the first delta).
    served: ServedBy | None = None
    first_token_at: float | None = None
    usage: Usage | None = None
    finish_reason: str | None = None
    #: The reply text delivered (after the output filters).
    delivered: str = ""
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    #: The cap that ended the reply early (``max_tokens``, ``max_reply_bytes``), if one did.
    capped: str | None = None
    #: How the reply's own framing ends with an error (the error event and the stream's
    #: end; None when no event went out): the first failure is known, and written, only
    #: once every stage has ended. None when the reply never took a shape.
    fail: Callable[[GatewayError], bytes | None] | None = None
    #: Upstream tokens the backend generated (counted by the assembler) and their
    #: characters: what a reply that never finished is billed for.
    generated: int = 0
    generated_chars: int = 0
    #: ``provider`` or ``counted``: where ``usage`` came from, once the finished reply
    #: was settled (``stages/metering.py``); None when it was not (no finish).
    usage_source: str | None = None
    #: Why the provider's usage was not believed (``negative``, ``absurd``), if it was not.
    distrusted: str | None = None


#: What any stage may report.
StageReport = ParseReport | ContextReport | InferenceReport | SSEReport


class RequestEnd(msgspec.Struct, frozen=True):
    """What the pipeline itself saw of the request, apart from its stages."""

    #: When the request ended (clock seconds), its error written.
    at: float
    #: The first failure in pipeline order, and the stage it belongs to.
    error: GatewayError | None = None
    error_stage: str | None = None
    disconnected: bool = False
    #: The furthest stage that had its input when the client went away.
    disconnect_stage: str | None = None
    #: Per stage that got its input: (when it got it, when it ended).
    stages: Mapping[str, tuple[float, float]] = msgspec.field(default_factory=dict)
    client_writes: int = 0
    client_bytes: int = 0
    upstream_reads: int = 0
    upstream_bytes: int = 0
    #: The prompt as the gateway counted it, for a reply that must be billed without
    #: the provider's count (see :func:`needs_local_prompt`); None: not counted.
    prompt_tokens: int | None = None
    #: The reply's delivered text (and tool-call arguments) as the gateway's tokenizer
    #: counts it, for a reply billed without the provider's count (several tokens may
    #: come in one upstream event); None: not counted.
    completion_tokens: int | None = None
    #: For the request that launched a cache flight (the upstream call), what the call
    #: produced -- billed to it even when it left before the end (``Cache.paid``).
    flown: Sequence[Delta] | None = None
    #: The request's extra upstream calls, settled (``billing.settle_calls``): a group's
    #: hedges that lost and tries it moved on from, a chain's steps its reply's usage
    #: does not count -- (model, usage) each, billed on top of the reply.
    side: Sequence[tuple[str, Settled]] = ()


def reply_text(sse: SSEReport) -> str:
    """What a reply generated, as the client got it: its text and tool-call arguments."""
    if not sse.tool_calls:
        return sse.delivered
    return sse.delivered + "".join(c.function.arguments for c in sse.tool_calls)


def needs_local_count(sse: SSEReport, flown: Sequence[Delta] | None) -> bool:
    """Whether the reply ``sse`` reports is billed without the provider's completion
    count, so the gateway counts its text: the backend answered and the sse stage did
    not settle it at a finish (and it launched no flight, billed as the call)."""
    return sse.usage_source is None and bool(sse.served_model) and not flown


def needs_local_prompt(sse: SSEReport, flown: Sequence[Delta] | None = None) -> bool:
    """Whether billing the reply ``sse`` reports needs the prompt counted locally: the
    backend answered, the reply was not settled when it finished, and no believable
    prompt count came with it (nor with the flight it launched, ``flown``)."""
    if sse.usage_source is not None:
        return False
    if flown:
        return needs_prompt_count(flown[-1].usage)
    return bool(sse.served_model) and needs_prompt_count(sse.usage)


def _flown(
    flown: Sequence[Delta], served_model: str, prompt: int | None
) -> tuple[str, Settled]:
    """The model and the settled usage of the upstream call a launcher paid for."""
    model = served_model or next((p.model for p in flown if p.model), "")
    last = flown[-1]
    chars = sum(
        len(p.text) + len(p.reasoning) + len(p.refusal)
        + sum(len(c.arguments or "") for c in p.tool_calls or ())
        for p in flown
    )  # fmt: skip
    usage = last.usage if last.finish_reason is not None else None
    generated = sum(p.tokens for p in flown)
    return model, settle(usage, generated=generated, generated_chars=chars, prompt=prompt)


def cache_result(context: ContextReport, inference: InferenceReport) -> str | None:
    """What the response cache did: as the inference stage learned it, else as the
    context stage admitted the request; None when a shared flight never answered."""
    ticket = context.ticket
    cache = inference.cache or (ticket.result if ticket is not None else None)
    return None if cache == "flight" else cache


def outcome_of(
    info: RequestInfo,
    end: RequestEnd,
    parse: ParseReport,
    context: ContextReport,
    inference: InferenceReport,
    sse: SSEReport,
) -> Outcome:
    """The request's :class:`Outcome` from its stages' reports (pure).

    A disconnect is no error of the request's (its status is ``client_closed``, and the
    stage is the one the client left during); a cap that ended the reply is named
    whichever way it did (a failure, or the assembler stopping the reply).

    Whatever ended it, a reply the backend answered is billed (``stages/metering.py``):
    as the sse stage settled it when it finished, else settled here from what the
    backend generated so far and the prompt's count in ``end``. The request's extra
    upstream calls (``end.side``) are added to its usage and cost, each at its own
    model's price; one the gateway counted makes the whole ``counted``.
    """
    cache = cache_result(context, inference)
    served_model = sse.served_model
    usage = sse.usage
    source = sse.usage_source
    distrusted = sse.distrusted
    if end.flown and source is None:
        # It launched a flight and did not see its end: the whole call is its bill.
        served_model, settled = _flown(end.flown, served_model, end.prompt_tokens)
        usage, source, distrusted = settled.usage, settled.source, settled.distrusted
    elif served_model and source is None:
        settled = settle(
            usage,
            # The events, or the text's tokens where an event held several.
            generated=max(sse.generated, end.completion_tokens or 0),
            generated_chars=sse.generated_chars,
            prompt=end.prompt_tokens,
        )
        usage, source, distrusted = settled.usage, settled.source, settled.distrusted
    cost, saved, cache_cost = _priced(info, served_model, usage, cache)
    for model, extra in end.side:
        # The provider billed each of these calls too (sent, whatever became of it).
        more, _, more_cache = _priced(info, model, extra.usage, None)
        cost += more
        cache_cost += more_cache
        usage = extra.usage if usage is None else _plus(usage, extra.usage)
        if source is None or extra.source == "counted":
            source = extra.source
        distrusted = distrusted or extra.distrusted
    error = end.error
    gone = end.disconnected
    return Outcome(
        request_id=info.request_id,
        route=info.route.label,
        channel=info.channel,
        arrival=info.budget.arrival,
        ended=end.at,
        status=status_of(error, gone),
        info=info,
        model=parse.model,
        served_model=served_model,
        stream=parse.stream,
        error=None if gone else error,
        error_stage=end.disconnect_stage if gone else end.error_stage,
        prepared=context.prepared,
        policy=context.policy,
        stages=end.stages,
        first_token_at=sse.first_token_at,
        usage=usage,
        finish_reason=sse.finish_reason,
        delivered=sse.delivered,
        tool_calls=sse.tool_calls,
        capped=error.code if isinstance(error, ReplyCapExceeded) else sse.capped,
        disconnected=gone,
        client_writes=end.client_writes,
        client_bytes=end.client_bytes,
        upstream_reads=end.upstream_reads,
        upstream_bytes=end.upstream_bytes,
        cache=cache,
        chain=inference.chain,
        tenant=info.tenant,
        key_id=info.key_id,
        served=sse.served,
        cost=cost,
        saved=saved,
        cache_cost=cache_cost,
        usage_source=source,
        distrusted=distrusted,
    )


def _plus(a: Usage, b: Usage) -> Usage:
    """Two calls' usage as one (the reply's details kept)."""
    return msgspec.structs.replace(
        a,
        prompt_tokens=a.prompt_tokens + b.prompt_tokens,
        completion_tokens=a.completion_tokens + b.completion_tokens,
        cache_read_tokens=a.cache_read_tokens + b.cache_read_tokens,
        cache_write_tokens=a.cache_write_tokens + b.cache_write_tokens,
    )


def _priced(
    info: RequestInfo, served_model: str, usage: Usage | None, cache: str | None
) -> tuple[float, float, float]:
    """(cost, saved, the part of cost paid for prompt-cache reads and writes) of a request
    that ended (see ``spend/prices.py``): never negative, and a pricing that fails is
    logged and costs 0 -- the request still gets its audit row and its token charge."""
    pricing = info.route.pricing
    if pricing is None or not served_model:
        return 0.0, 0.0, 0.0
    try:
        cost, saved = pricing.charge(served_model, usage, cache)
        cache_cost = pricing.cache_cost(served_model, usage) if cost else 0.0
    except Exception:
        log.exception("request %s could not be priced", info.request_id)
        return 0.0, 0.0, 0.0
    return max(0.0, cost), max(0.0, saved), max(0.0, cache_cost)
