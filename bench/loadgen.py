"""The bench's load generator: streamed chat requests over HTTP/1.1, measured per request.

Each request records its time to first token (the first body bytes that carry a
non-empty ``"content"`` delta), the gaps between successive content deliveries,
the total time to the end of the response, the status and any error. The same
client measures every system in a run, so "added latency" is a plain difference
of percentiles: system minus ``direct``.

Two modes:

closed loop (``--concurrency N``)
    N tasks, each with its own keep-alive connection, send the next request as
    soon as the previous one ended: fixed concurrency, throughput follows.
open loop (``--rate R``)
    requests are scheduled at fixed intervals of 1/R seconds whatever the
    system does; each is timed from its *scheduled* start (no coordinated
    omission), on an idle pooled connection or a new one. ``--max-inflight``
    bounds the connections; a request that finds none is counted as an error.

The HTTP/1.1 client is h11 over a Trio socket: a few microseconds per event, far
below the systems it measures. (HTTP/2 throughput is measured with h2load; see
bench/run.py.)

Run alone: ``python -m bench.loadgen --url http://127.0.0.1:8100/v1/chat/completions
--concurrency 16 --duration 5`` prints one JSON summary.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import h11
import trio

#: A delta that carries text: the moment a token reached the client.
_CONTENT = re.compile(rb'"content":\s*"[^"]')
#: The gateway ends a failed stream with ``data: {"error": {...}}`` (not a clean finish).
_ERROR_EVENT = b'data: {"error"'


@dataclass(slots=True)
class Sample:
    """One request's measurements (seconds, relative to its start)."""

    start: float
    ttft: float | None = None
    total: float | None = None
    gaps: list[float] = field(default_factory=list)
    status: int = 0
    error: str | None = None
    bytes: int = 0


@dataclass(frozen=True, slots=True)
class Target:
    """Where and what to send."""

    host: str
    port: int
    path: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()
    #: What marks a body chunk that carries text, and one that reports a failed
    #: stream (Chat Completions by default; other APIs name their own events).
    text: re.Pattern[bytes] = _CONTENT
    failed: bytes = _ERROR_EVENT

    @classmethod
    def from_url(
        cls,
        url: str,
        body: bytes,
        headers: Sequence[tuple[str, str]] = (),
        text: re.Pattern[bytes] = _CONTENT,
        failed: bytes = _ERROR_EVENT,
    ) -> Target:
        """A target for ``url`` (``http://host:port/path`` only)."""
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"`url` must be http://host:port/path, got {url!r}")
        path = parts.path or "/"
        return cls(parts.hostname, parts.port or 80, path, body, tuple(headers), text, failed)

    def request(self) -> h11.Request:
        """The h11 request event for one POST."""
        headers = [
            ("Host", f"{self.host}:{self.port}"),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(self.body))),
            ("Accept", "text/event-stream"),
            *self.headers,
        ]
        return h11.Request(method="POST", target=self.path, headers=headers)


