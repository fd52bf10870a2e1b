"""The upstream HTTP client alone: the ``openai`` adapter over each transport.

    .venv/bin/python -m bench.h1_client [--duration 4] [--rounds 3] [--conc 1,16,64]
                                        [--tls] [--clients httpx2,httpcore,auto,h2,h2lean]

One Trio process (pinned to CPU 0) runs N tasks, each calling the adapter's
``stream`` in a loop (a streamed chat completion of 16 deltas from
``bench/node/upstream.js`` on CPU 1, decoded into deltas and drained), once per
client, alternating in each round, each in a fresh process:

- ``httpx2``: ``client = "httpx2"`` (HTTP/1.1);
- ``httpcore``: httpcore 1.x's connection pool, as a bench-only
  :class:`~aiserve_trio.adapters.transport.Transport` (the question: is a hand-written
  client still worth keeping next to the plain library under httpx?);
- ``auto``: the lean client (``adapters/h1.py``);
- ``h2``: httpx2 with ``http2 = true`` (HTTP/2 over ALPN with ``--tls``, h2c without);
- ``h2lean``: the lean HTTP/2 client (``adapters/h2client.py``), ``http2 = true``.

``--tls`` serves the upstream over HTTPS (a private CA, ``ca_file``), offering HTTP/2
over ALPN. Reported per point: requests per second and the process's CPU time per
request (the steadier number on a shared machine), best of the rounds. Writes
``bench/results/<date>/h1_client[-tls].md``.
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
from .systems import LOAD_CPU, ROOT, SYSTEM_CPU, pinned, upstream_pki

CLIENTS = ("httpx2", "httpcore", "auto")


def _httpcore_transport(base: str, ca: str | None, headers: list[tuple[bytes, bytes]]) -> Any:
    """httpcore 1.x's pool behind the gateway's Transport interface (for this bench only)."""
    import ssl
    from collections.abc import AsyncIterator

    import httpcore
    import trio

    from aiserve_trio.adapters.transport import translate_errors

    context = ssl.create_default_context(cafile=ca) if ca else None
    pool = httpcore.AsyncConnectionPool(max_connections=4096, ssl_context=context,
                                        keepalive_expiry=30.0)

    class Reply:
        def __init__(self, response: Any) -> None:
            self.response = response
            self.status = response.status

        def header(self, name: bytes) -> bytes | None:
            return next((v for k, v in self.response.headers if k.lower() == name), None)

        def __aiter__(self) -> AsyncIterator[bytes]:
            return self.response.aiter_stream()

        async def read(self, limit: int) -> bytes:
            return bytes(await self.response.aread())[:limit]

    class Exchange:
        def __init__(self, method: str, path: str, more: Any, body: bytes, deadline: float):
            left = max(deadline - trio.current_time(), 1e-3)
            self.cm = pool.stream(method, base + path, headers=[*headers, *more], content=body,
                                  extensions={"timeout": {"connect": left, "read": left,
                                                          "write": left, "pool": left}})

        async def __aenter__(self) -> Reply:
            with translate_errors("up"):
                return Reply(await self.cm.__aenter__())

        async def __aexit__(self, *exc: Any) -> None:
            await self.cm.__aexit__(*exc)

    class HttpcoreTransport:
        def stream(self, method: str, path: str, more: Any, body: bytes, deadline: float) -> Any:
            return Exchange(method, path, more, body, deadline)

        def connections(self) -> tuple[int, int] | None:
            return None

        async def aclose(self) -> None:
            await pool.aclose()

    return HttpcoreTransport()


def _child(base: str, client: str, conc: int, duration: float, ca: str) -> dict[str, Any]:
    """Run in the measuring process: N tasks streaming for ``duration`` s."""
    import trio

    from aiserve_trio.adapters.base import Delta, InferenceRequest, Message
    from aiserve_trio.adapters.openai import OpenAIAdapter
    from aiserve_trio.config import OpenAIAdapterConfig

    kind = {"h2": "httpx2", "h2lean": "auto", "httpcore": "auto"}.get(client, client)
    cfg = OpenAIAdapterConfig(
        base_url=base + "/v1", models=["sim-model"], client=kind, max_connections=4096,
        http2=client in ("h2", "h2lean"), ca_file=ca or None,
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
            if client == "httpcore":
                headers = [(b"content-type", b"application/json"), (b"host", base.split("//")[1].encode())]
                adapter.transport = _httpcore_transport(base + "/v1", ca, headers)
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


def measure(base: str, client: str, conc: int, duration: float, ca: str) -> dict[str, Any]:
    cmd = pinned(
        [sys.executable, "-m", "bench.h1_client", "--child", base, client, str(conc), str(duration),
         ca],
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
    ap.add_argument("--tls", action="store_true", help="the upstream over HTTPS (HTTP/2 offered)")
    ap.add_argument("--clients", default=",".join(CLIENTS), help="of httpx2, httpcore, auto, h2, h2lean")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        base, client, conc, duration, ca = ns.child
        print(json.dumps(_child(base, client, int(conc), float(duration), ca)))
        return 0
    concs = [int(c) for c in ns.conc.split(",")]
    clients = ns.clients.split(",")
    best: dict[tuple[str, int], dict[str, Any]] = {}
    load0 = os.getloadavg()[0]
    pki = upstream_pki() if ns.tls else None
    ca = str(pki.ca) if pki is not None else ""
    with node_upstream(tls=pki, http2=True) as up:
        for rnd in range(ns.rounds):
            for conc in concs:
                for client in clients:
                    p = measure(up.base, client, conc, ns.duration, ca)
                    print(f"round {rnd + 1} {client} c={conc}: {p['rps']:.0f} req/s, "
                          f"{p['cpu_us']:.0f} us CPU/request, {p['errors']} errors", flush=True)
                    key = (client, conc)
                    if key not in best or p["cpu_us"] < best[key]["cpu_us"]:
                        best[key] = p
    lines = [
        f"# The upstream client alone, per transport ({dt.date.today().isoformat()})",
        "",
        f"Command: `python -m bench.h1_client {' '.join(sys.argv[1:] if argv is None else argv)}`. "
        f"The `openai` adapter's `stream` in N Trio tasks (CPU {SYSTEM_CPU}) against "
        f"`bench/node/upstream.js` (16 deltas, CPU {LOAD_CPU}"
        f"{', HTTPS with HTTP/2 offered over ALPN' if ns.tls else ''}); {ns.duration:g} s per "
        f"point, best of {ns.rounds} interleaved rounds (by CPU per request). Load average "
        f"{load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end (2 CPUs).",
        "",
        "| concurrency | " + " | ".join(f"{c} req/s | {c} CPU/request" for c in clients) + " |",
        "|---|" + "---|---|" * len(clients),
    ]
    for conc in concs:
        cells = [f"{best[(c, conc)]['rps']:.0f} | {best[(c, conc)]['cpu_us']:.0f} µs"
                 for c in clients]
        lines.append(f"| {conc} | " + " | ".join(cells) + " |")
    out = Path(ns.out) if ns.out else ROOT / "bench" / "results" / dt.date.today().isoformat() / ("h1_client-tls.md" if ns.tls else "h1_client.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
