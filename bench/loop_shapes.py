"""How long ``/healthz`` waits while one request of a hostile *shape* is served (issue 51, item 1).

    .venv/bin/python -m bench.loop_shapes [--shapes chat-parts,messages-tools] [--n 100000]
    PYTHONPATH=/path/to/old/src .venv/bin/python -m bench.loop_shapes     # a before figure

A real hypercorn worker (``configs/hypercorn.toml``) with ``gdpr-redact`` on its chat,
Responses and Messages routes (the mock adapter answers) is sent, one at a time, a
request of many tiny pieces -- ``--n`` one-character text parts in one message (the
Messages API's blocks, the Responses API's ``input_text`` parts), ``--n`` / 5 tools, ``--n``
/ 10 Responses input items -- and, for each API, about the largest request the default
limits let through (990 parts in each of 10 messages). Meanwhile a probe on another keep-alive
connection sends ``GET /healthz`` every 10 ms. Reported per shape: the request's status
and time, and the probe's longest wait -- the 20 ms rule is about the longest.

It uses nothing of the package but the hypercorn binary, and of the tests the config
text, the probe and the server fixture -- not ``tests/test_loop_shapes.py``, whose shapes
these are: run against another tree's ``src`` (``PYTHONPATH``: the worker inherits it)
it gives that tree's figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.conftest import config_text
from tests.servers import hypercorn_gateway
from tests.test_loop_hold import _probe

PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


def redacting_config() -> str:
    """The embedded config (the mock answering at once) with ``gdpr-redact`` on the
    chat, Responses and Messages routes."""
    text = config_text(ttft_ms="0", inter_token_ms="0")
    out = []
    for block in text.split("\n[[routes]]\n"):
        head = block.split("\n", 3)[:3]
        if any(f'path = "{p}"' in line for p in PATHS.values() for line in head):
            block = block.replace("policies = []\n", "")
            block = block.replace("\nadapter = ", '\npolicies = ["gdpr-redact"]\nadapter = ', 1)
        out.append(block)
    return "\n[[routes]]\n".join(out)


def _parts(api: str, n: int) -> list[dict[str, str]]:
    kind = {"responses": "input_text"}.get(api, "text")
    return [{"type": kind, "text": "a"}] * n


def body(shape: str, n: int) -> tuple[str, dict[str, object]]:
    """The API and the request of one shape."""
    api, what = shape.split("-", 1)
    if what == "parts":
        parts = [_parts(api, n)]
    elif what == "allowed":  # a Responses item counts as a part too
        parts = [_parts(api, 990) for _ in range(10)]
    else:
        parts = [[{"type": "text" if api != "responses" else "input_text", "text": "hi"}]]
    user: list[dict[str, object]] = [{"role": "user", "content": p} for p in parts]
    req: dict[str, object]
    if api == "messages":
        req = {"model": "aiserve-mock", "max_tokens": 16, "messages": _alternating(user)}
    elif api == "responses":
        req = {"model": "aiserve-mock", "input": user}
    else:
        req = {"model": "aiserve-mock", "messages": user}
    if what == "tools":
        schema = {"type": "object", "properties": {"a": {"type": "string"}}}
        if api == "messages":
            tools: list[object] = [{"name": f"f{i}", "input_schema": schema} for i in range(n // 5)]
        elif api == "responses":
            tools = [
                {"type": "function", "name": f"f{i}", "parameters": schema} for i in range(n // 5)
            ]
        else:
            fns = ({"name": f"f{i}", "parameters": schema} for i in range(n // 5))
            tools = [{"type": "function", "function": fn} for fn in fns]
        req["tools"] = tools
    if what == "items":
        req["input"] = [{"role": "user", "content": "a"}] * (n // 10)
    return api, req


def _alternating(user: list[dict[str, object]]) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for m in user:
        if out:
            out.append({"role": "assistant", "content": "ok"})
        out.append(m)
    return out


SHAPES = (
    "chat-parts",
    "responses-parts",
    "messages-parts",
    "chat-tools",
    "responses-tools",
    "messages-tools",
    "responses-items",
    "chat-allowed",
    "responses-allowed",
    "messages-allowed",
)


async def one(base: str, path: str, data: bytes) -> tuple[int, float, list[float], bytes]:
    import httpx2

    latencies: list[float] = []
    done = trio.Event()
    result: list[object] = []
    headers = {"content-type": "application/json", "x-request-timeout-ms": "120000"}

    async def heavy() -> None:
        async with httpx2.AsyncClient(timeout=120) as c:
            await trio.sleep(0.05)  # the probe is under way
            t0 = time.perf_counter()
            r = await c.post(base + path, content=data, headers=headers)
            result[:] = [r.status_code, time.perf_counter() - t0, r.content[:160]]
        await trio.sleep(0.05)
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(_probe, base, done, latencies)
        nursery.start_soon(heavy)
    status, took, head = result
    assert isinstance(status, int)
    assert isinstance(took, float)
    assert isinstance(head, bytes)
    return status, took, latencies, head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--n", type=int, default=100_000, help="parts (tools: n/5, items: n/10)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gateway.toml"
        path.write_text(redacting_config())
        with hypercorn_gateway(path) as (base, _):
            print("| shape | body bytes | status | request s | probes | longest /healthz wait ms |")
            print("|---|---|---|---|---|---|")
            for shape in args.shapes.split(","):
                api, req = body(shape, args.n)
                data = json.dumps(req).encode()
                status, took, lat, head = trio.run(one, base, PATHS[api], data)
                print(
                    f"| {shape} | {len(data)} | {status} | {took:.2f} | {len(lat)} | "
                    f"{max(lat) * 1000:.1f} |"
                )
                if status != 200:
                    print(f"|  | {head.decode(errors='replace')} |||||")


if __name__ == "__main__":
    main()
