"""What the MCP gateway adds to a tool call: ``tools/call`` through ``/mcp`` against the same
upstream called directly, side by side in one run (issue 52: at most 1 ms p50).

    .venv/bin/python -m bench.mcp_overhead                 # 2,000 calls each way
    .venv/bin/python -m bench.mcp_overhead --calls 5000 --policies

The upstream is ``@modelcontextprotocol/server-everything`` over Streamable HTTP (Node,
tests/mcp-node: ``npm ci --prefix tests/mcp-node``), its ``echo`` tool. The gateway runs
under hypercorn (one worker) with auth on, one key granted ``everything/echo``, the audit
log on (one row per call). One client (Python's ``http.client``, keep-alive, one call at a
time) alternates: a call direct, a call through the gateway, so both see the same moment
of a shared machine. ``--policies`` adds ``[mcp] policies = ["gdpr-redact"]`` (arguments
and results redacted). Prints p50, p90, p99 of each and the p50 difference.

``--sdk`` also times the official ``mcp`` SDK's client (its ``Client`` over
``streamable_http_client``, on Trio) calling the same upstream directly, after the
alternating rounds: what each upstream call would cost the gateway had it used the SDK's
client session instead of its own msgspec JSON-RPC over ``adapters/h1.py``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EVERYTHING = (
    ROOT / "tests/mcp-node/node_modules/@modelcontextprotocol/server-everything/dist/index.js"
)
KEY = "aik_bench_" + "b" * 32


class Conn:
    """One keep-alive connection speaking Streamable HTTP to an MCP endpoint."""

    def __init__(self, port: int, headers: dict[str, str]) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port)
        self.headers = {
            "content-type": "application/json",
            "accept": "application/json, text/event-stream",
            **headers,
        }
        self.ids = 0
        init = {"protocolVersion": "2025-11-25", "capabilities": {},
                "clientInfo": {"name": "bench", "version": "1"}}  # fmt: skip
        status, hdrs, _ = self.post("initialize", init)
        assert status == 200, status
        self.headers["mcp-session-id"] = hdrs["mcp-session-id"]
        self.headers["mcp-protocol-version"] = "2025-11-25"
        self.post("notifications/initialized", {}, notify=True)

    def post(
        self, method: str, params: dict[str, Any], notify: bool = False
    ) -> tuple[int, dict[str, str], Any]:
        msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "params": params}
        if not notify:
            self.ids += 1
            msg["id"] = self.ids
        self.conn.request("POST", "/mcp", json.dumps(msg).encode(), self.headers)
        r = self.conn.getresponse()
        body = r.read()
        headers = {k.lower(): v for k, v in r.getheaders()}
        if notify or not body:
            return r.status, headers, None
        if headers.get("content-type", "").startswith("text/event-stream"):
            datas = [ln[5:].strip() for ln in body.decode().splitlines() if ln.startswith("data:")]
            answers = [json.loads(d) for d in datas if d]
            return r.status, headers, next(a for a in answers if a.get("id") == self.ids)
        return r.status, headers, json.loads(body)

    def call(self, name: str, args: dict[str, Any]) -> float:
        t0 = time.perf_counter()
        status, _, answer = self.post("tools/call", {"name": name, "arguments": args})
        took = time.perf_counter() - t0
        assert status == 200, status
        assert "result" in answer, answer
        return took


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 20) -> None:
    import socket

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"port {port} did not open")


def gateway_config(upstream_port: int, tmp: Path, policies: bool) -> Path:
    sys.path.insert(0, str(ROOT / "src"))
    from aiserve_trio.security.auth import hash_key

    text = (ROOT / "configs" / "aiserve.toml").read_text()
    assert "[auth]\nenabled = false\n" in text
    auth = f"""[auth]
enabled = true
[[auth.keys]]
id = "bench"
hash = "{hash_key(KEY)}"
tenant = "default"
mcp_tools = ["everything/echo"]

[audit]
path = "{tmp / "audit.db"}"
"""
    text = text.replace("[auth]\nenabled = false\n", auth)
    text += f"""
[mcp]
policies = {'["gdpr-redact"]' if policies else "[]"}

[mcp.servers.everything]
url = "http://127.0.0.1:{upstream_port}/mcp"
"""
    path = tmp / "gw.toml"
    path.write_text(text)
    return path


def sdk_times(port: int, calls: int) -> list[float]:
    """``calls`` echo calls with the SDK's client, one at a time (after 200 to warm up)."""
    import trio
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    async def run() -> list[float]:
        out: list[float] = []
        transport = streamable_http_client(f"http://127.0.0.1:{port}/mcp")
        async with Client(transport, mode="legacy") as client:
            for i in range(200 + calls):
                t0 = time.perf_counter()
                await client.call_tool("echo", {"message": "hello from the bench"})
                if i >= 200:
                    out.append(time.perf_counter() - t0)
        return out

    return trio.run(run)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--policies", action="store_true")
    ap.add_argument("--sdk", action="store_true", help="also time the mcp SDK's client")
    args = ap.parse_args()
    if not EVERYTHING.exists():
        sys.exit("npm ci --prefix tests/mcp-node first")
    up_port, gw_port = free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        try:
            env = {**os.environ, "PORT": str(up_port)}
            procs.append(subprocess.Popen(["node", str(EVERYTHING), "streamableHttp"], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
            wait_port(up_port)
            cfg = gateway_config(up_port, tmp, args.policies)
            genv = {**os.environ, "AISERVE_CONFIG": str(cfg)}
            hyper = str(Path(sys.executable).parent / "hypercorn")
            procs.append(subprocess.Popen(
                [hyper, "--config", str(ROOT / "configs/hypercorn.toml"),
                 "--bind", f"127.0.0.1:{gw_port}", "aiserve_trio:app"],
                cwd=ROOT, env=genv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))  # fmt: skip
            wait_port(gw_port)
            time.sleep(1.0)  # the gateway's handshake with the upstream
            direct = Conn(up_port, {})
            through = Conn(gw_port, {"authorization": f"Bearer {KEY}"})
            message = {"message": "hello from the bench, nothing to redact here"}
            for _ in range(200):  # warm both paths
                direct.call("echo", message)
                through.call("everything__echo", message)
            d_times: list[float] = []
            g_times: list[float] = []
            for _ in range(args.calls):
                d_times.append(direct.call("echo", message))
                g_times.append(through.call("everything__echo", message))
            s_times = sdk_times(up_port, args.calls) if args.sdk else []
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)
    d50, g50 = statistics.median(d_times) * 1000, statistics.median(g_times) * 1000
    print(f"tools/call echo, {args.calls} calls each, alternating; policies: {args.policies}")
    print(f"{'':>10} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}")
    rows = [("direct", d_times), ("gateway", g_times)] + ([("sdk", s_times)] if s_times else [])
    for name, xs in rows:
        print(f"{name:>10} {pct(xs, 0.5):8.3f} {pct(xs, 0.9):8.3f} {pct(xs, 0.99):8.3f}")
    print(f"added p50: {g50 - d50:.3f} ms")
    if s_times:
        print(f"the SDK's client over the direct one, p50: {pct(s_times, 0.5) - d50:.3f} ms")


if __name__ == "__main__":
    main()
