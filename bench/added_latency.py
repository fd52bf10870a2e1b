"""The gateway's added latency in front of aiserve-sim: through the gateway minus direct.

Starts ``aiserve-sim`` (zero-delay timing by default, 16 tokens per reply) and the
gateway under hypercorn's Trio worker with ``configs/examples/sim-openai.toml``
(its ``base_url`` pointed at the sim's free port), then, per concurrency, runs
the same closed-loop streamed load (bench/loadgen.py: h11 over Trio, one
keep-alive connection per task) direct to the sim and through the gateway. It
prints a markdown table of time to first token and total time, p50 and p99, for
both paths and their difference, and writes it with the command line to
``bench/results/added_latency.md``.

    python -m bench.added_latency                      # c = 1, 32, 64; 400 requests each
    python -m bench.added_latency --concurrency 1 32 --requests 300

Loopback only; bounded by ``--requests`` per point (plus a 10 % warm-up).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import trio

from . import systems
from .loadgen import Connection, Sample, Target, chat_body, percentile
from .systems import LOAD_CPU, ROOT, SYSTEM_CPU, WORK, free_port, hypercorn_cmd, sim, start

EXAMPLE = ROOT / "configs" / "examples" / "sim-openai.toml"
RESULT = ROOT / "bench" / "results" / "added_latency.md"
SIM_ARGS = [
    "--prefill-overhead-ms",
    "0",
    "--prefill-per-token-ms",
    "0",
    "--itl-ms",
    "0",
]


async def run_point(target: Target, concurrency: int, requests: int) -> tuple[list[Sample], float]:
    """``requests`` streamed requests over ``concurrency`` keep-alive connections.

    Returns the samples after a warm-up (10 % of ``requests``, at least ``concurrency``)
    and the measured span in seconds.
    """
    warm = max(concurrency, requests // 10)
    todo = warm + requests
    samples: list[Sample] = []
    started = 0
    t_measure = 0.0

    async def worker() -> None:
        nonlocal started, t_measure
        conn = Connection(target)
        try:
            while started < todo:
                started += 1
                measured = started > warm
                if started == warm + 1:
                    t_measure = time.perf_counter()
                clock = time.perf_counter()
                sample = Sample(start=clock)
                await conn.run(sample, clock)
                if measured:
                    samples.append(sample)
        finally:
            await conn.aclose()

    with trio.move_on_after(120):
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
    return samples, time.perf_counter() - t_measure


def _ms(values: Sequence[float], q: float) -> float:
    v = percentile(values, q)
    return float("nan") if v is None else v * 1000.0


def table(rows: list[tuple[int, str, list[Sample], float]]) -> str:
    """The markdown report: per concurrency, direct, gateway and gateway minus direct."""
    out = [
        "| concurrency | path | requests | errors | req/s | TTFT p50 ms | TTFT p99 ms | total p50 ms | total p99 ms |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by_c: dict[int, dict[str, tuple[list[float], list[float]]]] = {}
    for c, path, samples, span in rows:
        ok = [s for s in samples if s.error is None and s.ttft is not None and s.total is not None]
        ttft = [s.ttft for s in ok if s.ttft is not None]
        total = [s.total for s in ok if s.total is not None]
        by_c.setdefault(c, {})[path] = (ttft, total)
        errors = len(samples) - len(ok)
        out.append(
            f"| {c} | {path} | {len(samples)} | {errors} | {len(ok) / span:,.0f} | "
            f"{_ms(ttft, 50):.2f} | {_ms(ttft, 99):.2f} | {_ms(total, 50):.2f} | {_ms(total, 99):.2f} |"
        )
        if path == "gateway" and "direct" in by_c[c]:
            dt, dtot = by_c[c]["direct"]
            out.append(
                f"| {c} | **added** (gateway - direct) | | | | "
                f"**{_ms(ttft, 50) - _ms(dt, 50):.2f}** | **{_ms(ttft, 99) - _ms(dt, 99):.2f}** | "
                f"**{_ms(total, 50) - _ms(dtot, 50):.2f}** | **{_ms(total, 99) - _ms(dtot, 99):.2f}** |"
            )
    return "\n".join(out)


def gateway_config(sim_base: str) -> Path:
    """configs/examples/sim-openai.toml with ``base_url`` pointed at the running sim."""
    text = EXAMPLE.read_text()
    text, n = re.subn(r'(?m)^base_url = ".*"$', f'base_url = "{sim_base}/v1"', text)
    if n != 1:
        raise RuntimeError(f"{EXAMPLE}: expected one base_url line")
    WORK.mkdir(parents=True, exist_ok=True)
    path = WORK / "added-latency-gateway.toml"
    path.write_text(text)
    return path


async def measure(
    direct: str, gateway: str, concurrency: list[int], requests: int, tokens: int
) -> list[tuple[int, str, list[Sample], float]]:
    rows = []
    body = chat_body(max_tokens=tokens)
    for c in concurrency:
        for name, base in (("direct", direct), ("gateway", gateway)):
            target = Target.from_url(f"{base}/v1/chat/completions", body)
            samples, span = await run_point(target, c, requests)
            rows.append((c, name, samples, span))
            print(f"  c={c:<3} {name:<8} {len(samples)} requests in {span:.2f} s", file=sys.stderr)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.added_latency", description=__doc__.split("\n")[0]
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 64])
    p.add_argument("--requests", type=int, default=400, help="measured requests per point")
    p.add_argument("--tokens", type=int, default=16, help="tokens per reply")
    p.add_argument("--out", type=Path, default=RESULT)
    p.add_argument(
        "--snapshot",
        default="HEAD",
        help="git revision whose src/ the sim and gateway run (others edit the work tree); "
        "'none': the installed package",
    )
    ns = p.parse_args(argv)
    sha = "work tree"
    if ns.snapshot != "none":
        systems.SNAPSHOT, sha = systems.snapshot(ns.snapshot)
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {int(LOAD_CPU)})  # the client shares the sim's CPU
    command = (
        "python -m bench.added_latency " + shlex.join(sys.argv[1:] if argv is None else argv)
    ).rstrip()
    with sim(SIM_ARGS, name="added-latency-sim") as upstream:
        cfg = gateway_config(upstream.base)
        port = free_port()
        env = {"AISERVE_CONFIG": str(cfg)}
        with start(
            "added-latency-gateway",
            hypercorn_cmd(port, "aiserve_trio:app"),
            port=port,
            cpu=SYSTEM_CPU,
            env=env,
        ) as gw:
            rows = trio.run(measure, upstream.base, gw.base, ns.concurrency, ns.requests, ns.tokens)
    report = table(rows)
    header = (
        "# Gateway added latency in front of aiserve-sim\n\n"
        f"Command: `{command}`\n\n"
        f"Machine: {platform.machine()}, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}; code at {sha}; sim with zero-delay timing, {ns.tokens} tokens per "
        "streamed reply; gateway = hypercorn (1 Trio worker, bench/configs/hypercorn-bench.toml) "
        "with configs/examples/sim-openai.toml (openai adapter, the lean HTTP/1.1 client); client = bench/loadgen.py "
        "(h11 over Trio, one keep-alive connection per task), closed loop. "
        "Sim and client share CPU 1, the gateway has CPU 0 (when `taskset` is available).\n\n"
    )
    text = header + report + "\n"
    print(text)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
