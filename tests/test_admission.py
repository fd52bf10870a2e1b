"""Overload and slow clients, in-process on the virtual clock: in-flight and stream caps
(a fast 503 with Retry-After, before the body is read), the body-read idle timeout, the
write deadline for a reader that stops reading, and heartbeats on idle streams."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing

from aiserve_trio.errors import Overloaded
from aiserve_trio.http.sse import shutdown_event
from aiserve_trio.security.admission import Admission

from .asgi_client import Client, chat_body
from .authcfg import OFF, auth_app


def test_admission_counts_and_refuses() -> None:
    adm = Admission(max_inflight=2, max_streams=1)
    with adm.request(), adm.request():
        with pytest.raises(Overloaded) as info, adm.request():
            pass
        assert info.value.headers == {"Retry-After": "1"}
        assert info.value.status == 503
    assert adm.inflight == 0
    with adm.stream(), pytest.raises(Overloaded):
        adm.open_stream()
    assert (adm.streams, adm.shed) == (0, 2)


def app(**limits: str) -> Any:
    return auth_app(OFF, **limits)


async def test_inflight_cap_sheds_fast_without_reading_the_body(autojump_clock: Any) -> None:
    a = app(max_inflight="2", ttft_ms="1000")
    client = Client(a)
    results: list[int] = []

    async def one() -> None:
        results.append((await client.chat(chat_body())).status)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one)
        nursery.start_soon(one)
        await trio.testing.wait_all_tasks_blocked()
        assert a.gate.admission.inflight == 2
        async with client.open("POST", "/v1/chat/completions", body=[b"{", b"never"]) as ex:
            await ex.done.wait()
        shed = ex.response
        assert shed.status == 503
        assert shed.headers["retry-after"] == "1"
        assert json.loads(shed.body)["error"]["code"] == "overloaded"
        assert ex.parts_read == 0  # refused on the head
        assert (await client.request("GET", "/healthz")).status == 200  # probes are not shed
    assert results == [200, 200]
    assert a.gate.admission.inflight == 0


async def test_stream_cap_refuses_before_the_head(autojump_clock: Any) -> None:
    a = app(max_streams="1", ttft_ms="1000")
    client = Client(a)
    async with client.open(
        "POST", "/v1/chat/completions", json_body=chat_body(stream=True)
    ) as first:
        await trio.testing.wait_all_tasks_blocked()
        assert a.gate.admission.streams == 1
        second = await client.chat(chat_body(stream=True))
        assert second.status == 503
        plain = await client.chat(chat_body())  # not streaming: not capped by streams
        assert plain.status == 200
    assert first.response.status == 200
    assert a.gate.admission.streams == 0


async def test_slowloris_body_is_refused_with_408(autojump_clock: Any) -> None:
    a = app(body_read_timeout_ms="500")
    client = Client(a)
    start = trio.current_time()
    r = await client.request(
        "POST",
        "/v1/chat/completions",
        body=[b'{"model"', b": 1}"],
        body_delay=2.0,
        headers={"content-type": "application/json", "x-request-timeout-ms": "60000"},
    )
    assert r.status == 408
    assert r.json()["error"]["code"] == "body_read_timeout"
    assert trio.current_time() - start < 1.0
    assert a.gate.admission.inflight == 0


async def test_slow_but_steady_body_is_fine(autojump_clock: Any) -> None:
    client = Client(app(body_read_timeout_ms="500"))
    raw = json.dumps(chat_body()).encode()
    parts = [raw[i : i + 8] for i in range(0, len(raw), 8)]
    r = await client.request(
        "POST",
        "/v1/chat/completions",
        body=parts,
        body_delay=0.3,
        headers={"content-type": "application/json"},
    )
    assert r.status == 200


async def test_reader_that_stops_reading_is_dropped(autojump_clock: Any) -> None:
    a = app(write_timeout_ms="1000", inter_token_ms="100")
    client = Client(a)
    start = trio.current_time()
    async with client.open(
        "POST",
        "/v1/chat/completions",
        json_body=chat_body(stream=True),
        headers={"x-request-timeout-ms": "100000"},
        stall_after=2,
    ) as ex:
        await ex.done.wait()
    # Dropped a second after it stopped reading, not at the 100 s deadline.
    assert trio.current_time() - start < 3.0
    assert a.gate.admission.streams == 0
    assert ex.response.status == 200


async def test_idle_stream_gets_heartbeats(autojump_clock: Any) -> None:
    client = Client(app(heartbeat_s="1", ttft_ms="10", inter_token_ms="2500"))
    r = await client.chat(chat_body("hi", stream=True), {"x-request-timeout-ms": "120000"})
    body = r.body.decode()
    assert ": ping\n\n" in body
    assert r.events()[-1] == "[DONE]"


async def test_no_heartbeats_when_tokens_flow(autojump_clock: Any) -> None:
    client = Client(app(heartbeat_s="1", inter_token_ms="5"))
    r = await client.chat(chat_body("hi", stream=True))
    assert b": ping" not in r.body


def test_shutdown_event_frames() -> None:
    chat = shutdown_event(session_stream=False).decode()
    first, done = chat.strip().split("\n\n")
    assert json.loads(first.removeprefix("data: "))["error"]["code"] == "shutting_down"
    assert done == "data: [DONE]"
    assert shutdown_event(session_stream=True).startswith(b"event: close")
