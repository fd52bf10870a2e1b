"""What a semantic miss adds to a request, with the embedding adapter local (in process).

    .venv/bin/python -m bench.semantic_cost [--requests 2000] [--fill 0,1000,10000] [--rounds 3]

The app is driven in process (no server, no load generator), one request after
another, on the embedded default config with its mock model answering at once
(``ttft_ms = 0``, ``inter_token_ms = 0``) and a cache on the chat route. Two
variants, alternating within each round (the best round counts):

- ``exact``: ``cache = {}`` -- every request an exact miss (each question is new);
- ``semantic``: ``cache = { semantic = { embeddings = "vec", ... } }`` with ``vec`` a
  second mock adapter (the lexical vectors of ``util/vectors.py``, no delay) -- every
  request an exact miss and then a semantic miss: the question embedded through the
  adapter, its facts read, its guard's questions searched, and its own filed.

With ``--fill N`` the semantic index first holds N questions under the guard every
measured question falls under (questions without facts, on one route, tenant and
conversation: the worst case, one bucket), so the search scores N vectors.

It prints, per variant and fill, the median wall time and the process CPU time per
request, and the difference: the added latency of a semantic miss.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

_WORDS = ["account", "card", "loan", "fee", "rate", "transfer", "balance", "branch", "limit", "statement", "deposit", "payment", "online", "mobile", "interest", "charge", "open", "close", "reset", "block", "travel", "insurance"]


def _config(semantic: bool) -> Any:
    from aiserve_trio.config import default_config_text, parse_config

    text = default_config_text()
    for key in ("ttft_ms", "inter_token_ms"):
        text = text.replace(f"\n{key} = ", f"\n{key} = 0 #", 1)
    chat = 'on_context_timeout = "fail"\n'
    cache = '{ semantic = { embeddings = "vec", model = "aiserve-mock" } }' if semantic else "{}"
    text = text.replace(chat, chat + f"cache = {cache}\n", 1)
    text += '\n[adapters.vec]\nkind = "mock"\nmodels = ["aiserve-mock"]\nttft_ms = 0\n'
    text += "\n[cache]\nsemantic_max_entries = 1000000\n"
    return parse_config(text, source="<bench>")


def _question(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(12)) + "?"


async def _drive(semantic: bool, requests: int, fill: int, seed: int) -> dict[str, float]:
    import trio

    from aiserve_trio import create_app

    app: Any = create_app(_config(semantic))
    rng = random.Random(seed)
    times: list[float] = []

    async def one(text: str) -> int:
        body = json.dumps(
            {"model": "aiserve-mock", "temperature": 0,
             "messages": [{"role": "user", "content": text}]}
        ).encode()  # fmt: skip
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
            "headers": [(b"host", b"bench"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
        }  # fmt: skip
        queue_in, queue_out = trio.open_memory_channel[dict[str, Any]](4)
        queue_in.send_nowait({"type": "http.request", "body": body, "more_body": False})
        status = 0

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                queue_in.send_nowait({"type": "http.disconnect"})

        await app(scope, queue_out.receive, send)
        return status

    async with trio.open_nursery() as nursery:
        life_in, life_out = trio.open_memory_channel[dict[str, Any]](4)
        started = trio.Event()

        async def life_send(message: dict[str, Any]) -> None:
            if message["type"] == "lifespan.startup.complete":
                started.set()

        life_in.send_nowait({"type": "lifespan.startup"})
        nursery.start_soon(
            app, {"type": "lifespan", "asgi": {"version": "3.0"}}, life_out.receive, life_send
        )
        await started.wait()
        if semantic and fill:
            from aiserve_trio.cache.semantic import Item, unit
            from aiserve_trio.util.vectors import DEFAULT_DIMENSIONS, vector

            # The guard of a fact-free question on this route: filed by one request.
            probe_text = _question(rng)
            if await one(probe_text) != 200:
                raise RuntimeError("the gateway did not answer 200")
            index = app.cache.semantic.index
            [guard] = set(index._order.values())  # key -> guard
            for i in range(fill):
                v = unit(vector(_question(rng), DEFAULT_DIMENSIONS))
                assert v is not None
                index.add(Item(guard, f"fill{i}", v, "", time.time() + 3600))
        for _ in range(200):  # warm
            await one(_question(rng))
        cpu0 = time.process_time()
        for _ in range(requests):
            t0 = time.perf_counter()
            if await one(_question(rng)) != 200:
                raise RuntimeError("the gateway did not answer 200")
            times.append(time.perf_counter() - t0)
        cpu = time.process_time() - cpu0
        life_in.send_nowait({"type": "lifespan.shutdown"})
    return {"wall_p50_us": statistics.median(times) * 1e6, "cpu_us": cpu / requests * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.semantic_cost")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--fill", default="0,1000,10000", help="questions under the guard first")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    import trio

    fills = [int(f) for f in args.fill.split(",")]
    best: dict[tuple[str, int], dict[str, float]] = {}
    for r in range(args.rounds):
        for fill in fills:
            for name in ("exact", "semantic"):
                got = trio.run(_drive, name == "semantic", args.requests, fill, r)
                key = (name, fill)
                if key not in best or got["wall_p50_us"] < best[key]["wall_p50_us"]:
                    best[key] = got
    print("fill     variant   wall p50 (us)  cpu/request (us)")
    for fill in fills:
        for name in ("exact", "semantic"):
            b = best[(name, fill)]
            print(f"{fill:<8} {name:<9} {b['wall_p50_us']:>13.0f} {b['cpu_us']:>17.0f}")
        e, s = best[("exact", fill)], best[("semantic", fill)]
        added = s["wall_p50_us"] - e["wall_p50_us"]
        print(f"{fill:<8} added     {added:>13.0f} {s['cpu_us'] - e['cpu_us']:>17.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
