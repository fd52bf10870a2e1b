"""The OpenAI stream decoder without a socket: joining, [DONE], errors mid-stream, any split."""

from __future__ import annotations

import contextlib
import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiserve_trio.adapters.base import Delta, Usage
from aiserve_trio.adapters.chat_stream import ChatStreamDecoder
from aiserve_trio.core.errors import UpstreamProtocolError


def event(obj: object, eol: str = "\n") -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}{eol}{eol}".encode()


def text_event(text: str, eol: str = "\n") -> bytes:
    return event({"choices": [{"delta": {"content": text}}]}, eol)


def stream(
    texts: list[str],
    finish: str | None = "stop",
    usage: tuple[int, int] | None = (5, 2),
    *,
    done: bool = True,
    eol: str = "\n",
) -> bytes:
    out = b": ping\n\n" + b"".join(text_event(t, eol) for t in texts)
    if finish is not None:
        out += event({"choices": [{"delta": {}, "finish_reason": finish}]}, eol)
    if usage is not None:
        counts = {"prompt_tokens": usage[0], "completion_tokens": usage[1]}
        out += event({"choices": [], "usage": counts}, eol)
    return out + (f"data: [DONE]{eol}{eol}".encode() if done else b"")


def test_one_read_is_one_delta_and_the_end_carries_finish_and_usage() -> None:
    d = ChatStreamDecoder("up")
    assert d.feed(stream(["Hel", "lo"])) == [Delta(text="Hello", tokens=2)]
    d.check()
    assert d.end() == Delta(finish_reason="stop", usage=Usage(prompt_tokens=5, completion_tokens=2))
    assert d.pieces == 2


def test_a_read_without_text_gives_no_delta() -> None:
    d = ChatStreamDecoder("up")
    assert d.feed(b": ping\n\n") == []
    assert d.feed(b'data: {"choices": [{"delta": {"content": ""}}]}\n\n') == []
    assert d.pieces == 0


def test_nothing_counts_after_done() -> None:
    d = ChatStreamDecoder("up")
    assert d.feed(text_event("a") + b"data: [DONE]\n\n" + text_event("b")) == [Delta(text="a")]
    assert d.feed(text_event("c") + b"data: {not json\n\n" + b"\xff\n") == []
    d.check()
    assert d.end() == Delta(finish_reason="stop")  # no finish reason or usage came: defaults


def test_a_stream_without_done_is_a_protocol_error() -> None:
    d = ChatStreamDecoder("up")
    assert d.feed(stream(["a"], done=False)) == [Delta(text="a")]
    with pytest.raises(UpstreamProtocolError, match=r"up: .*closed the stream without \[DONE\]"):
        d.end()


def test_an_error_mid_stream_comes_after_the_text_before_it() -> None:
    d = ChatStreamDecoder("up")
    raw = text_event("partial") + event({"error": {"message": "overloaded " * 100}})
    raw += text_event("never")
    assert d.feed(raw) == [Delta(text="partial")]
    with pytest.raises(
        UpstreamProtocolError, match="reported an error mid-stream: overloaded"
    ) as info:
        d.check()
    assert len(str(info.value)) < 400  # the backend's message is cut
    # The broken stream stays broken, whatever comes next.
    with pytest.raises(UpstreamProtocolError, match="mid-stream"):
        d.feed(b"data: [DONE]\n\n")
    with pytest.raises(UpstreamProtocolError, match="mid-stream"):
        d.end()


@pytest.mark.parametrize(
    "bad",
    [
        b"data: {not json\n\n",
        b'data: {"choices": "x"}\n\n',
        b'data: {"choices": [{"finish_reason": 3}]}\n\n',
    ],
)
def test_a_malformed_event_is_a_protocol_error_with_its_cause(bad: bytes) -> None:
    d = ChatStreamDecoder("up")
    assert d.feed(text_event("ok") + bad) == [Delta(text="ok")]
    with pytest.raises(
        UpstreamProtocolError, match="up: the model backend sent a malformed event"
    ) as info:
        d.check()
    assert info.value.__cause__ is not None


def test_a_line_that_is_not_utf8_is_a_protocol_error() -> None:
    d = ChatStreamDecoder("up")
    assert d.feed(text_event("ok")) == [Delta(text="ok")]
    # (The SSE parser refuses the whole read, so text in the same read is lost.)
    assert d.feed(text_event("lost") + b"data: \xff\xfe\n\n") == []
    with pytest.raises(UpstreamProtocolError, match="malformed event"):
        d.check()


def test_without_usage_the_end_leaves_counting_to_the_caller() -> None:
    d = ChatStreamDecoder("up")
    d.feed(stream(["a", "b", "c"], finish="length", usage=None))
    assert d.end() == Delta(finish_reason="length", usage=None)
    assert d.pieces == 3


# --- properties ---------------------------------------------------------------------

texts = st.lists(st.text(st.characters(blacklist_categories=["Cs"]), max_size=8), max_size=8)
cuts = st.lists(st.integers(min_value=0, max_value=10_000), max_size=16)


