"""What tracing and the scheduler-lag probe cost, measured in one run.

Drives the app in-process (no sockets, so the gateway's own cost is all that is
measured and any overhead shows at its largest) on the zero-delay mock with a
ten-word streamed reply. Variants run interleaved, several rounds each, so that
drift on the machine hits them alike; the median round counts.

    .venv/bin/python -m bench.observability_cost [--requests 3000] [--rounds 5]

Writes bench/results/observability_cost.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import trio
from opentelemetry.sdk.trace import TracerProvider

from aiserve_trio.config import load_config, parse_config
from aiserve_trio.runtime.asgi import App

ROOT = Path(__file__).resolve().parent.parent
BODY = json.dumps(
    {
        "model": "aiserve-mock",
        "stream": True,
        "messages": [{"role": "user", "content": "echo: one two three four five six seven eight nine ten"}],
    }
).encode()
SCOPE: dict[str, Any] = {
    "type": "http",
    "http_version": "1.1",
    "method": "POST",
    "path": "/v1/chat/completions",
    "headers": [(b"content-type", b"application/json")],
    "query_string": b"",
}


async def _one(app: App) -> None:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        pass

    await app(SCOPE, receive, send)


def variant(tracing: bool, sdk: bool, lag: bool) -> App:
    base = (ROOT / "bench/configs/zero-mock.toml").read_text()
    text = base + f"\n[observability]\ntracing = {str(tracing).lower()}\nscheduler_lag = {str(lag).lower()}\n"
    cfg = parse_config(text, source="bench")
    return App(cfg, tracer_provider=TracerProvider() if sdk else None)


async def measure(app: App, n: int) -> float:
    async with trio.open_nursery() as nursery:
        await app.startup(nursery)  # background tasks too: the lag probe runs there
        try:
            for _ in range(200):
                await _one(app)
            t0 = time.perf_counter()
            for _ in range(n):
                await _one(app)
            return n / (time.perf_counter() - t0)
        finally:
            nursery.cancel_scope.cancel()
            await app.shutdown()


VARIANTS = {
    "all off (tracing off, no lag probe)": (False, False, False),
    "lag probe only (a wake-up every 50 ms)": (False, False, True),
    "default: tracing on without an SDK (spans skipped) + lag probe": (True, False, True),
    "tracing with the SDK recording spans (no exporter) + lag probe": (True, True, True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    load_config(ROOT / "bench/configs/zero-mock.toml")  # fail early on a bad config
    results: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for r in range(args.rounds):
        for name, flags in VARIANTS.items():
            rps = trio.run(measure, variant(*flags), args.requests)
            results[name].append(rps)
            print(f"round {r + 1}/{args.rounds} {name}: {rps:,.0f} req/s", flush=True)
    base = statistics.median(results["all off (tracing off, no lag probe)"])
    lines = [
        "# Cost of tracing and the scheduler-lag probe",
        "",
        f"Command: `.venv/bin/python -m bench.observability_cost --requests {args.requests} --rounds {args.rounds}`",
        f"Machine: {platform.machine()}, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d')}. In-process (no sockets): the gateway's own cost only.",
        "",
        "| variant | median req/s | vs all off |",
        "|---|---|---|",
    ]
    for name in VARIANTS:
        med = statistics.median(results[name])
        lines.append(f"| {name} | {med:,.0f} | {100 * (med / base - 1):+.1f} % |")
    out = ROOT / "bench/results/observability_cost.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
