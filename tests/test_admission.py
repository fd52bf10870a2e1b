"""Overload and slow clients, in-process on the virtual clock: in-flight and stream caps
(a fast 503 with Retry-After, before the body is read), the body-read idle timeout, the
write deadline for a reader that stops reading, and heartbeats on idle streams."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing

from aiserve_trio.core.errors import Overloaded
from aiserve_trio.http.sse import shutdown_event
from aiserve_trio.security.admission import Admission, BodyPace

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


# --- slow uploads ---------------------------------------------------------------------


def test_body_pace_bounds_pause_total_and_rate() -> None:
    pace = BodyPace(100.0, idle=5.0, total=30.0, min_rate=16)
    # At the start: the grace second of the rate floor is the nearest bound.
    assert pace.deadline(100.0) == (101.0, "the request body arrived slower than 16 B/s")
    pace.add(160)  # 160 B buy 10 s at 16 B/s; the pause bound is nearer then
    assert pace.deadline(102.0) == (107.0, "the request body stopped arriving")
    pace.add(10_000)
    assert pace.deadline(128.0) == (130.0, "the request body took longer than 30 s")
    assert BodyPace(0.0, idle=5.0, total=30.0, min_rate=0).deadline(0.0)[0] == 5.0


async def test_a_dribbled_body_is_refused_within_about_a_second(autojump_clock: Any) -> None:
    client = Client(app())
    raw = json.dumps(chat_body()).encode()
    t0 = trio.current_time()
    r = await client.request(
        "POST",
        "/v1/chat/completions",
        body=[raw[i : i + 1] for i in range(len(raw))],
        body_delay=1.0,  # a byte a second: under every pause limit, never done
        headers={"content-type": "application/json"},
    )
    assert (r.status, r.json()["error"]["code"]) == (408, "body_read_timeout")
    assert "slower than 16 B/s" in r.json()["error"]["message"]
    assert trio.current_time() - t0 < 2.5


async def test_slow_uploads_cannot_take_every_slot(autojump_clock: Any) -> None:
    # 8 slots in flight, at most 2 of them for bodies still arriving.
    a = app(max_inflight="8", max_receiving="2", body_min_rate="0", body_read_timeout_ms="60000",
            body_total_timeout_ms="60000")
    client = Client(a)
    raw = json.dumps(chat_body()).encode()
    statuses: list[int] = []

    async def slow() -> None:
        r = await client.request(
            "POST",
            "/v1/chat/completions",
            body=[raw[:5], raw[5:]],
            body_delay=5.0,
            headers={"content-type": "application/json"},
        )
        statuses.append(r.status)

    async with trio.open_nursery() as nursery:
        for _ in range(6):
            nursery.start_soon(slow)
        await trio.testing.wait_all_tasks_blocked()
        assert a.gate.admission.receiving == 2
        # Four uploads were refused at once; two hold their share...
        assert sorted(statuses) == [503] * 4
        # ...and a client whose body comes at once is served meanwhile.
        ok = await client.chat(chat_body("echo: still served"))
        assert ok.status == 200
    assert sorted(statuses) == [200, 200, 503, 503, 503, 503]
    assert a.gate.admission.receiving == 0


async def test_a_body_in_with_its_length_takes_no_upload_slot(autojump_clock: Any) -> None:
    # hypercorn hands a body that came at once over as the whole body with more_body set,
    # then an empty last message: such a request is served while uploads hold every slot.
    a = app(max_receiving="1", body_min_rate="0", body_read_timeout_ms="60000",
            body_total_timeout_ms="60000")
    client = Client(a)
    raw = json.dumps(chat_body("echo: in at once")).encode()
    statuses: list[int] = []

    async def slow() -> None:
        r = await client.request(
            "POST", "/v1/chat/completions", body=[raw[:5], raw[5:]], body_delay=5.0,
            headers={"content-type": "application/json"},
        )
        statuses.append(r.status)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(slow)
        await trio.testing.wait_all_tasks_blocked()
        assert a.gate.admission.receiving == 1
        whole = await client.request(
            "POST", "/v1/chat/completions", body=[raw, b""],
            headers={"content-type": "application/json", "content-length": str(len(raw))},
        )
        assert whole.status == 200
        # Without a declared length the gateway cannot know the body is in: it needs a slot.
        unsized = await client.request(
            "POST", "/v1/chat/completions", body=[raw, b""],
            headers={"content-type": "application/json"},
        )
        assert unsized.status == 503
    assert statuses == [200]


async def test_one_client_address_holds_at_most_its_share(autojump_clock: Any) -> None:
    a = app(max_per_client="2", ttft_ms="1000")
    client = Client(a)
    async with client.open("POST", "/v1/chat/completions", json_body=chat_body()) as one, \
            client.open("POST", "/v1/chat/completions", json_body=chat_body()) as two:
        await trio.testing.wait_all_tasks_blocked()
        third = await client.chat(chat_body())
        assert (third.status, third.json()["error"]["code"]) == (429, "too_many_connections")
        # Probes are not counted; other addresses are not affected.
        assert (await client.request("GET", "/healthz")).status == 200
    assert one.response.status == two.response.status == 200
    assert a.gate.admission.by_client == {}


async def test_behind_a_trusted_proxy_the_header_names_the_client(autojump_clock: Any) -> None:
    a = app(max_per_client="1", ttft_ms="1000", client_address_header='"x-forwarded-for"')
    client = Client(a)
    fwd = {"x-forwarded-for": "203.0.113.7, 10.0.0.1"}
    async with client.open(
        "POST", "/v1/chat/completions", json_body=chat_body(), headers=fwd
    ) as first:
        await trio.testing.wait_all_tasks_blocked()
        assert a.gate.admission.by_client == {"10.0.0.1": 1}
        same = await client.chat(chat_body(), headers=fwd)
        assert same.status == 429
        other = await client.chat(chat_body(), headers={"x-forwarded-for": "10.0.0.2"})
        assert other.status == 200  # same socket address, another client behind the proxy
    assert first.response.status == 200


# --- receive() as hypercorn's Trio worker hands it: its queue's receive ---------------


async def queued_exchange(
    a: Any, parts: list[bytes], *, more: bool, wait_s: float
) -> tuple[int, dict[str, Any], float]:
    """Drive ``a`` as hypercorn does: the body parts queued on a memory channel before the
    app runs (``more``: the body is not all there), ``receive`` the channel's own."""
    from .asgi_client import make_scope

    body = b"".join(parts)
    headers = {"content-type": "application/json", "x-request-timeout-ms": "60000"}
    if not more:
        headers["content-length"] = str(len(body))
    scope = make_scope("POST", "/v1/chat/completions", headers)
    queue_in, queue_out = trio.open_memory_channel[dict[str, Any]](10)
    for part in parts:
        queue_in.send_nowait({"type": "http.request", "body": part, "more_body": True})
    if not more:
        queue_in.send_nowait({"type": "http.request", "body": b"", "more_body": False})
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            queue_in.send_nowait({"type": "http.disconnect"})  # as hypercorn does

    start = trio.current_time()
    with trio.fail_after(wait_s):
        await a(scope, queue_out.receive, send)
    status = sent[0]["status"]
    payload = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    return status, payload, trio.current_time() - start


async def test_a_body_queued_whole_on_the_servers_channel_is_served(autojump_clock: Any) -> None:
    a = app(body_read_timeout_ms="500")
    raw = json.dumps(chat_body()).encode()
    status, payload, _ = await queued_exchange(a, [raw[:7], raw[7:]], more=False, wait_s=5)
    assert status == 200
    assert payload["choices"][0]["message"]["content"]
    assert a.gate.admission.inflight == 0


async def test_a_body_that_stops_on_the_servers_channel_is_still_refused_with_408(
    autojump_clock: Any,
) -> None:
    a = app(body_read_timeout_ms="500")
    status, payload, took = await queued_exchange(a, [b'{"model"'], more=True, wait_s=5)
    assert (status, payload["error"]["code"]) == (408, "body_read_timeout")
    assert took < 1.0
    assert a.gate.admission.inflight == 0
