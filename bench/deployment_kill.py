"""Error rate and P99 through a deployment kill, with and without a deployment group.

    .venv/bin/python -m bench.deployment_kill [--concurrency 16] [--duration 10] [--kill-at 3]

Two ``aiserve-sim`` deployments of one model (20 ms to the first token, 20 tokens
10 ms apart) and the gateway under hypercorn (one Trio worker, pinned to CPU 0;
the sims and the load on CPU 1), run twice with the same load (``bench/loadgen.py``,
closed loop, per-request error accounting):

- ``single``: the route's adapter is one deployment (``sim_a``): today's shape;
- ``group``: ``configs/examples/ha.toml`` as shipped (both deployments, fallbacks,
  passive and active health), addresses replaced.

``--kill-at`` seconds into the measured run, ``sim_a`` is SIGKILLed. Reported per
run: requests, errors (by kind) before and after the kill, the error rate, P50/P99
of the whole request (successful ones) over the run and in the two seconds after
the kill. Written to ``bench/results/<date>/deployment-kill.md`` (and ``.json``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import trio

from . import loadgen, systems
from .systems import LOAD_CPU, ROOT, SYSTEM_CPU, WORK, free_port

HA = ROOT / "configs" / "examples" / "ha.toml"
SIM_ARGS = ["--prefill-overhead-ms", "20", "--prefill-per-token-ms", "0", "--itl-ms", "10",
            "--output-tokens-mean", "20", "--output-tokens-std", "0"]  # fmt: skip


def config_text(mode: str, a: str, b: str) -> str:
    """ha.toml with the sims' addresses; ``single`` routes to sim_a alone."""
    text = HA.read_text().replace("127.0.0.1:8101", a).replace("127.0.0.1:8102", b)
    if mode == "single":
        text = text.replace('adapter = "ha"\n', 'adapter = "sim_a"\n')
    return text


def run_one(mode: str, concurrency: int, duration: float, kill_at: float) -> dict[str, Any]:
    env = {"PYTHONPATH": str(ROOT / "src")}  # this tree's gateway, not an installed one
    pa, pb, pg = free_port(), free_port(), free_port()
    a_cmd = systems.sim_cmd(pa, SIM_ARGS)
    b_cmd = systems.sim_cmd(pb, SIM_ARGS)
    with (
        systems.start(f"{mode}-sim-a", a_cmd, port=pa, cpu=LOAD_CPU, env=env) as sim_a,
        systems.start(f"{mode}-sim-b", b_cmd, port=pb, cpu=LOAD_CPU, env=env),
    ):
        cfg = WORK / f"deployment-kill-{mode}.toml"
        cfg.parent.mkdir(parents=True, exist_ok=True)
        cfg.write_text(config_text(mode, f"127.0.0.1:{pa}", f"127.0.0.1:{pb}"))
        gw_cmd = systems.hypercorn_cmd(pg, "aiserve_trio:app")
        with systems.start(
            f"{mode}-gateway", gw_cmd, port=pg, cpu=SYSTEM_CPU,
            env={**env, "AISERVE_CONFIG": str(cfg)},
        ):  # fmt: skip
            target = loadgen.Target(
                "127.0.0.1", pg, "/v1/chat/completions", loadgen.chat_body(),
                (("x-request-timeout-ms", "5000"),),
            )  # fmt: skip
            killed: list[float] = []

            async def main() -> tuple[list[loadgen.Sample], float]:
                warmup = 1.0
                async with trio.open_nursery() as nursery:

                    async def killer() -> None:
                        await trio.sleep(warmup + kill_at)
                        sim_a.proc.send_signal(signal.SIGKILL)
                        killed.append(kill_at)

                    nursery.start_soon(killer)
                    return await loadgen.closed_loop(target, concurrency, duration, warmup)

            samples, span = trio.run(main)
    return summary(mode, samples, span, kill_at)


