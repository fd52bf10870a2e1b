"""The upstream HTTP client alone: the ``openai`` adapter over httpx2 against the lean h1 client.

    .venv/bin/python -m bench.h1_client [--duration 4] [--rounds 3] [--conc 1,16,64]

One Trio process (pinned to CPU 0) runs N tasks, each calling the adapter's
``stream`` in a loop (a streamed chat completion of 16 deltas from
``bench/node/upstream.js`` on CPU 1, decoded into deltas and drained), with
``client = "httpx2"`` and with ``client = "auto"`` (the lean client), the two
alternating in each round, each in a fresh process. Reported per point: requests
per second and the process's CPU time per request (the steadier number on a
shared machine), best of the rounds. Writes ``bench/results/<date>/h1_client.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .ab import node_upstream
from .systems import LOAD_CPU, ROOT, SYSTEM_CPU, pinned

CLIENTS = ("httpx2", "auto")


def _child(base: str, client: str, conc: int, duration: float) -> dict[str, Any]:
    """Run in the measuring process: N tasks streaming for ``duration`` s."""
    import trio

    from aiserve_trio.adapters.base import Delta, InferenceRequest, Message
    from aiserve_trio.adapters.openai import OpenAIAdapter
    from aiserve_trio.config import OpenAIAdapterConfig

    cfg = OpenAIAdapterConfig(
        base_url=base + "/v1", models=["sim-model"], client=client, max_connections=4096
    )
    adapter = OpenAIAdapter("up", cfg)
    done = 0
    errors = 0

    async def worker(until: float) -> None:
        nonlocal done, errors
        while trio.current_time() < until:
            send, recv = trio.open_memory_channel[Delta](64)
            req = InferenceRequest(
                request_id="r",
                model="sim-model",
                messages=[Message(role="user", content="hello there")],
                deadline=trio.current_time() + 30,
            )
            try:
                async with send:
                    await adapter.stream(req, send)
                async with recv:
                    async for _ in recv:
                        pass
                done += 1
            except Exception:
                errors += 1

    async def main() -> dict[str, Any]:
        nonlocal done
        async with trio.open_nursery() as nursery:
            await adapter.aopen(nursery)
            await worker(trio.current_time() + 0.5)  # warm: connections open
            done = 0
            cpu0, t0 = time.process_time(), time.monotonic()
            until = trio.current_time() + duration
            async with trio.open_nursery() as load:
                for _ in range(conc):
                    load.start_soon(worker, until)
            cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
            await adapter.aclose()
        return {
            "rps": done / wall,
            "cpu_us": cpu / max(done, 1) * 1e6,
            "requests": done,
            "errors": errors,
        }

    return trio.run(main)


def measure(base: str, client: str, conc: int, duration: float) -> dict[str, Any]:
    cmd = pinned(
        [sys.executable, "-m", "bench.h1_client", "--child", base, client, str(conc), str(duration)],
        SYSTEM_CPU,
    )
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.h1_client", description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conc", default="1,16,64")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        base, client, conc, duration = ns.child
        print(json.dumps(_child(base, client, int(conc), float(duration))))
        return 0
    concs = [int(c) for c in ns.conc.split(",")]
    best: dict[tuple[str, int], dict[str, Any]] = {}
    load0 = os.getloadavg()[0]
    with node_upstream() as up:
        for rnd in range(ns.rounds):
            for conc in concs:
                for client in CLIENTS:
                    p = measure(up.base, client, conc, ns.duration)
                    print(f"round {rnd + 1} {client} c={conc}: {p['rps']:.0f} req/s, "
                          f"{p['cpu_us']:.0f} us CPU/request, {p['errors']} errors", flush=True)
                    key = (client, conc)
                    if key not in best or p["cpu_us"] < best[key]["cpu_us"]:
                        best[key] = p
    lines = [
        f"# The upstream client alone: httpx2 against the lean h1 client ({dt.date.today().isoformat()})",
        "",
        f"Command: `python -m bench.h1_client {' '.join(sys.argv[1:] if argv is None else argv)}`. "
        f"The `openai` adapter's `stream` in N Trio tasks (CPU {SYSTEM_CPU}) against "
        f"`bench/node/upstream.js` (16 deltas, CPU {LOAD_CPU}); {ns.duration:g} s per point, "
        f"best of {ns.rounds} interleaved rounds (by CPU per request). Load average "
        f"{load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end (2 CPUs).",
        "",
        "| concurrency | httpx2 req/s | httpx2 CPU/request | lean req/s | lean CPU/request | CPU saved |",
        "|---|---|---|---|---|---|",
    ]
    for conc in concs:
        a, b = best[("httpx2", conc)], best[("auto", conc)]
        lines.append(
            f"| {conc} | {a['rps']:.0f} | {a['cpu_us']:.0f} µs | {b['rps']:.0f} | {b['cpu_us']:.0f} µs "
            f"| {(1 - b['cpu_us'] / a['cpu_us']) * 100:.0f} % |"
        )
    out = Path(ns.out) if ns.out else ROOT / "bench" / "results" / dt.date.today().isoformat() / "h1_client.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
