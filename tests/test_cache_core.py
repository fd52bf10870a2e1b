"""The cache's pure cores, without sockets: the LRU by bytes, the entry, the flight log
and table, and the assembler's record of what it released (replayed, it gives the same reply)."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable

import msgspec
import pytest
import trio
import trio.testing

from aiserve_trio.adapters.base import Delta, ToolCallDelta, Usage
from aiserve_trio.cache.entry import (
    Entry,
    Replayed,
    decode,
    decode_pieces,
    encode,
    encode_pieces,
    new_entry,
    why_not_stored,
)
from aiserve_trio.cache.flight import Flight, FlightLog, FlightState, FlightStateError, FlightTable
from aiserve_trio.cache.lru import ByteLRU
from aiserve_trio.core.errors import UpstreamTimeout
from aiserve_trio.policies.base import OutputFilter
from aiserve_trio.stages.assembler import ResponseAssembler

# --- the LRU by bytes -------------------------------------------------------------------


def test_lru_evicts_least_recently_used_by_bytes() -> None:
    lru: ByteLRU[str] = ByteLRU(100)
    assert lru.put("a", "A", 40, expires=10)
    assert lru.put("b", "B", 40, expires=10)
    assert lru.get("a", now=0) == "A"  # a is now the most recently used
    assert lru.put("c", "C", 40, expires=10)  # 120 > 100: b goes, not a
    assert lru.get("b", now=0) is None
    assert (lru.get("a", now=0), lru.get("c", now=0)) == ("A", "C")
    assert (lru.bytes, len(lru)) == (80, 2)


def test_lru_refuses_what_alone_is_over_the_bound_and_replaces_in_place() -> None:
    lru: ByteLRU[str] = ByteLRU(100)
    assert lru.put("a", "A", 60, expires=10)
    assert not lru.put("big", "X", 101, expires=10)
    assert lru.get("big", now=0) is None
    assert lru.put("a", "A2", 30, expires=10)
    assert (lru.get("a", now=0), lru.bytes, len(lru)) == ("A2", 30, 1)


def test_lru_entries_expire() -> None:
    lru: ByteLRU[str] = ByteLRU(100)
    lru.put("a", "A", 10, expires=5.0)
    assert lru.get("a", now=4.999) == "A"
    assert lru.get("a", now=5.0) is None
    assert (lru.bytes, len(lru)) == (0, 0)


# --- the entry --------------------------------------------------------------------------


def _reply(*pieces: Replayed) -> list[Replayed]:
    return list(pieces)


def test_entry_round_trips_and_refuses_another_version() -> None:
    entry = new_entry(
        [
            Replayed(text="a", logprobs=msgspec.Raw(b'{"content":[]}')),
            Replayed(tool_calls=[ToolCallDelta(index=0, id="c", name="f", arguments="{}")]),
            Replayed(
                finish_reason="stop",
                usage=Usage(
                    prompt_tokens=1,
                    completion_tokens=2,
                    prompt_details=msgspec.Raw(b'{"cached_tokens":0}'),
                    completion_details=msgspec.Raw(b'{"reasoning_tokens":1}'),
                ),
            ),
        ],
        "chat",
    )
    back = decode(encode(entry))
    assert back == entry
    assert decode_pieces(encode_pieces(entry.pieces)) == entry.pieces
    assert decode(encode(msgspec.structs.replace(entry, version=0))) is None
    assert decode(b"not json") is None
    assert isinstance(back, Entry)
    assert all(isinstance(p, Replayed) for p in back.pieces)


@pytest.mark.parametrize(
    ("pieces", "why"),
    [
        (_reply(Replayed(text="a"), Replayed(finish_reason="stop")), None),
        (_reply(Replayed(text="a"), Replayed(finish_reason="length")), None),
        (_reply(Replayed(text="a")), "unfinished"),
        (_reply(), "unfinished"),
        (_reply(Replayed(text="a"), Replayed(finish_reason="content_filter")), "refused"),
        (_reply(Replayed(refusal="no"), Replayed(finish_reason="stop")), "refused"),
    ],
)
def test_only_a_cleanly_finished_reply_may_be_stored(
    pieces: list[Replayed], why: str | None
) -> None:
    assert why_not_stored(pieces) == why


# --- the flight log and table -----------------------------------------------------------


def test_flight_log_is_append_only_then_done() -> None:
    log = FlightLog()
    log.publish([Replayed(text="a")], "model")
    log.publish([Replayed(text="b")], "store")  # the first source stays
    assert log.source == "model"
    assert [p.text for p in log.since(1)] == ["b"]
    with pytest.raises(FlightStateError):
        log.finish()  # no final piece yet
    log.publish([Replayed(finish_reason="stop")], "model")
    log.finish()
    assert log.state is FlightState.DONE
    with pytest.raises(FlightStateError):
        log.publish([Replayed(text="c")], "model")
    assert not log.fail(UpstreamTimeout("late"))  # ended: the first end stays


def test_flight_log_failure_keeps_the_error() -> None:
    log = FlightLog()
    err = UpstreamTimeout("slow")
    assert log.fail(err)
    assert (log.state, log.error, log.ended) == (FlightState.FAILED, err, True)


def test_flight_table_joins_leaves_and_forgets() -> None:
    table = FlightTable()
    f = table.start("k")
    table.join(f)
    table.join(f)
    assert table.find("k") is f
    assert not table.leave(f)  # one member left
    assert table.leave(f)  # the last left an unfinished flight: end it
    assert table.find("k") is None


def test_a_finished_flight_is_not_ended_by_its_last_member() -> None:
    table = FlightTable()
    f = table.start("k")
    table.join(f)
    f.log.publish([Replayed(finish_reason="stop")], "model")
    f.log.finish()
    assert not table.leave(f)
    assert table.find("k") is f  # kept until it is stored


def test_a_fresh_flight_replaces_the_old_one_for_new_joiners_only() -> None:
    table = FlightTable()
    old = table.start("k")
    new = table.start("k", fresh=True)
    assert table.find("k") is new
    table.remove(old)  # the old one ending must not forget the new one
    assert table.find("k") is new


async def test_members_wait_for_more_of_the_log(autojump_clock: trio.testing.MockClock) -> None:
    table = FlightTable()
    f = table.start("k")
    got: list[str] = []

    async def member() -> None:
        cursor = 0
        while True:
            await f.wait(cursor)
            new = f.log.since(cursor)
            got.extend(p.text for p in new)
            cursor += len(new)
            if f.log.ended and cursor == len(f.log.pieces):
                return

    with trio.fail_after(5):  # a member never woken would wait forever
        await _publish_words(f, member)
    assert got == ["a", "b", ""]


async def _publish_words(f: Flight, member: Callable[[], Awaitable[None]]) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(member)
        for word in ("a", "b"):
            await trio.sleep(0.01)
            f.log.publish([Replayed(text=word)], "model")
            f.changed()
        f.log.publish([Replayed(finish_reason="stop")], "model")
        f.log.finish()
        f.changed()


# --- what the assembler records, replayed -----------------------------------------------


class Upper:
    """An output filter that holds back up to two characters and upper-cases."""

    max_holdback = 2

    def __init__(self) -> None:
        self.held = ""

    def feed(self, text: str) -> str:
        text = self.held + text
        self.held = text[-2:]
        return text[:-2].upper()

    def finish(self) -> str:
        out, self.held = self.held.upper(), ""
        return out


def _filters() -> list[OutputFilter]:
    return [Upper()]


def _frame(asm: ResponseAssembler, deltas: list[Delta]) -> bytes:
    out = b"".join(asm.feed(d, 0.0) for d in deltas)
    return out + asm.finish(0.0)


def _random_reply(rng: random.Random) -> list[Delta]:
    words = ["al", "pha ", "be", "ta ", "{", '"k"', ": ", '"v"', "}"]
    deltas: list[Delta] = []
    if rng.random() < 0.5:
        deltas += [Delta(reasoning=rng.choice(words)) for _ in range(rng.randint(1, 4))]
    for _ in range(rng.randint(0, 6)):
        kind = rng.random()
        if kind < 0.5:
            deltas.append(Delta(text=rng.choice(words)))
        elif kind < 0.6:
            deltas.append(Delta(refusal=rng.choice(words)))
        elif kind < 0.7:
            deltas.append(Delta(logprobs=msgspec.Raw(b'{"content":[{"token":"x","logprob":-1}]}')))
        else:
            i = rng.randint(0, 1)
            first = rng.random() < 0.5
            deltas.append(
                Delta(
                    tool_calls=[
                        ToolCallDelta(
                            index=i,
                            id=f"call{i}" if first else None,
                            type="function" if first else None,
                            name="lookup" if first else None,
                            arguments=rng.choice(['{"q": "a', 'b"', "}", ""]),
                        )
                    ]
                )
            )
    usage = Usage(prompt_tokens=3, completion_tokens=len(deltas))
    deltas.append(Delta(finish_reason=rng.choice(["stop", "tool_calls"]), usage=usage))
    return deltas


def _scrub(body: bytes) -> bytes:
    """The replay with the original's id (the one thing that differs per request)."""
    return body.replace(b"req-b", b"req-a")


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("seed", range(40))
def test_the_recorded_pieces_replay_as_the_same_reply(stream: bool, seed: int) -> None:
    deltas = _random_reply(random.Random(seed))
    if seed % 2:  # a fallback answered: the reply names its model, and so does the replay
        deltas[0] = msgspec.structs.replace(deltas[0], model="m-served")
    live = ResponseAssembler(
        "req-a",
        "m",
        1,
        stream=stream,
        include_usage=True,
        filters=_filters(),
        side_filters=_filters,
        record=True,
    )
    recorded: list[Replayed] = []
    out = b""
    for d in deltas:
        out += live.feed(d, 0.0)
        recorded += live.take_recorded()
    out += live.finish(0.0)
    recorded += live.take_recorded()
    assert recorded[-1].finish_reason == deltas[-1].finish_reason
    assert recorded[-1].usage == deltas[-1].usage
    recorded = decode_pieces(encode_pieces(recorded))  # as a shared flight's log carries them
    # Replayed through an assembler without filters: byte for byte the same reply,
    # whichever way the client asked for it.
    for replay_stream in (stream, not stream):
        again = ResponseAssembler("req-b", "m", 1, stream=replay_stream, include_usage=True)
        replay = _frame(again, list(recorded))
        reference = ResponseAssembler(
            "req-a",
            "m",
            1,
            stream=replay_stream,
            include_usage=True,
            filters=_filters(),
            side_filters=_filters,
        )
        assert _scrub(replay) == _frame(reference, deltas)
        assert again.model == live.model == ("m-served" if seed % 2 else "m")
        assert again.delivered == live.delivered
        assert again.tool_calls == live.tool_calls


def test_nothing_is_recorded_without_record() -> None:
    asm = ResponseAssembler("r", "m", 1, stream=True)
    asm.feed(Delta(text="a", finish_reason="stop"), 0.0)
    asm.finish(0.0)
    assert asm.take_recorded() == []


def test_a_capped_reply_records_its_length_finish() -> None:
    asm = ResponseAssembler("r", "m", 1, stream=False, max_tokens=1, record=True)
    asm.feed(Delta(text="a"), 0.0)
    asm.feed(Delta(text="b"), 0.0)  # past the cap: not released
    asm.finish(0.0)
    pieces = asm.take_recorded()
    assert [p.text for p in pieces] == ["a", ""]
    assert pieces[-1].finish_reason == "length"
    assert asm.capped == "max_tokens"