def summary(mode: str, samples: list[loadgen.Sample], span: float, kill_at: float) -> dict[str, Any]:
    def errs(xs: list[loadgen.Sample]) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in xs:
            if s.error is not None:
                out[s.error] = out.get(s.error, 0) + 1
        return out

    before = [s for s in samples if s.start < kill_at]
    after = [s for s in samples if s.start >= kill_at]
    # In flight at the kill: started before it, ended after it.
    in_flight = [s for s in before if s.total is not None and s.start + s.total > kill_at]
    window = [s for s in samples if kill_at <= s.start < kill_at + 2.0]
    ok = [s.total * 1000 for s in samples if s.error is None and s.total is not None]
    ok_window = [s.total * 1000 for s in window if s.error is None and s.total is not None]
    n_err = sum(1 for s in samples if s.error is not None)
    return {
        "mode": mode,
        "requests": len(samples),
        "span_s": round(span, 2),
        "errors": n_err,
        "error_rate": n_err / len(samples) if samples else 0.0,
        "errors_before_kill": errs(before),
        "errors_after_kill": errs(after),
        "in_flight_at_kill": len(in_flight),
        "errors_of_those_in_flight": sum(1 for s in in_flight if s.error is not None),
        "p50_ms": loadgen.percentile(ok, 50),
        "p99_ms": loadgen.percentile(ok, 99),
        "p99_ms_2s_after_kill": loadgen.percentile(ok_window, 99),
    }


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def report(results: list[dict[str, Any]], command: str, args: argparse.Namespace) -> str:
    lines = [
        "# Deployment kill: with and without a deployment group",
        "",
        f"`{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{os.cpu_count()} CPUs (gateway pinned to CPU {SYSTEM_CPU}, sims and load to CPU {LOAD_CPU}). "
        f"Closed loop, {args.concurrency} connections, {args.duration:g} s measured after 1 s of "
        f"warm-up; `sim_a` SIGKILLed {args.kill_at:g} s in. Each sim: 20 ms to the first "
        "token, 20 tokens 10 ms apart (about 220 ms a request). `single`: the route on "
        "`sim_a` alone; `group`: `configs/examples/ha.toml` as shipped.",
        "",
        "| run | requests | errors | error rate | in flight at the kill (of them failed) | "
        "errors after the kill | P50 ms | P99 ms | P99 ms, 2 s after the kill |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        after = ", ".join(f"{n} {k}" for k, n in r["errors_after_kill"].items()) or "0"
        lines.append(
            f"| {r['mode']} | {r['requests']} | {r['errors']} | {r['error_rate']:.1%} | "
            f"{r['in_flight_at_kill']} ({r['errors_of_those_in_flight']}) | {after} | "
            f"{fmt(r['p50_ms'])} | {fmt(r['p99_ms'])} | {fmt(r['p99_ms_2s_after_kill'])} |"
        )
    lines += [
        "",
        "Errors are what the client saw: an HTTP error status, or an error event in a "
        "stream (`error event in the stream`). Latencies are of the successful requests.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--kill-at", type=float, default=3.0)
    p.add_argument("--out", type=Path, default=None, help="results folder (default: today's)")
    args = p.parse_args(argv)
    results = [run_one(m, args.concurrency, args.duration, args.kill_at) for m in ("single", "group")]
    out = args.out or ROOT / "bench" / "results" / dt.date.today().isoformat()
    out.mkdir(parents=True, exist_ok=True)
    command = ".venv/bin/python -m bench.deployment_kill " + " ".join(argv or sys.argv[1:])
    (out / "deployment-kill.md").write_text(report(results, command.strip(), args))
    (out / "deployment-kill.json").write_text(json.dumps(results, indent=2) + "\n")
    for r in results:
        print(json.dumps({k: v for k, v in r.items() if not re.match(r"^p\d", k)} | {
            "p99_ms": r["p99_ms"], "p99_ms_2s_after_kill": r["p99_ms_2s_after_kill"]}))
    print(f"wrote {out / 'deployment-kill.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
