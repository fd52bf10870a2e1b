"""/debug/profile and /debug/trace in-process (who may call, bounds, one at a time), and the
per-request write and read counts on the span and in /debug/requests/recent."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx2
import pytest
import trio
import trio.testing

from aiserve_trio.adapters.openai import OpenAIAdapter
from aiserve_trio.config import OpenAIAdapterConfig
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client, Exchange, Response, chat_body, make_scope
from .authcfg import KEY_A, KEY_ADMIN, auth_app, bearer
from .conftest import make_config
from .test_observability import attrs, traced_app
from .test_runtrace import blocking_app
from .trace_events import check_trace_events

LOCAL = ("127.0.0.1", 40000)


@asynccontextmanager
async def opened(
    app: App, path: str, query: str = "", *, headers: dict[str, str] | None = None,
    client: tuple[str, int] | None = LOCAL,
) -> AsyncIterator[Exchange]:
    """A GET in flight; the client stays connected until the response is complete."""
    scope = make_scope("GET", path, headers)
    scope["query_string"] = query.encode()
    scope["client"] = client
    ex = Exchange(app, scope, [b""])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ex.run)
        yield ex
        await ex.done.wait()
        ex.disconnect()


async def get(app: App, path: str, query: str = "", **kw: Any) -> Response:
    async with opened(app, path, query, **kw) as ex:
        await ex.done.wait()
    return ex.response


def error(r: Response) -> dict[str, Any]:
    body: dict[str, Any] = r.json()["error"]
    return body


@pytest.fixture
def app() -> App:
    return App(make_config())


# --- bounds ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "query", "param"),
    [
        ("/debug/profile", "", "seconds"),
        ("/debug/profile", "seconds=0", "seconds"),
        ("/debug/profile", "seconds=61", "seconds"),
        ("/debug/profile", "seconds=nan", "seconds"),
        ("/debug/profile", "seconds=-1", "seconds"),
        ("/debug/profile", "seconds=ten", "seconds"),
        ("/debug/profile", "seconds=1&format=pdf", "format"),
        ("/debug/trace", "seconds=60.5", "seconds"),
        ("/debug/trace", "seconds=1&max_events=10", "max_events"),
        ("/debug/trace", "seconds=1&max_events=1e6", "max_events"),
    ],
)
async def test_out_of_bounds_asks_get_400(app: App, path: str, query: str, param: str) -> None:
    r = await get(app, path, query)
    assert r.status == 400
    assert error(r)["param"] == param
    assert error(r)["type"] == "invalid_request_error"


# --- one at a time -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "code"), [("/debug/profile", "profile_in_progress"), ("/debug/trace", "trace_in_progress")]
)
async def test_a_second_concurrent_one_gets_409(
    autojump_clock: trio.testing.MockClock, app: App, path: str, code: str
) -> None:
    async with opened(app, path, "seconds=5") as first:
        await trio.testing.wait_all_tasks_blocked()
        second = await get(app, path, "seconds=1")
        assert second.status == 409
        assert error(second) == {
            "message": error(second)["message"],
            "type": "invalid_request_error",
            "param": None,
            "code": code,
        }
        assert not first.done.is_set()
    assert first.response.status == 200
    json.loads(first.response.body)
    # the worker is free again
    assert (await get(app, path, "seconds=0.1")).status == 200


async def test_a_profile_and_a_trace_may_run_together(
    autojump_clock: trio.testing.MockClock, app: App
) -> None:
    async with opened(app, "/debug/profile", "seconds=2") as prof:
        await trio.testing.wait_all_tasks_blocked()
        assert (await get(app, "/debug/trace", "seconds=1")).status == 200
    assert prof.response.status == 200


async def test_a_client_that_leaves_ends_the_trace_and_frees_the_worker(
    autojump_clock: trio.testing.MockClock, app: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    add, remove = trio.lowlevel.add_instrument, trio.lowlevel.remove_instrument

    def adding(instrument: trio.abc.Instrument) -> None:
        calls.append("add")
        add(instrument)

    def removing(instrument: trio.abc.Instrument) -> None:
        calls.append("remove")
        remove(instrument)

    monkeypatch.setattr(trio.lowlevel, "add_instrument", adding)
    monkeypatch.setattr(trio.lowlevel, "remove_instrument", removing)
    async with opened(app, "/debug/trace", "seconds=30") as ex:
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        ex.disconnect()
        await ex.done.wait()
        assert trio.current_time() - start < 1
    assert ex.response.status == 0  # nothing was sent
    assert calls == ["add", "remove"]
    assert (await get(app, "/debug/trace", "seconds=0.1")).status == 200


# --- who may call ----------------------------------------------------------------


@pytest.mark.parametrize("path", ["/debug/profile", "/debug/trace"])
async def test_with_auth_on_only_an_admin_key(autojump_clock: trio.testing.MockClock, path: str) -> None:
    app = auth_app()
    r = await get(app, path, "seconds=0.1")
    assert r.status == 401
    r = await get(app, path, "seconds=0.1", headers=bearer(KEY_A))
    assert r.status == 403
    assert error(r)["type"] == "permission_error"
    # with a key, the address does not matter
    r = await get(app, path, "seconds=0.1", headers=bearer(KEY_ADMIN), client=("203.0.113.9", 5555))
    assert r.status == 200


@pytest.mark.parametrize("path", ["/debug/profile", "/debug/trace"])
@pytest.mark.parametrize(
    ("client", "status"),
    [(("127.0.0.1", 1), 200), (("::1", 1), 200), (("127.8.9.10", 1), 200),
     (("10.0.0.5", 1), 403), (("203.0.113.9", 1), 403), (("::ffff:10.0.0.5", 1), 403),
     (("localhost", 1), 403), (None, 403)],
)
async def test_with_auth_off_only_loopback_clients(
    autojump_clock: trio.testing.MockClock,
    app: App,
    path: str,
    client: tuple[str, int] | None,
    status: int,
) -> None:
    r = await get(app, path, "seconds=0.1", client=client)
    assert r.status == status
    if status == 403:
        assert error(r)["code"] == "loopback_only"


# --- the trace through the endpoint ---------------------------------------------------


async def test_the_trace_endpoint_shows_a_blocking_stage_with_its_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = blocking_app()
    async with opened(app, "/debug/trace", "seconds=1") as trace:
        await trio.testing.wait_all_tasks_blocked()
        chat = await Client(app).chat(chat_body("echo: a b", stream=True))
    request_id = chat.headers["x-request-id"]
    r = trace.response
    assert r.status == 200
    assert r.headers["content-type"] == "application/json"
    assert r.headers["content-disposition"].startswith("attachment; filename=\"aiserve-trace-")
    doc = r.json()
    assert check_trace_events(doc) == []
    steps = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "step"]
    stages = {e["args"].get("stage") for e in steps if e["args"].get("request_id") == request_id}
    # None: the request's own task and its watcher, between the stages
    assert stages == {None, "parse", "context", "inference", "sse"}
    (long,) = [e for e in steps if e["dur"] >= 50_000]
    assert (long["name"], long["args"]["request_id"]) == ("inference", request_id)
    # the trace request's own task is labelled with its endpoint
    assert any(e["args"].get("route") == "debug_trace" for e in steps)
    assert doc["otherData"]["events_dropped"] == 0


# --- writes and reads per request -------------------------------------------------------


def sse_chunks(texts: list[str]) -> list[bytes]:
    out = [b"data: " + json.dumps({"choices": [{"delta": {"content": t}}]}).encode() + b"\n\n"
           for t in texts]
    out.append(b'data: {"choices": [{"delta": {}, "finish_reason": "stop"}]}\n\n')
    out.append(b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\n')
    out.append(b"data: [DONE]\n\n")
    return out


class Chunked(httpx2.AsyncByteStream):
    """A response body that arrives in separate reads."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk


