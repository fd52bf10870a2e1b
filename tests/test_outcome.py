"""How a request ended, from its stages' reports alone (``stages/report.py``, pure).

No request runs here: each case is the reports the four stages would hand back and
what the pipeline saw itself, and the :class:`Outcome` the audit row, the metrics, the
spend ledger and the session write-back read is checked field by field.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgspec
import pytest

from aiserve_trio.adapters.base import InferenceRequest, ServedBy, Usage
from aiserve_trio.adapters.mock import MockAdapter
from aiserve_trio.cache.service import Ticket
from aiserve_trio.chains.plan import ChainReport
from aiserve_trio.config import MockAdapterConfig
from aiserve_trio.core.budgets import plan
from aiserve_trio.core.errors import (
    PolicyViolation,
    ReplyCapExceeded,
    StageDeadlineExceeded,
    UpstreamProtocolError,
    UpstreamTimeout,
    WriteTimeout,
)
from aiserve_trio.core.messages import FunctionCall, ToolCall
from aiserve_trio.observability.tracing import NOOP_TRACE
from aiserve_trio.policies.base import PolicyContext
from aiserve_trio.spend.prices import Pricing
from aiserve_trio.stages.outcome import CLIENT_CLOSED
from aiserve_trio.stages.parse import decode_request
from aiserve_trio.stages.report import (
    ContextReport,
    InferenceReport,
    ParseReport,
    RequestEnd,
    SSEReport,
    cache_result,
    outcome_of,
)
from aiserve_trio.stages.types import ParsedRequest, Prepared, RequestInfo, Route

from .conftest import make_config

#: 3 per million input tokens, 15 per million output tokens.
PRICES = """
[pricing]
currency = "USD"
[pricing.models."aiserve-mock"]
input_per_mtok = 3.0
output_per_mtok = 15.0
"""
ARRIVAL = 100.0
#: 1,000 input and 200 output tokens: 0.003 + 0.003.
USAGE = Usage(prompt_tokens=1000, completion_tokens=200)
COST = 1000 * 3.0 / 1e6 + 200 * 15.0 / 1e6
TIMES = {"parse": (100.0, 100.001), "context": (100.001, 100.002), "inference": (100.002, 100.5)}


def _info() -> RequestInfo:
    cfg = make_config(PRICES)
    route_cfg = cfg.routes[0]
    mock = cfg.adapters["mock"]
    assert isinstance(mock, MockAdapterConfig)
    route = Route(
        config=route_cfg,
        label="chat",
        adapter=MockAdapter("mock", mock),
        policies=[],
        tenant="default",
        pricing=Pricing(cfg.pricing),
    )
    budget = plan(ARRIVAL, 30_000, reserve_ms=500, min_inference_ms=100, context=0.1, inference=0.8)
    return RequestInfo(
        request_id="chatcmpl-1",
        route=route,
        budget=budget,
        created=1_700_000_000,
        channel="web",
        session_id=None,
        tenant="shop",
        headers={},
        trace=NOOP_TRACE,
        key_id="carol",
    )


INFO = _info()
LIMITS = make_config().limits


def _parsed(stream: bool = True) -> ParsedRequest:
    body = b'{"model": "aiserve-mock", "messages": [{"role": "user", "content": "hi"}]'
    body += b', "stream": true}' if stream else b"}"
    return decode_request(body, LIMITS, None)


def _policy() -> PolicyContext:
    return PolicyContext(route="chat", channel="web", tenant="shop", request_id="chatcmpl-1")


def _prepared(parsed: ParsedRequest, ticket: Ticket | None = None) -> Prepared:
    request = InferenceRequest(
        request_id="chatcmpl-1",
        model=parsed.model,
        messages=list(parsed.messages),
        deadline=ARRIVAL + 27.0,
        native=parsed.native,
        native_api="messages" if parsed.native is not None else "",
    )
    return Prepared(
        parsed=parsed,
        inference=request,
        filters=[],
        side_filters=list,
        policy=_policy(),
        degraded=None,
        new_turns=list(parsed.messages),
        cache=ticket,
    )


#: What the sse stage reports after writing a whole reply.
ANSWERED = SSEReport(
    served_model="aiserve-mock",
    first_token_at=100.1,
    usage=USAGE,
    finish_reason="stop",
    delivered="hello there",
    # What the backend generated, as the assembler counted it (its 200 tokens' text).
    generated=200,
    generated_chars=900,
)
#: What the pipeline saw of a request that ran its four stages.
ENDED = RequestEnd(
    at=100.6,
    stages={**TIMES, "sse": (100.1, 100.6)},
    client_writes=7,
    client_bytes=900,
    upstream_reads=5,
    upstream_bytes=1200,
)


def _answered(text: str = "hello there", **kw: Any) -> SSEReport:
    """What the sse stage reports after writing ``text`` (and ``kw`` changed)."""
    return msgspec.structs.replace(ANSWERED, delivered=text, **kw)


def _end(**kw: Any) -> RequestEnd:
    return msgspec.structs.replace(ENDED, **kw)


def test_a_reply_that_went_out_whole_is_ok_and_priced_at_the_model_that_answered() -> None:
    parsed = _parsed()
    prepared = _prepared(parsed)
    served = ServedBy(deployment="east", fallback=1)
    call = ToolCall(id="call_1", function=FunctionCall(name="f", arguments='{"a": 1}'))
    out = outcome_of(
        INFO,
        _end(),
        ParseReport(parsed.model, parsed.stream),
        ContextReport(prepared, prepared.policy, None),
        InferenceReport(),
        _answered(served=served, tool_calls=[call]),
    )
    assert out.ok
    assert out.status == "ok"
    assert not out.cut
    assert (out.request_id, out.route, out.channel, out.tenant, out.key_id) == (
        "chatcmpl-1",
        "chat",
        "web",
        "shop",
        "carol",
    )
    assert (out.arrival, out.ended) == (ARRIVAL, 100.6)
    assert (out.model, out.served_model, out.stream) == ("aiserve-mock", "aiserve-mock", True)
    assert out.prepared is prepared
    assert out.policy is prepared.policy
    assert out.delivered == "hello there"
    assert out.tool_calls == [call]
    assert out.usage == USAGE
    assert out.finish_reason == "stop"
    assert out.first_token_at == 100.1
    assert out.served == served
    assert out.stages["sse"] == (100.1, 100.6)
    assert out.stages["parse"] == TIMES["parse"]
    assert (out.client_writes, out.client_bytes, out.upstream_reads, out.upstream_bytes) == (
        7,
        900,
        5,
        1200,
    )
    assert out.cost == pytest.approx(COST)
    assert out.saved == 0.0
    assert out.cache_cost == 0.0
    assert out.error is None
    assert out.error_stage is None
    assert out.capped is None
    assert out.cache is None
    assert out.chain is None


def test_a_failed_stage_is_the_error_and_the_others_reports_still_count() -> None:
    # The backend broke off after 3 words went out: the inference stage failed, the
    # sse stage had already written part of the reply and no finish.
    parsed = _parsed()
    prepared = _prepared(parsed)
    err = UpstreamProtocolError("the upstream's reply did not finish")
    out = outcome_of(
        INFO,
        _end(error=err, error_stage="inference"),
        ParseReport(parsed.model, parsed.stream),
        ContextReport(prepared, prepared.policy, None),
        InferenceReport(),
        _answered("one two three", finish_reason=None, usage=None),
    )
    assert out.status == "bad_gateway"
    assert not out.ok
    assert out.cut
    assert out.error is err
    assert out.error_stage == "inference"
    assert out.delivered == "one two three"
    assert out.finish_reason is None
    assert out.prepared is prepared  # the session write-back still sees the turn
    assert out.capped is None


def test_a_blocked_request_keeps_the_policy_that_blocked_it_and_nothing_answered() -> None:
    parsed = _parsed(stream=False)
    policy = _policy()
    policy.record("pii", "blocked")
    err = PolicyViolation("blocked by pii", code="pii")
    out = outcome_of(
        INFO,
        _end(error=err, error_stage="context", stages=TIMES, client_writes=1),
        ParseReport(parsed.model, parsed.stream),
        ContextReport(None, policy, None),
        InferenceReport(),
        SSEReport(),
    )
    assert out.status == "forbidden"
    assert out.error_stage == "context"
    assert out.policy is policy
    assert out.policy.actions == [("pii", "blocked")]
    assert out.prepared is None
    assert (out.model, out.stream, out.served_model) == ("aiserve-mock", False, "")
    assert out.delivered == ""
    assert out.tool_calls == []
    assert out.usage is None
    assert out.cost == 0.0
    assert out.saved == 0.0
    assert "sse" not in out.stages


def test_a_body_never_decoded_has_no_model() -> None:
    err = UpstreamTimeout("x")  # any failure before the parse stage decoded the body
    out = outcome_of(
        INFO,
        _end(error=err, error_stage="parse", stages={}),
        ParseReport(),
        ContextReport(),
        InferenceReport(),
        SSEReport(),
    )
    assert (out.model, out.model_label, out.stream) == ("", "none", False)
    assert out.status == "gateway_timeout"
    assert out.error_stage == "parse"


@pytest.mark.parametrize("told", ["hit", "semantic-hit", "coalesced"])
def test_a_reply_from_the_cache_costs_nothing_and_counts_what_it_saved(told: str) -> None:
    parsed = _parsed()
    ticket = Ticket("chat", "hit" if told != "coalesced" else "flight")
    prepared = _prepared(parsed, ticket)
    out = outcome_of(
        INFO,
        _end(),
        ParseReport(parsed.model, parsed.stream),
        ContextReport(prepared, prepared.policy, ticket),
        InferenceReport(cache=told),
        _answered(),
    )
    assert out.cache == told
    assert out.cost == 0.0
    assert out.cache_cost == 0.0
    assert out.saved == pytest.approx(COST)


def test_a_miss_is_paid_for() -> None:
    parsed = _parsed()
    ticket = Ticket("chat", "flight")
    prepared = _prepared(parsed, ticket)
    out = outcome_of(
        INFO,
        _end(),
        ParseReport(parsed.model, parsed.stream),
        ContextReport(prepared, prepared.policy, ticket),
        InferenceReport(cache="miss"),
        _answered(),
    )
    assert out.cache == "miss"
    assert out.cost == pytest.approx(COST)
    assert out.saved == 0.0


def test_what_the_cache_did_when_the_inference_stage_never_learned_it() -> None:
    # Admitted, then the request ended before the inference stage began: the ticket's
    # own result, except a flight whose answer never came (no cache result at all).
    bypass = Ticket("chat", "bypass")
    assert cache_result(ContextReport(ticket=bypass), InferenceReport()) == "bypass"
    flight = Ticket("chat", "flight")
    assert cache_result(ContextReport(ticket=flight), InferenceReport()) is None
    assert cache_result(ContextReport(ticket=flight), InferenceReport("coalesced")) == "coalesced"
    assert cache_result(ContextReport(), InferenceReport()) is None
    out = outcome_of(
        INFO,
        _end(error=UpstreamTimeout("late"), error_stage="inference"),
        ParseReport("aiserve-mock", True),
        ContextReport(ticket=flight),
        InferenceReport(),
        SSEReport(),
    )
    assert out.cache is None
    assert out.status == "gateway_timeout"


def test_a_native_request_carries_the_clients_bytes_and_no_cache() -> None:
    # A Messages client on a backend that speaks Messages: the context stage admits
    # nothing to the cache (the provider's own events are not the cache's to replay).
    native = b'{"model":"aiserve-mock","max_tokens":64,"messages":[]}'
    parsed = replace(_parsed(), native=native)
    prepared = _prepared(parsed)
    out = outcome_of(
        INFO,
        _end(),
        ParseReport(parsed.model, parsed.stream),
        ContextReport(prepared, prepared.policy, None),
        InferenceReport(),
        _answered(),
    )
    assert out.prepared is not None
    assert out.prepared.inference.native == native
    assert out.prepared.parsed.native == native
    assert out.cache is None
    assert out.ok
    assert out.cost == pytest.approx(COST)


def test_a_disconnect_is_no_error_and_names_the_stage_the_client_left_during() -> None:
    # The client went away mid-stream; the sse stage's write then failed too -- but the
    # request ended for the disconnect: client_closed, no error, what had gone out.
    parsed = _parsed()
    prepared = _prepared(parsed)
    out = outcome_of(
        INFO,
        _end(
            error=WriteTimeout("the client stopped reading"),
            error_stage="sse",
            disconnected=True,
            disconnect_stage="inference",
        ),
        ParseReport(parsed.model, parsed.stream),
        ContextReport(prepared, prepared.policy, None),
        InferenceReport(),
        _answered("one two", finish_reason=None, usage=None),
    )
    assert out.status == CLIENT_CLOSED
    assert out.disconnected
    assert out.error is None
    assert out.error_stage == "inference"
    assert out.delivered == "one two"
    assert out.cut


def test_a_cap_is_named_whichever_way_it_ended_the_reply() -> None:
    parsed = _parsed()
    prepared = _prepared(parsed)
    reports = (
        ParseReport(parsed.model, parsed.stream),
        ContextReport(prepared, prepared.policy, None),
        InferenceReport(),
    )
    # The assembler stopped the reply at max_tokens: ok, and capped.
    by_tokens = outcome_of(
        INFO, _end(), *reports, _answered(capped="max_tokens", finish_reason="length")
    )
    assert by_tokens.ok
    assert by_tokens.capped == "max_tokens"
    # The sse stage failed with the cap (max_stream_s): an error, and capped too.
    cap = ReplyCapExceeded("too long", param="max_stream_s", code="max_stream_s")
    by_time = outcome_of(
        INFO, _end(error=cap, error_stage="sse"), *reports, _answered(finish_reason=None)
    )
    assert by_time.status == "bad_gateway"
    assert by_time.capped == "max_stream_s"


def test_a_chains_report_is_the_outcomes() -> None:
    chain = ChainReport(steps=(), labels={"intent": "billing"}, new_turns=None)
    out = outcome_of(
        INFO,
        _end(),
        ParseReport("aiserve-mock", True),
        ContextReport(),
        InferenceReport(chain=chain),
        _answered(),
    )
    assert out.chain is chain
    assert out.chain.labels == {"intent": "billing"}


def test_an_unpriced_route_costs_nothing() -> None:
    info = replace(INFO, route=replace(INFO.route, pricing=None))
    out = outcome_of(
        info,
        _end(),
        ParseReport("aiserve-mock", True),
        ContextReport(),
        InferenceReport(),
        _answered(),
    )
    assert out.ok
    assert (out.cost, out.saved, out.cache_cost) == (0.0, 0.0, 0.0)


# --- billing on every ending (issue 50, items 1 and 5) ----------------------------------

#: 1,000 prompt tokens as the gateway counted them; 30 tokens generated before the end.
COUNTED_PROMPT = 1000
CUT = {"finish_reason": None, "usage": None, "generated": 30, "generated_chars": 120}
CUT_COST = 1000 * 3.0 / 1e6 + 30 * 15.0 / 1e6


@pytest.mark.parametrize(
    "end",
    [
        pytest.param({"disconnected": True, "disconnect_stage": "sse"}, id="client-left"),
        pytest.param(
            {"error": StageDeadlineExceeded("inference"), "error_stage": "inference"},
            id="deadline",
        ),
        pytest.param(
            {
                "error": ReplyCapExceeded("too long", param="x", code="max_reply_bytes"),
                "error_stage": "sse",
            },
            id="max-reply-bytes",
        ),
        pytest.param(
            {"error": UpstreamProtocolError("dropped"), "error_stage": "inference"},
            id="upstream-drop",
        ),
    ],
)
def test_a_reply_that_never_finished_is_billed_for_what_was_generated(
    end: dict[str, Any],
) -> None:
    parsed = _parsed()
    prepared = _prepared(parsed)
    out = outcome_of(
        INFO,
        _end(prompt_tokens=COUNTED_PROMPT, **end),
        ParseReport(parsed.model, parsed.stream),
        ContextReport(prepared, prepared.policy, None),
        InferenceReport(),
        _answered("some words", **CUT),
    )
    assert out.usage == Usage(prompt_tokens=COUNTED_PROMPT, completion_tokens=30)
    assert out.usage_source == "counted"
    assert out.distrusted is None
    assert out.cost == pytest.approx(CUT_COST)


def test_a_reply_nothing_answered_is_not_billed() -> None:
    parsed = _parsed()
    prepared = _prepared(parsed)
    out = outcome_of(
        INFO,
        _end(error=StageDeadlineExceeded("inference"), error_stage="inference"),
        ParseReport(parsed.model, parsed.stream),
        ContextReport(prepared, prepared.policy, None),
        InferenceReport(),
        SSEReport(),
    )
    assert (out.usage, out.usage_source, out.cost) == (None, None, 0.0)


def test_a_backends_negative_usage_is_replaced_by_the_local_count_and_never_costs_less_than_0() -> (
    None
):
    parsed = _parsed()
    prepared = _prepared(parsed)
    bad = Usage(prompt_tokens=-5000, completion_tokens=-200)
    out = outcome_of(
        INFO,
        _end(prompt_tokens=COUNTED_PROMPT),
        ParseReport(parsed.model, parsed.stream),
        ContextReport(prepared, prepared.policy, None),
        InferenceReport(),
        _answered(usage=bad, generated=30, generated_chars=120),
    )
    assert out.ok
    assert out.usage == Usage(prompt_tokens=COUNTED_PROMPT, completion_tokens=30)
    assert (out.usage_source, out.distrusted) == ("counted", "negative")
    assert out.cost == pytest.approx(CUT_COST)


def test_more_completion_tokens_than_the_text_holds_is_not_believed() -> None:
    # 20 characters cannot hold 5,000 tokens (at most 4 a character, and some slack);
    # the prompt's count is the provider's, which is believable.
    out = outcome_of(
        INFO,
        _end(),
        ParseReport("aiserve-mock", True),
        ContextReport(),
        InferenceReport(),
        _answered(
            usage=Usage(prompt_tokens=1000, completion_tokens=5000),
            generated=7,
            generated_chars=20,
        ),
    )
    assert out.usage == Usage(prompt_tokens=1000, completion_tokens=7)
    assert (out.usage_source, out.distrusted) == ("counted", "absurd")


def test_a_pricing_that_fails_keeps_the_usage_and_costs_nothing() -> None:
    class Broken(Pricing):
        def charge(self, model: str, usage: Usage | None, cache: str | None) -> tuple[float, float]:
            raise ZeroDivisionError("a bug in pricing")

    broken = Broken(make_config(PRICES).pricing)
    info = replace(INFO, route=replace(INFO.route, pricing=broken))
    out = outcome_of(
        info,
        _end(),
        ParseReport("aiserve-mock", True),
        ContextReport(),
        InferenceReport(),
        _answered(),
    )
    assert out.usage == USAGE
    assert out.usage_source == "provider"
    assert out.cost == 0.0
