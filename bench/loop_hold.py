"""How long one task step holds the event loop while the largest bodies are processed.

    .venv/bin/python -m bench.loop_hold [--body-bytes 1048576] [--top 12]

In-process (the ASGI app driven directly, no gateway sockets) in front of a real
``aiserve-sim``: one request of as many full-size messages of IBAN-shaped text as
``--body-bytes`` allows to a route with ``anti-fraud-v2`` and ``gdpr-redact`` (fraud
scoring and redaction), and the same body to a route without policies whose adapter
must count the tokens (``context_window`` below the body's bytes) and which is
recorded (the recorder redacts it after the reply). A ``trio.abc.Instrument`` times
every task step; the report is the longest steps with the task and stage that took
them -- the 20 ms rule is about the longest, not the average.

Run it against another tree (``PYTHONPATH=/path/to/old/src``) for a before figure:
it uses nothing but the app, the config and the test client.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.asgi_client import Client
from tests.sim_process import run_sim
from tests.test_loop_hold import IBANISH, _config, _probe, gateway_text, largest_body, written

from aiserve_trio.config import parse_config
from aiserve_trio.runtime.asgi import App


class StepTimer(trio.abc.Instrument):
    """Times each task step; keeps every step's length with its task's name and label.

    A watchdog thread looks every 2 ms: a step running past ``stack_after`` seconds
    has the loop thread's stack taken (once per step), so the report can say where.
    """

    def __init__(self, stack_after: float = 0.015) -> None:
        self.steps: list[tuple[float, str]] = []
        self.stacks: collections.Counter[str] = collections.Counter()
        self.stack_after = stack_after
        self.depth = 6
        self._t0 = 0.0
        self._running = False
        self._taken = False
        self._loop_thread = threading.get_ident()
        self._stop = threading.Event()

    def watch(self) -> None:
        while not self._stop.wait(0.002):
            late = time.perf_counter() - self._t0 > self.stack_after
            if self._running and not self._taken and late:
                frame = sys._current_frames().get(self._loop_thread)
                if frame is not None:
                    lines = traceback.format_stack(frame)[-self.depth :]
                    self.stacks["".join(lines)] += 1
                self._taken = True

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._t0 = time.perf_counter()
        self._taken = False
        self._running = True

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self._running = False
        took = time.perf_counter() - self._t0
        if took > 0.001:
            label = None
            for var, value in task.context.items():
                if var.name == "aiserve_task_label":
                    label = value
            where = f" [{label.route}/{label.stage}]" if label is not None else ""
            self.steps.append((took, f"{task.name}{where}"))


async def run(sim: str, body_bytes: int, timer: StepTimer) -> tuple[dict[str, int], float]:
    with tempfile.TemporaryDirectory() as tmp:
        rec = Path(tmp)
        app = App(parse_config(gateway_text(sim, rec, body_bytes), source="<bench>"))
        body = largest_body(body_bytes)
        headers = {"content-type": "application/json", "x-request-timeout-ms": "120000"}
        statuses: dict[str, int] = {}
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            await app.startup(nursery)
            try:
                client = Client(app)

                async def heavy(path: str) -> None:
                    r = await client.request("POST", path, body=body, headers=headers)
                    statuses[path] = r.status

                async with trio.open_nursery() as work:
                    work.start_soon(heavy, "/v1/guarded")
                    work.start_soon(heavy, "/v1/plain")
                await written(rec)
            finally:
                await app.shutdown()
                nursery.cancel_scope.cancel()
        return statuses, time.perf_counter() - t0


async def _lateness(stop: trio.Event, late: list[float]) -> None:
    """Ask to wake every 1 ms; record how late each wake-up is."""
    while not stop.is_set():
        due = time.perf_counter() + 0.001
        await trio.sleep(0.001)
        late.append(time.perf_counter() - due)


async def _compare_one(mode: str, text: str) -> tuple[float, list[float]]:
    from aiserve_trio.core.slices import run_sliced
    from aiserve_trio.policies.redact import build_rules
    from aiserve_trio.policies.stream import Rewriter

    rw = Rewriter(build_rules())
    late: list[float] = []
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_lateness, stop, late)
        await trio.sleep(0.01)
        t0 = time.perf_counter()
        if mode == "loop":
            rw.rewrite(text)
        elif mode == "slices":
            await run_sliced(rw.rewrite_steps(text))
        else:
            await trio.to_thread.run_sync(rw.rewrite, text)
        took = time.perf_counter() - t0
        stop.set()
    return took, late


def _ms_at(ordered: list[float], f: float) -> float:
    return ordered[min(int(f * len(ordered)), len(ordered) - 1)] * 1000


def _ms_at(ordered: list[float], f: float) -> float:
    return ordered[min(int(f * len(ordered)), len(ordered) - 1)] * 1000


def compare(chars: int) -> None:
    """One redaction of ``chars`` IBAN-shaped characters: on the loop, sliced, in a thread."""
    text = (IBANISH * (chars // len(IBANISH) + 1))[:chars]
    print(f"redacting {chars} IBAN-shaped characters; a 1 ms timer's lateness meanwhile")
    print("| mode | redaction s | timer wake-ups | lateness p50 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|---|")
    for mode in ("loop", "slices", "thread"):
        took, late = trio.run(_compare_one, mode, text)
        late.sort()
        p50, p99, top = (_ms_at(late, f) for f in (0.5, 0.99, 1.0))
        print(f"| {mode} | {took:.2f} | {len(late)} | {p50:.1f} | {p99:.1f} | {top:.1f} |")


async def _healthz_run(base: str, body: bytes, rec: Path) -> tuple[dict[str, int], list[float]]:
    import httpx2

    headers = {"content-type": "application/json", "x-request-timeout-ms": "120000"}
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    done = trio.Event()

    async def heavy(path: str) -> None:
        async with httpx2.AsyncClient(timeout=120) as c:
            r = await c.post(base + path, content=body, headers=headers)
            statuses[path] = r.status_code

    async with trio.open_nursery() as nursery:
        nursery.start_soon(_probe, base, done, latencies)
        if body:
            async with trio.open_nursery() as work:
                work.start_soon(heavy, "/v1/guarded")
                work.start_soon(heavy, "/v1/plain")
            await written(rec)
        else:
            await trio.sleep(10)
        done.set()
    return statuses, latencies


def healthz(idle: bool) -> None:
    """The slow test's scenario under the hypercorn binary, with the probe's figures."""
    import statistics

    from tests.servers import hypercorn_gateway

    with tempfile.TemporaryDirectory() as tmp, run_sim() as sim:
        path = _config(Path(tmp), sim)
        with hypercorn_gateway(path) as (base, _):
            body = b"" if idle else largest_body()
            statuses, lat = trio.run(_healthz_run, base, body, Path(tmp) / "rec")
    q = statistics.quantiles(lat, n=100)
    what = "idle (10 s)" if idle else f"while {len(body)} bytes x2 are processed"
    print(f"/healthz {what}: statuses {statuses}; {len(lat)} probes")
    print(
        f"p50 {q[49] * 1000:.1f} ms, p90 {q[89] * 1000:.1f}, p99 {q[98] * 1000:.1f}, "
        f"max {max(lat) * 1000:.1f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--body-bytes", type=int, default=1_048_576)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--stacks", type=int, default=0, help="show the N most frequent stacks")
    ap.add_argument("--stack-after", type=float, default=15.0, help="ms (default 15)")
    ap.add_argument(
        "--compare",
        type=int,
        default=0,
        metavar="CHARS",
        help="instead: redact CHARS characters on the loop, in slices and in a thread",
    )
    ap.add_argument(
        "--healthz",
        choices=["load", "idle"],
        help="instead: a hypercorn worker, /healthz probed while it serves the bodies (or idle)",
    )
    args = ap.parse_args()
    if args.healthz:
        healthz(args.healthz == "idle")
        return
    if args.compare:
        compare(args.compare)
        return
    timer = StepTimer(args.stack_after / 1000)
    watchdog = threading.Thread(target=timer.watch, daemon=True)
    watchdog.start()
    with run_sim() as sim:
        statuses, wall = trio.run(run, sim, args.body_bytes, timer, instruments=[timer])
    timer._stop.set()
    steps = sorted(timer.steps, reverse=True)
    print(f"body {len(largest_body(args.body_bytes))} bytes; statuses {statuses}; {wall:.2f} s")
    print(f"steps over 1 ms: {len(steps)}; over 20 ms: {sum(1 for s, _ in steps if s > 0.020)}")
    print(f"longest step: {steps[0][0] * 1000:.1f} ms" if steps else "longest step: < 1 ms")
    for took, where in steps[: args.top]:
        print(f"  {took * 1000:8.1f} ms  {where}")
    if args.stacks:
        print(f"\nwhere steps past {timer.stack_after * 1000:.0f} ms were (most frequent first):")
        for stack, n in timer.stacks.most_common(args.stacks):
            print(f"--- {n} steps:\n{stack}")


if __name__ == "__main__":
    main()