class Connection:
    """One keep-alive HTTP/1.1 connection that runs one request at a time."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self._stream: trio.SocketStream | None = None
        self._h11 = h11.Connection(h11.CLIENT)

    async def aclose(self) -> None:
        """Close the socket (idempotent)."""
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.aclose()

    async def run(self, sample: Sample, clock: float) -> None:
        """Send the request and read the whole response into ``sample``.

        ``clock`` is the request's start on ``time.perf_counter``'s scale. Errors
        (connect, reset, protocol) are recorded in ``sample.error`` and close the
        connection; nothing is raised except cancellation.
        """
        try:
            await self._run(sample, clock)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError) as exc:
            sample.error = type(exc).__name__
            await self._reset()

    async def _reset(self) -> None:
        await self.aclose()
        self._h11 = h11.Connection(h11.CLIENT)

    async def _run(self, sample: Sample, clock: float) -> None:
        if self._stream is None:
            self._stream = await trio.open_tcp_stream(self.target.host, self.target.port)
        conn = self._h11
        out = conn.send(self.target.request()) + conn.send(h11.Data(data=self.target.body))
        out += conn.send(h11.EndOfMessage())
        await self._stream.send_all(out)
        last: float | None = None
        now = clock
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await self._stream.receive_some(65536)
                now = time.perf_counter()
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Response):
                sample.status = event.status_code
            elif isinstance(event, h11.Data):
                sample.bytes += len(event.data)
                if self.target.failed in event.data:
                    sample.error = "error event in the stream"
                if self.target.text.search(event.data):
                    if last is None:
                        sample.ttft = now - clock
                    elif now > last:
                        sample.gaps.append(now - last)
                    last = now
            elif isinstance(event, h11.EndOfMessage):
                sample.total = time.perf_counter() - clock
                break
            elif isinstance(event, h11.ConnectionClosed):
                sample.error = "closed mid-response"
                await self._reset()
                return
        if sample.status != 200 and sample.error is None:
            sample.error = f"HTTP {sample.status}"
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        else:
            await self._reset()


async def closed_loop(
    target: Target, concurrency: int, duration: float, warmup: float = 0.5
) -> tuple[list[Sample], float]:
    """Run ``concurrency`` request loops for ``warmup + duration`` seconds.

    Returns the samples started after the warm-up and the measured span (s).
    """
    samples: list[Sample] = []
    t0 = time.perf_counter()
    measure_from = t0 + warmup
    stop_at = measure_from + duration

    async def worker() -> None:
        conn = Connection(target)
        try:
            while True:
                start = time.perf_counter()
                if start >= stop_at:
                    return
                sample = Sample(start=start - measure_from)
                await conn.run(sample, start)
                if start >= measure_from:
                    samples.append(sample)
                if sample.error is not None:
                    await trio.sleep(0.01)  # do not spin on a refusing server
        finally:
            await conn.aclose()

    # A request still running at the stop time is allowed a grace period to finish.
    with trio.move_on_after(warmup + duration + max(10.0, duration)):
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
    return samples, time.perf_counter() - measure_from


async def open_loop(
    target: Target, rate: float, duration: float, max_inflight: int = 2048
) -> tuple[list[Sample], float]:
    """Schedule ``rate`` requests per second for ``duration`` seconds.

    Returns all samples and the measured span (s).
    """
    if rate <= 0:
        raise ValueError("`rate` must be positive")
    samples: list[Sample] = []
    idle: list[Connection] = []
    inflight = 0
    t0 = time.perf_counter()

    async def one(sample: Sample, due: float) -> None:
        nonlocal inflight
        conn = idle.pop() if idle else Connection(target)
        try:
            await conn.run(sample, due)
        finally:
            inflight -= 1
            idle.append(conn)

    n = int(rate * duration)
    with trio.move_on_after(duration + max(10.0, duration)):
        async with trio.open_nursery() as nursery:
            for i in range(n):
                due = t0 + i / rate
                await trio.sleep(max(0.0, due - time.perf_counter()))
                sample = Sample(start=due - t0)
                samples.append(sample)
                if inflight >= max_inflight:
                    sample.error = "max-inflight"
                    continue
                inflight += 1
                nursery.start_soon(one, sample, due)
    for conn in idle:
        await conn.aclose()
    return samples, time.perf_counter() - t0


async def hold_streams(
    target: Target, count: int, ramp_per_s: float, hold: float
) -> tuple[list[Sample], float]:
    """Open ``count`` concurrent streams (``ramp_per_s`` new ones a second), one each.

    Used for the idle-streams scenario: every stream stays open as long as the
    upstream keeps it (slow tokens). Returns the samples and the time from the
    first open to the last close, bounded by ``hold`` seconds after the ramp.
    """
    samples: list[Sample] = []
    t0 = time.perf_counter()

    async def one(sample: Sample) -> None:
        conn = Connection(target)
        try:
            await conn.run(sample, time.perf_counter())
        finally:
            await conn.aclose()

    ramp = count / ramp_per_s
    with trio.move_on_after(ramp + hold) as scope:
        async with trio.open_nursery() as nursery:
            for i in range(count):
                await trio.sleep(max(0.0, t0 + i / ramp_per_s - time.perf_counter()))
                sample = Sample(start=time.perf_counter() - t0)
                samples.append(sample)
                nursery.start_soon(one, sample)
    if scope.cancelled_caught:
        for s in samples:
            if s.total is None and s.error is None:
                s.error = "still open at the time bound"
    return samples, time.perf_counter() - t0


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) by nearest rank, or None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


QUANTILES = (50.0, 90.0, 99.0)


def summarize(samples: Sequence[Sample], span: float) -> dict[str, Any]:
    """Percentiles (ms), throughput and error counts of one load run."""
    ok = [s for s in samples if s.error is None and s.total is not None]
    ttft = [s.ttft * 1000 for s in ok if s.ttft is not None]
    total = [s.total * 1000 for s in ok if s.total is not None]
    gaps = [g * 1000 for s in ok for g in s.gaps]
    errors: dict[str, int] = {}
    for s in samples:
        if s.error is not None:
            errors[s.error] = errors.get(s.error, 0) + 1
    def pct(xs: list[float]) -> dict[str, float | None]:
        return {f"p{q:g}": percentile(xs, q) for q in QUANTILES}
    return {
        "requests": len(samples),
        "ok": len(ok),
        "errors": errors,
        "span_s": span,
        "rps": len(ok) / span if span > 0 else 0.0,
        "ttft_ms": pct(ttft),
        "total_ms": pct(total),
        "gap_ms": {**pct(gaps), "max": max(gaps) if gaps else None},
        "ttft_raw_ms": ttft,
        "total_raw_ms": total,
    }


def chat_body(
    model: str = "sim-model", prompt: str = "hi", max_tokens: int | None = None
) -> bytes:
    """A streamed chat completion request body."""
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "messages": [{"role": "user", "content": prompt}],
    }
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return json.dumps(body).encode()


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.loadgen", description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model", default="sim-model")
    p.add_argument("--prompt", default="hi")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--header", action="append", default=[], help="Name: value (repeat)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--concurrency", type=int, help="closed loop with N connections")
    mode.add_argument("--rate", type=float, help="open loop: requests per second")
    mode.add_argument("--hold", type=int, help="open N concurrent streams and hold them")
    p.add_argument("--duration", type=float, default=5.0, help="seconds measured")
    p.add_argument("--warmup", type=float, default=0.5)
    p.add_argument("--ramp", type=float, default=1000.0, help="--hold: new streams per second")
    p.add_argument("--raw", action="store_true", help="keep the per-request TTFT/total lists")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one load and print its JSON summary on stdout."""
    ns = _parse(argv)
    headers = []
    for h in ns.header:
        name, _, value = h.partition(":")
        headers.append((name.strip(), value.strip()))
    target = Target.from_url(ns.url, chat_body(ns.model, ns.prompt, ns.max_tokens), headers)
    if ns.concurrency is not None:
        samples, span = trio.run(closed_loop, target, ns.concurrency, ns.duration, ns.warmup)
    elif ns.rate is not None:
        samples, span = trio.run(open_loop, target, ns.rate, ns.duration)
    else:
        samples, span = trio.run(hold_streams, target, ns.hold, ns.ramp, ns.duration)
    summary = summarize(samples, span)
    if not ns.raw:
        summary.pop("ttft_raw_ms")
        summary.pop("total_raw_ms")
    json.dump(summary, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
