"""``aiserve-replay``: replay recorded traffic against a target, report, and gate on a baseline.

::

    aiserve-replay recordings/ --target http://127.0.0.1:8000 --report baseline
    aiserve-replay recordings/ --target http://127.0.0.1:8000 --speed 2 \\
        --weights intent=sql:3.2,complexity=high:2.8,has_tools:4.0 --seed 7 \\
        --report candidate --compare baseline.json

Pacing: the recorded timing divided by ``--speed`` (default), or ``--rate`` requests
per second, or ``--concurrency`` workers back to back. ``--weights`` oversamples
classes (``weights.py``); ``--duration`` and ``--max-requests`` bound the run (with
neither, every record once). A progress line on stderr shows live req/s and errors
(redrawn on a terminal, every 10 s otherwise). Each request carries its recorded
channel and timeout; with ``--sessions`` also its hashed session id, so a target
with sessions builds the conversations' history again as production did. Not by
default: that history stays on the target, so a second replay against the same
target would send longer prompts than the first, and a gate would compare unlike
runs. The report goes to ``REPORT.json``
and ``REPORT.md``; with ``--compare`` the differences are printed and the exit
status is 1 when a P99 regressed beyond ``--max-regression`` (``stats.py``).

Exit status: 0 done (and the gate passed), 1 the gate failed, 2 a usage or input error.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import httpx2
import msgspec
import trio

from ..record.schema import MCP_ROUTE
from .client import HttpSender
from .recording import Recording, read_recording
from .runner import Progress, run
from .schedule import Slot, fixed_rate, in_order, plan, recorded, unpaced
from .stats import (
    Meta,
    Report,
    compare,
    markdown,
    render_comparison,
    report_decoder,
    report_encoder,
    summarize,
)
from .timing import Result
from .weights import Weight, WeightedSampler, parse_weights

DEFAULT_KEY_ENV = "AISERVE_API_KEY"


class UsageError(Exception):
    """A bad argument or input: exit status 2."""


def _positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    def convert(text: str) -> float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return convert


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="aiserve-replay",
        description="Replay recorded gateway traffic ([record]) against a target, "
        "with class weights; report P50/P90/P99 per label; gate on a baseline.",
        epilog="Exit status: 0 done, 1 the --compare gate failed, 2 usage or input error.",
    )
    p.add_argument("recording", nargs="+", help="a recording file, or a directory of them")
    p.add_argument("--target", required=True, help="base URL (http://host:port) or a full URL")
    pace = p.add_mutually_exclusive_group()
    pace.add_argument(
        "--speed", type=_positive(float), default=None,
        help="recorded timing, this many times faster (default 1)",
    )
    pace.add_argument("--rate", type=_positive(float), help="requests per second, fixed")
    pace.add_argument("--concurrency", type=_positive(int), help="workers sending back to back")
    p.add_argument(
        "--weights", default="",
        help="oversample classes: intent=sql:3.2,complexity=high:2.8,has_tools:4.0",
    )
    p.add_argument("--seed", type=int, default=1, help="seed of the weighted draw (default 1)")
    p.add_argument("--duration", type=_positive(float), help="seconds to replay for")
    p.add_argument("--max-requests", type=_positive(int), help="requests to send at most")
    p.add_argument(
        "--timeout", type=_positive(float), default=60.0,
        help="seconds from a request's scheduled start to giving up (default 60)",
    )
    p.add_argument(
        "--max-inflight", type=_positive(int), default=512,
        help="paced requests in flight at most; beyond, counted as errors (default 512)",
    )
    p.add_argument(
        "--api-key-env", default=None,
        help=f"environment variable with the API key (default {DEFAULT_KEY_ENV}, if set)",
    )
    p.add_argument(
        "--report", default="replay-report",
        help="writes REPORT.json and REPORT.md (default replay-report)",
    )
    p.add_argument("--compare", metavar="BASELINE.json", help="a report to compare with")
    p.add_argument(
        "--max-regression", type=float, default=0.2,
        help="a P99 may grow by this fraction before --compare fails (default 0.2)",
    )
    p.add_argument(
        "--max-error-increase", type=float, default=0.01,
        help="the error rate may rise by this much, absolute (default 0.01)",
    )
    p.add_argument(
        "--min-requests", type=int, default=20,
        help="a label group is gated with at least this many requests in both (default 20)",
    )
    p.add_argument(
        "--warmup", type=int, default=0,
        help="send this many records first, one at a time, and leave them out of the report "
        "(a cold target's first requests are not its latency)",
    )
    p.add_argument(
        "--sessions", action="store_true",
        help="send the recorded (hashed) session ids: the target builds the conversations' "
        "history again (do not replay twice against the same target then)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress line")
    return p


@dataclass(frozen=True, slots=True)
class Pacing:
    """What the arguments ask for, resolved against the recording."""

    slots: Iterator[Slot]
    mode: str
    concurrency: int | None
    duration: float | None
    #: Requests the replay will send, when known (for the progress line).
    total: int | None


def pacing(args: argparse.Namespace, recording: Recording, weights: Sequence[Weight]) -> Pacing:
    """The slots of the replay the arguments describe (pure but for the seeded draw).

    Raises:
        UsageError: the weights leave nothing to replay.
    """
    count = len(recording.records)
    if weights:
        try:
            sampler = WeightedSampler(recording.labels(), weights, random.Random(args.seed))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        pick = lambda _n: sampler.draw()  # noqa: E731
    else:
        pick = in_order(count)
    times: Iterator[float] | Iterator[None]
    if args.rate is not None:
        times, mode = fixed_rate(args.rate), f"{args.rate:g} req/s"
    elif args.concurrency is not None:
        times, mode = unpaced(), f"concurrency {args.concurrency}"
    else:
        speed = args.speed or 1.0
        times, mode = recorded(recording.times(), speed), f"recorded timing x{speed:g}"
    # With neither bound, each record once.
    limit = args.max_requests
    if limit is None and args.duration is None:
        limit = count
    slots = plan(times, pick, max_requests=limit, duration=args.duration)
    return Pacing(slots, mode, args.concurrency, args.duration, limit)


def api_key(args: argparse.Namespace, environ: dict[str, str]) -> str | None:
    """The key from ``--api-key-env`` (which must then be set) or the default variable.

    Raises:
        UsageError: the variable named by ``--api-key-env`` is not set.
    """
    if args.api_key_env is None:
        return environ.get(DEFAULT_KEY_ENV) or None
    key = environ.get(args.api_key_env)
    if not key:
        raise UsageError(f"--api-key-env: environment variable {args.api_key_env} is not set")
    return key


class _StreamFlag(msgspec.Struct):
    stream: bool = False


_stream_flag = msgspec.json.Decoder(_StreamFlag)


def _streams(recording: Recording) -> list[bool]:
    out = []
    for r in recording.records:
        try:
            out.append(_stream_flag.decode(r.body))
        except (msgspec.DecodeError, msgspec.ValidationError):
            out.append(_StreamFlag())
    return [f.stream for f in out]


async def _show_progress(progress: Progress, total: int | None, out: TextIO, tty: bool) -> None:
    interval = 0.5 if tty else 10.0
    while True:
        await trio.sleep(interval)
        line = progress.line(trio.current_time(), total)
        out.write(f"\r\x1b[2K{line}" if tty else f"{line}\n")
        out.flush()


async def replay(
    recording: Recording,
    target: str,
    pace: Pacing,
    *,
    key: str | None,
    request_timeout: float,
    max_inflight: int,
    progress_out: TextIO | None,
    warmup: int = 0,
    sessions: bool = False,
    transport: httpx2.AsyncBaseTransport | None = None,
) -> tuple[list[Result], float]:
    """Send the replay; the results and how long it took (seconds)."""
    sender = HttpSender(
        recording.records,
        target,
        api_key=key,
        max_connections=pace.concurrency or max_inflight,
        sessions=sessions,
        transport=transport,
    )
    streams = _streams(recording)
    rpc = [r.route == MCP_ROUTE for r in recording.records]
    progress = Progress()
    try:
        if warmup:
            count = len(recording.records)
            await run(
                plan(unpaced(), in_order(count), max_requests=warmup),
                sender,
                streams=streams.__getitem__,
                concurrency=1,
                request_timeout=request_timeout,
                rpc=rpc.__getitem__,
            )
        async with trio.open_nursery() as nursery:
            if progress_out is not None:
                tty = progress_out.isatty()
                nursery.start_soon(_show_progress, progress, pace.total, progress_out, tty)
            start = trio.current_time()
            results = await run(
                pace.slots,
                sender,
                streams=streams.__getitem__,
                concurrency=pace.concurrency,
                duration=pace.duration,
                request_timeout=request_timeout,
                max_inflight=max_inflight,
                progress=progress,
                rpc=rpc.__getitem__,
            )
            elapsed = trio.current_time() - start
            nursery.cancel_scope.cancel()
        if progress_out is not None:  # the last line stays
            prefix = "\r\x1b[2K" if progress_out.isatty() else ""
            progress_out.write(f"{prefix}{progress.line(trio.current_time(), pace.total)}\n")
            progress_out.flush()
    finally:
        await sender.aclose()
    return results, elapsed


def _report_paths(base: str) -> tuple[Path, Path]:
    stem = base[: -len(".json")] if base.endswith(".json") else base
    return Path(f"{stem}.json"), Path(f"{stem}.md")


def main(
    argv: Sequence[str] | None = None,
    *,
    stdout: TextIO | None = None,
    transport: httpx2.AsyncBaseTransport | None = None,
) -> int:
    """The console script. ``stdout`` and ``transport`` (httpx2's) are for tests."""
    argv = list(sys.argv[1:] if argv is None else argv)
    out = stdout or sys.stdout
    args = build_parser().parse_args(argv)
    try:
        return _main(args, argv, out, transport)
    except UsageError as exc:
        print(f"aiserve-replay: {exc}", file=sys.stderr)
        return 2


def _main(
    args: argparse.Namespace,
    argv: list[str],
    out: TextIO,
    transport: httpx2.AsyncBaseTransport | None,
) -> int:
    try:
        weights = parse_weights(args.weights)
    except ValueError as exc:
        raise UsageError(f"--weights: {exc}") from None
    baseline: Report | None = None
    if args.compare is not None:
        try:
            baseline = report_decoder.decode(Path(args.compare).read_bytes())
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise UsageError(f"--compare {args.compare}: not a replay report ({exc})") from None
    try:
        recording = read_recording(args.recording)
    except OSError as exc:
        raise UsageError(str(exc)) from None
    if not recording.records:
        why = f"{recording.no_body} without a body, {recording.malformed} malformed"
        raise UsageError(f"no replayable record in {', '.join(args.recording)} ({why})")
    key = api_key(args, dict(os.environ))
    pace = pacing(args, recording, weights)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    results, elapsed = trio.run(
        lambda: replay(
            recording,
            args.target,
            pace,
            key=key,
            request_timeout=args.timeout,
            max_inflight=args.max_inflight,
            progress_out=None if args.quiet else sys.stderr,
            warmup=args.warmup,
            sessions=args.sessions,
            transport=transport,
        )
    )
    meta = Meta(
        command=shlex.join(["aiserve-replay", *argv]),
        target=args.target,
        recordings=list(args.recording),
        records=len(recording.records),
        mode=pace.mode,
        weights=",".join(str(w) for w in weights),
        seed=args.seed if weights else None,
        started=started,
        duration_s=round(elapsed, 3),
    )
    report = summarize(results, recording.labels(), meta)
    json_path, md_path = _report_paths(args.report)
    json_path.write_bytes(msgspec.json.format(report_encoder.encode(report)) + b"\n")
    md_path.write_text(markdown(report))
    out.write(markdown(report))
    out.write(f"\nreport: {json_path}, {md_path}\n")
    if baseline is None:
        return 0
    comparison = compare(
        report,
        baseline,
        max_regression=args.max_regression,
        max_error_increase=args.max_error_increase,
        min_requests=args.min_requests,
    )
    out.write(f"\ncompared with {args.compare}:\n")
    out.write(
        render_comparison(
            comparison,
            max_regression=args.max_regression,
            max_error_increase=args.max_error_increase,
        )
    )
    return 0 if comparison.passed else 1
