"""A native Messages stream through the response assembler, without sockets: the
provider's events in (``adapters/anthropic_native.py``), the client's bytes out
(``apis/messages.py``'s native framer) -- as sent when no policy changes them,
redacted in the same block when one does, whatever way the provider split them."""

from __future__ import annotations

import functools
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from aiserve_trio.adapters.anthropic_native import AnthropicNativeDecoder
from aiserve_trio.adapters.responses_native import ResponsesNativeDecoder
from aiserve_trio.apis import CODECS
from aiserve_trio.apis.messages import collect
from aiserve_trio.apis.responses_native import collect as collect_responses
from aiserve_trio.config import build_policies
from aiserve_trio.policies.base import OutputFilter, Policy, PolicyContext
from aiserve_trio.stages.assembler import ResponseAssembler

from .conftest import make_config


def ev(data: dict[str, Any]) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (data["type"].encode(), json.dumps(data).encode())


def text_delta(i: int, text: str) -> bytes:
    return ev(
        {"type": "content_block_delta", "index": i, "delta": {"type": "text_delta", "text": text}}
    )


def stream(answer: list[str], args: list[str]) -> list[bytes]:
    """A reply: thinking with its signature, text in ``answer``'s pieces, a tool call."""
    return [
        ev(
            {
                "type": "message_start",
                "message": {
                    "id": "msg_up",
                    "type": "message",
                    "role": "assistant",
                    "model": "claude-sonnet-4-5",
                    "content": [],
                    "stop_reason": None,
                    "usage": {"input_tokens": 9, "output_tokens": 1},
                },
            }
        ),
        ev({"type": "ping"}),
        ev({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
        ev({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Let me see."}}),
        ev({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "c2ln"}}),
        ev({"type": "content_block_stop", "index": 0}),
        ev({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}),
        *(text_delta(1, piece) for piece in answer),
        ev({"type": "content_block_stop", "index": 1}),
        ev({"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {}}}),
        *(
            ev({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": a}})
            for a in args
        ),
        ev({"type": "content_block_stop", "index": 2}),
        ev({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None}, "usage": {"output_tokens": 12}}),
        ev({"type": "message_stop"}),
    ]  # fmt: skip


@functools.cache
def gdpr() -> Policy:
    """The gdpr-redact policy of the default config (built once: it takes a while)."""
    (policy,) = build_policies(["gdpr-redact"], make_config())
    return policy


def run(reads: list[bytes], *, redact: bool, stream_: bool = True) -> bytes:
    filters: list[OutputFilter] = []
    side: Any = None
    if redact:
        policy = gdpr()
        ctx = PolicyContext(route="claude", channel="app", tenant="t", request_id="r")

        def side() -> list[OutputFilter]:
            flt = policy.output_filter(ctx)
            assert flt is not None
            return [flt]

        filters = side()
    asm = ResponseAssembler(
        "msg_gw",
        "claude-sonnet-4-5",
        7,
        stream=stream_,
        filters=filters,
        side_filters=side,
        codec=CODECS["messages"],
        view=None,
        native=True,
    )
    decoder = AnthropicNativeDecoder("up")
    out = b""
    for data in reads:
        for delta in decoder.feed(data):
            out += asm.feed(delta, 1.0)
    out += asm.feed(decoder.end(), 2.0)
    return out + asm.finish(3.0)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


ANSWER = ["I will read ", "it.", " Card 4111 ", "1111 1111 ", "1111, mail a.b@", "example.com."]
ARGS = ['{"file_path": "/tmp/', 'note.txt", "card": "4111 1111 ', '1111 1111"}']


@settings(deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=8))
def test_without_policies_the_client_gets_the_providers_events_as_sent(cuts: list[int]) -> None:
    events = stream(ANSWER, ARGS)
    sent = b"".join(events)
    out = run(split(sent, cuts), redact=False)
    # Every event but the provider's keep-alive, byte for byte, in order.
    assert out == b"".join(e for e in events if not e.startswith(b"event: ping"))


@settings(deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=8))
def test_a_card_number_split_across_events_is_redacted_in_its_own_block(cuts: list[int]) -> None:
    sent = b"".join(stream(ANSWER, ARGS))
    out = run(split(sent, cuts), redact=True)
    assert b"4111" not in out
    assert b"example.com" not in out
    message = json.loads(collect(out))
    kinds = [b["type"] for b in message["content"]]
    assert kinds == ["thinking", "text", "tool_use"]
    thinking, text, tool = message["content"]
    assert thinking["signature"] == "c2ln"  # the provider's, untouched
    assert text["text"] == "I will read it. Card [CARD], mail [EMAIL]."
    assert tool["input"] == {"file_path": "/tmp/note.txt", "card": "[CARD]"}
    assert message["stop_reason"] == "tool_use"
    assert message["id"] == "msg_up"
    # Every delta names the block it belongs to, between its start and its stop.
    open_: set[int] = set()
    for chunk in out.split(b"\n\n")[:-1]:
        data = json.loads(chunk.split(b"data: ", 1)[1])
        if data["type"] == "content_block_start":
            open_.add(data["index"])
        elif data["type"] == "content_block_delta":
            assert data["index"] in open_
        elif data["type"] == "content_block_stop":
            open_.remove(data["index"])


def test_a_client_that_did_not_stream_gets_the_events_added_up() -> None:
    body = run([b"".join(stream(ANSWER, ARGS))], redact=True, stream_=False)
    message = json.loads(body)
    assert message["type"] == "message"
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use"]
    assert message["content"][1]["text"] == "I will read it. Card [CARD], mail [EMAIL]."
    assert message["usage"]["output_tokens"] == 12


# --- Responses ---------------------------------------------------------------------


def rev(seq: int, data: dict[str, Any]) -> bytes:
    data = {**data, "sequence_number": seq}
    return b"event: %s\ndata: %s\n\n" % (data["type"].encode(), json.dumps(data).encode())


def responses_stream(pieces: list[str]) -> list[bytes]:
    """A Responses reply: one message item whose text comes in ``pieces``."""
    text = "".join(pieces)
    part = {"type": "output_text", "text": text, "annotations": []}
    item = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [part],
    }
    at = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    head = {"id": "resp_up", "object": "response", "status": "in_progress", "output": []}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": head},
        {"type": "response.output_item.added", "output_index": 0, "item": {**item, "status": "in_progress", "content": []}},
        {"type": "response.content_part.added", **at, "part": {**part, "text": ""}},
        *({"type": "response.output_text.delta", **at, "delta": p} for p in pieces),
        {"type": "response.output_text.done", **at, "text": text},
        {"type": "response.content_part.done", **at, "part": part},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {"type": "response.completed", "response": {**head, "status": "completed", "output": [item], "usage": {"input_tokens": 5, "output_tokens": 9}}},
    ]  # fmt: skip
    return [rev(i, e) for i, e in enumerate(events)]


def run_responses(reads: list[bytes], *, redact: bool, stream_: bool = True) -> bytes:
    filters: list[OutputFilter] = []
    if redact:
        policy = gdpr()
        ctx = PolicyContext(route="codex", channel="app", tenant="t", request_id="r")
        flt = policy.output_filter(ctx)
        assert flt is not None
        filters = [flt]
    asm = ResponseAssembler(
        "resp_gw",
        "sim-model",
        7,
        stream=stream_,
        filters=filters,
        codec=CODECS["responses"],
        view=None,
        native=True,
    )
    decoder = ResponsesNativeDecoder("up")
    out = b""
    for data in reads:
        for delta in decoder.feed(data):
            out += asm.feed(delta, 1.0)
    out += asm.feed(decoder.end(), 2.0)
    return out + asm.finish(3.0)


PIECES = ["Card 4111 ", "1111 1111 ", "1111, mail a.b@", "example.com."]


@settings(deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=6))
def test_responses_without_policies_pass_as_sent(cuts: list[int]) -> None:
    events = responses_stream(PIECES)
    sent = b"".join(events)
    assert run_responses(split(sent, cuts), redact=False) == sent


@settings(deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=6))
def test_responses_redacted_in_the_deltas_and_in_every_event_that_repeats_the_text(
    cuts: list[int],
) -> None:
    out = run_responses(split(b"".join(responses_stream(PIECES)), cuts), redact=True)
    assert b"4111" not in out
    assert b"example.com" not in out
    streamed = "".join(
        json.loads(chunk.split(b"data: ", 1)[1])["delta"]
        for chunk in out.split(b"\n\n")
        if chunk.startswith(b"event: response.output_text.delta")
    )
    assert streamed == "Card [CARD], mail [EMAIL]."
    response = json.loads(collect_responses(out))
    assert response["output"][0]["content"][0]["text"] == "Card [CARD], mail [EMAIL]."
    assert response["id"] == "resp_up"


def test_a_responses_client_that_did_not_stream_gets_the_completed_response() -> None:
    body = json.loads(
        run_responses([b"".join(responses_stream(PIECES))], redact=True, stream_=False)
    )
    assert body["object"] == "response"
    assert body["output"][0]["content"][0]["text"] == "Card [CARD], mail [EMAIL]."
    assert body["usage"]["output_tokens"] == 9
