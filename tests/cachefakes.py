"""A counting model backend and apps with a response cache, for the cache's tests."""

from __future__ import annotations

import json
import re
from typing import Any

import trio

from aiserve_trio.adapters.base import Adapter, Delta, DeltaSink, InferenceRequest, Usage
from aiserve_trio.adapters.retry import Progress
from aiserve_trio.cache.backend import CacheBackend
from aiserve_trio.cache.entry import Entry
from aiserve_trio.config import parse_config
from aiserve_trio.core.errors import UpstreamError, UpstreamTimeout
from aiserve_trio.runtime.asgi import App

from .asgi_client import Response
from .conftest import config_text


class CountingModel(Adapter):
    """Answers ``answer N: <last message>`` word by word, N counting its calls.

    A second call for the same question gives a different answer, so a reply
    that was not served from the cache (or shared) shows in its text. It carries
    every field (the default capabilities), so any field can be tried.
    """

    def __init__(
        self,
        *,
        ttft: float | list[float] = 0.05,
        gap: float = 0.01,
        words: int = 4,
        fail: list[UpstreamError] | None = None,
    ) -> None:
        super().__init__("mock", ["aiserve-mock"])
        self.ttft = ttft
        self.gap = gap
        self.words = words
        #: Errors the next calls raise, in order, before their first token.
        self.fail = list(fail or [])
        self.calls = 0
        self.cancelled = 0
        self.finished = 0
        self.requests: list[InferenceRequest] = []

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        self.calls += 1
        n = self.calls
        self.requests.append(request)
        try:
            # A backend is told how long it has (X-Request-Timeout-Ms) and keeps to it.
            with trio.move_on_at(request.deadline):
                await self._answer(n, request, send)
                self.finished += 1
                return
        except trio.Cancelled:
            self.cancelled += 1
            raise
        raise UpstreamTimeout("the model ran out of the time it was given")

    async def _answer(self, n: int, request: InferenceRequest, send: DeltaSink) -> None:
        # A list: one time to first token per call, the last for the calls after.
        ttft = self.ttft if isinstance(self.ttft, float) else self.ttft[min(n, len(self.ttft)) - 1]
        await trio.sleep(ttft)
        if self.fail:
            raise self.fail.pop(0)
        last = request.messages[-1].text()
        words = [*[f"answer {n}:", *last.split()][: self.words], "end"]
        for i, word in enumerate(words):
            if i:
                await trio.sleep(self.gap)
            await send.send(Delta(text=("" if i == 0 else " ") + word))
        usage = Usage(prompt_tokens=len(last.split()), completion_tokens=len(words))
        await send.send(Delta(finish_reason="stop", usage=usage))


def cache_config_text(cache: str = "{}", extra: str = "", **values: str) -> str:
    """The default config (fast mock) with ``cache`` on its chat route, ``extra`` after."""
    text = config_text(**values)
    chat = 'on_context_timeout = "fail"\n'  # the chat route's last line in the default
    assert text.count(chat) == 1
    return text.replace(chat, chat + f"cache = {cache}\n") + extra


def cache_app(
    cache: str = "{}", extra: str = "", model: CountingModel | None = None, **values: str
) -> tuple[App, CountingModel]:
    model = model or CountingModel()
    cfg = parse_config(cache_config_text(cache, extra, **values), source="<test>")
    return App(cfg, adapters={"mock": model}), model


def ask(text: str = "what is a cache", **extra: Any) -> dict[str, Any]:
    """A deterministic chat request (temperature 0)."""
    return {
        "model": "aiserve-mock",
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        **extra,
    }


def reply_text(r: Response) -> str:
    """The answer's text, streamed or not."""
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        return r.text()
    return str(r.json()["choices"][0]["message"]["content"])


def usage_of(r: Response) -> dict[str, Any] | None:
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        for ev in r.events():
            if ev != "[DONE]" and (u := json.loads(ev).get("usage")):
                return dict(u)
        return None
    return dict(r.json()["usage"])


def scrubbed(r: Response) -> bytes:
    """The body without what differs per request (its id and creation second)."""
    body = r.body.replace(r.headers["x-request-id"].encode(), b"ID")
    return re.sub(rb'"created":\d+', b'"created":0', body)


def metric(app: App, name: str, **labels: str) -> float:
    return app.metrics.registry.get_sample_value(name, labels) or 0.0


class CountingBackend(CacheBackend):
    """A backend that counts the calls made to the one it wraps."""

    def __init__(self, inner: CacheBackend) -> None:
        self.inner = inner
        self.gets = 0
        self.puts = 0

    async def get(self, key: str) -> Entry | None:
        self.gets += 1
        return await self.inner.get(key)

    async def put(self, key: str, entry: Entry, blob: bytes, ttl_s: float) -> None:
        self.puts += 1
        await self.inner.put(key, entry, blob, ttl_s)

    def held(self) -> tuple[int, int] | None:
        return self.inner.held()


def counting_backend(app: App) -> CountingBackend:
    """Wrap the app's cache backend in a :class:`CountingBackend`."""
    assert app.cache is not None
    spy = CountingBackend(app.cache.backend)
    app.cache.backend = spy
    return spy


async def opened(app: App, nursery: trio.Nursery) -> None:
    """Open ``app``'s response cache with the test's nursery (pytest-trio's ``nursery``
    fixture), as the app's start-up opens it with the app's own: the cache's flights
    run there, owned by the test, for a test that drives the app without its lifespan."""
    assert app.cache is not None
    await app.cache.aopen(nursery)
