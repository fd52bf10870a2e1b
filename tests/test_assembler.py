"""The response assembler, without sockets: deltas in, the bytes a client gets out."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiserve_trio.adapters.base import Delta, Usage
from aiserve_trio.apis import CODECS
from aiserve_trio.apis.common import State
from aiserve_trio.apis.responses import ResponsesRequest
from aiserve_trio.config import build_policies
from aiserve_trio.core.errors import StageDeadlineExceeded, UpstreamProtocolError
from aiserve_trio.policies.base import OutputFilter, PolicyContext
from aiserve_trio.stages.assembler import AssemblerStateError, ResponseAssembler

from .conftest import make_config

TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=200)


def events(raw: bytes) -> list[tuple[str | None, str]]:
    """(id, data) of each event in ``raw``."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((fields.get("id"), fields["data"]))
    return out


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(text)}), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def run_stream(asm: ResponseAssembler, pieces: list[str], finish: str = "stop") -> bytes:
    out = b""
    for i, piece in enumerate(pieces):
        out += asm.feed(Delta(text=piece), float(i))
    out += asm.feed(
        Delta(finish_reason=finish, usage=Usage(prompt_tokens=3, completion_tokens=4)), 99.0
    )
    return out + asm.finish(100.0)


@given(TEXT, st.lists(st.integers(0, 200), max_size=12))
def test_a_stream_carries_the_text_whole_however_it_was_split(text: str, cuts: list[int]) -> None:
    asm = ResponseAssembler("chatcmpl-1", "m", 7, stream=True, include_usage=True)
    evs = events(run_stream(asm, split(text, cuts)))
    assert [i for i, _ in evs[:-1]] == [str(n) for n in range(len(evs) - 1)]  # numbered
    assert evs[-1] == (None, "[DONE]")
    chunks = [json.loads(d) for _, d in evs[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == text == asm.delivered
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert asm.state is State.DONE


@given(st.lists(st.integers(0, 80), max_size=10))
def test_a_card_number_split_anywhere_never_reaches_the_client(cuts: list[int]) -> None:
    text = "pay with 4111 1111 1111 1111 today, or mail x.y@example.com please"
    (redact,) = build_policies(["gdpr-redact"], make_config())
    ctx = PolicyContext(route="chat", channel="app", tenant="t", request_id="r")
    flt = redact.output_filter(ctx)
    assert flt is not None
    asm = ResponseAssembler("chatcmpl-1", "m", 7, stream=True, filters=[flt])
    raw = run_stream(asm, split(text, cuts)).decode()
    assert "4111" not in raw
    assert "example.com" not in raw
    assert asm.delivered == "pay with [CARD] today, or mail [EMAIL] please"


def test_a_whole_reply_is_one_json_body_with_the_first_token_time_at_the_end() -> None:
    asm = ResponseAssembler("chatcmpl-2", "m", 7, stream=False)
    assert asm.feed(Delta(text="hello "), 1.0) == b""
    assert asm.feed(Delta(text="world", finish_reason="length"), 2.0) == b""
    body = json.loads(asm.finish(3.0))
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello world"}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    assert asm.first_token_at == 1.0


def test_failing_before_anything_was_sent_leaves_the_answer_to_an_http_status() -> None:
    asm = ResponseAssembler("chatcmpl-3", "m", 7, stream=True)
    assert asm.fail(StageDeadlineExceeded("context")) is None
    assert asm.state is State.FAILED


def test_failing_mid_stream_ends_with_the_error_event_and_done() -> None:
    asm = ResponseAssembler("chatcmpl-4", "m", 7, stream=True)
    first = events(asm.feed(Delta(text="par"), 0.0))
    tail = events(asm.fail(StageDeadlineExceeded("inference")) or b"")
    assert [i for i, _ in first + tail][:-1] == ["0", "1", "2"]
    error = json.loads(tail[0][1])["error"]
    assert (error["code"], error["param"]) == ("stage_deadline_exceeded", "inference")
    assert tail[-1] == (None, "[DONE]")
    assert "finish_reason\": \"stop" not in tail[0][1]  # never a fake clean finish


def test_a_reply_without_a_finish_reason_is_not_finished() -> None:
    asm = ResponseAssembler("chatcmpl-5", "m", 7, stream=True)
    asm.feed(Delta(text="cut"), 0.0)
    with pytest.raises(UpstreamProtocolError):
        asm.finish(1.0)


@pytest.mark.parametrize(
    ("calls", "bad"),
    [
        (["finish"], "feed"),
        (["finish"], "finish"),
        (["fail"], "feed"),
        (["fail"], "fail"),
    ],
)
def test_the_state_table_refuses_what_it_does_not_allow(calls: list[str], bad: str) -> None:
    asm = ResponseAssembler("chatcmpl-6", "m", 7, stream=True)
    asm.feed(Delta(finish_reason="stop"), 0.0)
    err = StageDeadlineExceeded("sse")
    do = {
        "feed": lambda: asm.feed(Delta(text="x"), 1.0),
        "finish": lambda: asm.finish(1.0),
        "fail": lambda: asm.fail(err),
    }
    for call in calls:
        do[call]()
    with pytest.raises(AssemblerStateError):
        do[bad]()


# --- one read carrying the end of the reasoning and the start of the answer (issue 51) ---


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("kind", ["chat", "responses", "messages"])
def test_a_phone_number_split_where_the_reasoning_ends_in_a_read_is_redacted(
    kind: str, stream: bool
) -> None:
    """One upstream read (one delta) carries the last of the reasoning and the
    first of the answer -- as when two chunks share a TCP read. The reasoning's
    filter held back ``138001``; the rest of the number arrives in that read. The
    reasoning must be fed before its filter is finished, or ``138001`` goes out
    as the tail and ``38000`` through a fresh filter: the number whole, in every
    API's shape."""
    (redact,) = build_policies(["gdpr-redact"], make_config())
    ctx = PolicyContext(route="chat", channel="app", tenant="t", request_id="r")

    def side() -> list[OutputFilter]:
        flt = redact.output_filter(ctx)
        assert flt is not None
        return [flt]

    asm = ResponseAssembler(
        "resp_1" if kind == "responses" else "msg_1",
        "m",
        7,
        stream=stream,
        filters=side(),
        side_filters=side,
        codec=CODECS[kind],
        view=ResponsesRequest(input="hi") if kind == "responses" else None,
    )
    out = asm.feed(Delta(reasoning="User phone 138001"), 0.0)
    out += asm.feed(Delta(reasoning="38000, so answer.", text="Done, "), 1.0)
    out += asm.feed(Delta(text="thanks.", finish_reason="stop"), 2.0)
    raw = (out + asm.finish(3.0)).decode()
    assert "138001" not in raw
    assert "38000" not in raw
    assert "[PHONE]" in raw
    assert asm.delivered == "Done, thanks."
    assert asm.state is State.DONE
