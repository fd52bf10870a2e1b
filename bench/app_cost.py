"""CPU per request of the gateway app alone (no hypercorn), at git revisions side by side.

    .venv/bin/python -m bench.app_cost BEFORE AFTER [--requests 3000] [--rounds 3] [--stream]

Each revision's ``src/`` is exported (``systems.snapshot``) and run in a child process
pinned to CPU 0: the ASGI app is driven in-process the way hypercorn's Trio worker
drives it with the gateway's patches in -- the body queued on a memory channel before
the app runs, ``receive`` that channel's, the scope marked for the disconnect call, which
is made and ``http.disconnect`` queued once the reply is sent -- one request after
another against ``bench/node/upstream.js`` (16 deltas, zero delay) on CPU 1. It
reports the process CPU time per request and the median time to the reply's first
body byte. Without the server's own costs and the load generator, the differences
between revisions of the request path stand out of a shared machine's noise; the
revisions alternate within each round, and the best round counts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import systems
from .ab import node_upstream
from .systems import ROOT, SYSTEM_CPU, pinned

_RESULT = re.compile(r"^RESULT (\{.*\})$", re.M)

_CONFIG = """[server]
name = "app-cost"
[sessions]
backend = "memory"
[auth]
enabled = true
[[auth.keys]]
id = "bench"
hash = "{digest}"
tenant = "default"
[adapters.up]
kind = "openai"
base_url = "{upstream}/v1"
models = ["sim-model"]
http2 = false
[[routes]]
path = "/v1/chat/completions"
name = "r0"
adapter = "up"
default_model = "sim-model"
"""


async def _drive(requests: int, stream: bool) -> dict[str, float]:
    import trio

    from aiserve_trio import create_app
    from aiserve_trio.security.auth import hash_key, new_key

    key = new_key("bench")
    path = Path(os.environ["APP_COST_DIR"]) / "config.toml"
    path.write_text(_CONFIG.format(digest=hash_key(key), upstream=os.environ["APP_COST_UPSTREAM"]))
    os.environ["AISERVE_CONFIG"] = str(path)
    app: Any = create_app()
    body = json.dumps(
        {"model": "sim-model", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    headers = [
        (b"host", b"bench"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"authorization", b"Bearer " + key.encode()),
    ]
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
        "query_string": b"", "root_path": "", "headers": headers,
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
        # As hypercorn marks it with the gateway's patches in (``server/disconnect.py``;
        # revisions before it ignore the key).
        "aiserve.disconnect_call": True,
    }
    firsts: list[float] = []

    async def one() -> int:
        queue_in, queue_out = trio.open_memory_channel[dict[str, Any]](4)
        queue_in.send_nowait({"type": "http.request", "body": body, "more_body": True})
        queue_in.send_nowait({"type": "http.request", "body": b"", "more_body": False})
        status = 0
        t0 = time.perf_counter()
        first: list[float] = []

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                if not first:
                    first.append(time.perf_counter() - t0)
                if not message.get("more_body", False):  # the stream closes
                    hook = this.pop("aiserve.on_disconnect", None)
                    if hook is not None:
                        hook()
                    queue_in.send_nowait({"type": "http.disconnect"})

        this: dict[str, Any] = dict(scope)
        await app(this, queue_out.receive, send)
        firsts.append(first[0])
        return status

    async with trio.open_nursery() as nursery:
        life_in, life_out = trio.open_memory_channel[dict[str, Any]](4)
        started = trio.Event()

        async def life_send(message: dict[str, Any]) -> None:
            if message["type"] == "lifespan.startup.complete":
                started.set()

        life_in.send_nowait({"type": "lifespan.startup"})
        nursery.start_soon(app, {"type": "lifespan", "asgi": {"version": "3.0"}},
                           life_out.receive, life_send)
        await started.wait()
        for _ in range(300):  # warm: connections, caches, the collector's first passes
            if await one() != 200:
                raise RuntimeError("the gateway did not answer 200")
        firsts.clear()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(requests):
            await one()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        life_in.send_nowait({"type": "lifespan.shutdown"})
    firsts.sort()
    return {"cpu_us": cpu / requests * 1e6, "wall_us": wall / requests * 1e6,
            "first_body_p50_us": firsts[len(firsts) // 2] * 1e6}


def _child(requests: int, stream: bool) -> None:
    import trio

    print("RESULT " + json.dumps(trio.run(_drive, requests, stream)), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.app_cost", description=__doc__.split("\n")[0])
    ap.add_argument("revs", nargs="+", help="git revisions, e.g. b835a94 HEAD")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stream", action="store_true", help="streamed requests (default: JSON)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        _child(ns.requests, ns.stream)
        return 0
    trees = {rev: systems.snapshot(rev) for rev in ns.revs}
    best: dict[str, dict[str, float]] = {}
    work = systems.WORK / "app-cost"
    work.mkdir(parents=True, exist_ok=True)
    with node_upstream() as up:
        for rnd in range(ns.rounds):
            for rev, (src, sha) in trees.items():
                cmd = pinned([sys.executable, "-m", "bench.app_cost", "--child",
                              "--requests", str(ns.requests)] + (["--stream"] if ns.stream else [])
                             + ["x"], SYSTEM_CPU)
                env = {**os.environ, "PYTHONPATH": f"{src}:{ROOT}", "APP_COST_DIR": str(work),
                       "APP_COST_UPSTREAM": up.base}
                out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                     check=True).stdout
                m = _RESULT.search(out)
                if m is None:
                    raise RuntimeError(f"no result from {rev}:\n{out}")
                r = json.loads(m.group(1))
                print(f"round {rnd + 1} {sha}: {r['cpu_us']:.0f} us CPU/req, first body "
                      f"p50 {r['first_body_p50_us']:.0f} us", flush=True)
                if sha not in best or r["cpu_us"] < best[sha]["cpu_us"]:
                    best[sha] = r
    kind = "streamed" if ns.stream else "non-streamed"
    print(f"\n| revision | CPU per {kind} request | first body byte (p50) |\n|---|---|---|")
    for sha, r in best.items():
        print(f"| {sha} | {r['cpu_us']:.0f} µs | {r['first_body_p50_us']:.0f} µs |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