def upstream_app(chunks: list[bytes], extra: str = "") -> App:
    def handler(req: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, stream=Chunked(chunks), headers={"content-type": "text/event-stream"})

    cfg = OpenAIAdapterConfig(base_url="http://upstream.test/v1", models=["aiserve-mock"])
    adapter = OpenAIAdapter("mock", cfg, transport=httpx2.MockTransport(handler))
    return App(make_config(extra), adapters={"mock": adapter})


@asynccontextmanager
async def started(app: App) -> AsyncIterator[Client]:
    async with trio.open_nursery() as nursery:
        await app.startup(nursery)
        try:
            yield Client(app)
        finally:
            await app.shutdown()
            nursery.cancel_scope.cancel()


async def test_recent_requests_count_writes_and_upstream_reads(
    autojump_clock: trio.testing.MockClock,
) -> None:
    chunks = sse_chunks(["Hello", " world"])
    app = upstream_app(chunks, "[observability]\ndebug_requests = true\n")
    async with started(app) as client:
        r = await client.chat(chat_body("hi", stream=True))
        assert r.text() == "Hello world"
        recent = (await client.request("GET", "/debug/requests/recent")).json()["requests"]
    (entry,) = recent
    assert entry["upstream_reads"] == len(chunks)
    assert entry["upstream_bytes"] == sum(map(len, chunks))
    assert entry["client_bytes"] == len(r.body)
    # the head plus at least one body write, at most one per body chunk received
    assert 2 <= entry["client_writes"] <= 1 + len(r.chunks)


async def test_the_span_carries_the_counts(autojump_clock: trio.testing.MockClock) -> None:
    app, exporter, _ = traced_app()
    r = await Client(app).chat(chat_body("echo: a b c", stream=True))
    root = next(s for s in exporter.get_finished_spans() if s.name == "POST chat")
    a = attrs(root)
    assert a["aiserve.client_bytes"] == len(r.body)
    assert isinstance(a["aiserve.client_writes"], int)
    assert a["aiserve.client_writes"] >= 2
    # the mock adapter reads nothing from a network
    assert (a["aiserve.upstream_reads"], a["aiserve.upstream_bytes"]) == (0, 0)


def test_counts_default_to_zero_for_refused_requests() -> None:
    from aiserve_trio.stages.outcome import Outcome

    o = Outcome(request_id="r", route="chat", channel="none", arrival=0, ended=1, status="bad_request")
    assert (o.client_writes, o.client_bytes, o.upstream_reads, o.upstream_bytes) == (0, 0, 0, 0)