def feed_split(raw: bytes, points: list[int]) -> tuple[str, Delta, int]:
    d = ChatStreamDecoder("up")
    bounds = [0, *sorted(p % (len(raw) + 1) for p in points), len(raw)]
    out = ""
    for a, b in itertools.pairwise(bounds):
        deltas = d.feed(raw[a:b])
        assert len(deltas) <= 1  # one read, at most one delta
        out += "".join(x.text for x in deltas)
        d.check()
    return out, d.end(), d.pieces


@given(
    texts,
    st.sampled_from(["stop", "length", None]),
    st.none() | st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)),
    st.sampled_from(["\n", "\r\n", "\r"]),
    cuts,
)
def test_any_split_gives_the_same_text_finish_and_usage(
    parts: list[str],
    finish: str | None,
    usage: tuple[int, int] | None,
    eol: str,
    points: list[int],
) -> None:
    raw = stream(parts, finish, usage, eol=eol)
    whole = feed_split(raw, [])
    assert feed_split(raw, points) == whole
    text, final, pieces = whole
    assert text == "".join(parts)
    assert pieces == sum(1 for p in parts if p)
    assert final.finish_reason == (finish or "stop")
    assert final.usage == (
        None if usage is None else Usage(prompt_tokens=usage[0], completion_tokens=usage[1])
    )


def feed_all(raw: bytes, points: list[int]) -> None:
    d = ChatStreamDecoder("up")
    bounds = [0, *sorted(p % (len(raw) + 1) for p in points), len(raw)]
    for a, b in itertools.pairwise(bounds):
        d.feed(raw[a:b])
        d.check()
    d.end()


@given(st.binary(max_size=300), cuts)
def test_arbitrary_bytes_raise_only_protocol_errors(raw: bytes, points: list[int]) -> None:
    with contextlib.suppress(UpstreamProtocolError):  # any other exception fails the test
        feed_all(raw, points)


@given(texts, st.integers(min_value=0), st.binary(min_size=1, max_size=4), cuts)
def test_a_corrupted_stream_raises_only_protocol_errors(
    parts: list[str], at: int, junk: bytes, points: list[int]
) -> None:
    raw = stream(parts)
    i = at % len(raw)
    corrupted = raw[:i] + junk + raw[i + len(junk) :]
    with contextlib.suppress(UpstreamProtocolError):
        feed_all(corrupted, points)


# --- a read of whole plain events: decoded in one call, with the same result ----------


def plain(texts: list[str]) -> bytes:
    """What a backend sends in one read: whole events of one ``data:`` line each."""
    return stream(texts)[len(b": ping\n\n") :]


def slow_feed(raw: bytes) -> tuple[list[Delta], ChatStreamDecoder]:
    """Feed ``raw`` the event-by-event way (a comment first turns the batch path off)."""
    d = ChatStreamDecoder("up")
    return d.feed(b": ping\n\n" + raw), d


def test_a_read_of_plain_events_is_decoded_without_the_event_by_event_parser(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d = ChatStreamDecoder("up")

    def no(*_: object) -> None:
        raise AssertionError("went event by event")

    monkeypatch.setattr(type(d._parser), "feed", no)
    assert d.feed(plain(["Hel", "lo"])) == [Delta(text="Hello", tokens=2)]
    assert d.done
    assert d.end() == Delta(finish_reason="stop", usage=Usage(prompt_tokens=5, completion_tokens=2))


@pytest.mark.parametrize(
    "bad",
    [
        b"data: {not json\n\n",
        b"data: \n\n",  # no object at all
        b'data: {"choices": []}, {"choices": []}\n\n',  # two objects in one event
        b'data: {"error": {"message": "overloaded"}}\n\n',
        b'data: {"choices": "x"}\n\n',
        b"data: [DONE]\n\n" + text_event("after"),
    ],
)
def test_a_read_of_plain_events_ends_as_the_event_by_event_way_does(bad: bytes) -> None:
    raw = text_event("ok") + bad + text_event("more")
    fast = ChatStreamDecoder("up")
    got = fast.feed(raw)
    want, slow = slow_feed(raw)
    assert got == want
    assert fast.done == slow.done
    for d in (fast, slow):
        with contextlib.suppress(UpstreamProtocolError):
            d.check()
    assert type(fast._error) is type(slow._error)
    assert str(fast._error) == str(slow._error)


@given(st.lists(st.text(max_size=8), max_size=12), st.booleans())
def test_plain_reads_and_the_event_by_event_way_agree(texts: list[str], done: bool) -> None:
    raw = plain(texts) if done else stream(texts, done=False)[len(b": ping\n\n") :]
    fast = ChatStreamDecoder("up")
    want, slow = slow_feed(raw)
    assert fast.feed(raw) == want
    assert (fast.done, fast.finish_reason, fast.usage, fast.pieces) == (
        slow.done,
        slow.finish_reason,
        slow.usage,
        slow.pieces,
    )
