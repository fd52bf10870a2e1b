"""Gateway CPU per streamed request: native pass-through against the translated paths.

    .venv/bin/python -m bench.native_cpu [--requests 400] [--rounds 3] [--out FILE]

One aiserve-sim process (zero model time, 64 tokens a reply) speaks Anthropic's and
OpenAI's APIs; the gateway runs in this process (the app driven by the tests' ASGI
client over the real upstream sockets) with four routes on it:

- ``messages -> anthropic``: a Messages client, an Anthropic backend -- native (issue 44):
  the body goes as sent, the provider's events come back as sent;
- the same with ``native = false`` on the route: translated both ways (the path every
  Messages request to Anthropic took before native pass-through);
- ``messages -> openai``: a Messages client, a Chat backend -- translated both ways;
- ``chat -> anthropic``: a Chat client, an Anthropic backend -- translated both ways;
- ``chat -> openai``: the gateway's own path, for scale.

Each request is streamed and read to its end. The paths alternate request by request
within each round (drift on a shared machine hits them alike); the figure is the
process CPU time (``time.process_time``: the gateway and the in-process client, whose
share grows with the events a reply has) per request, the best round's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.asgi_client import Client
from tests.conftest import config_text
from tests.sim_gateway import running
from tests.sim_process import run_sim

from aiserve_trio.config import parse_config
from aiserve_trio.runtime.asgi import App

SIM_ARGS = [
    *("--prefill-overhead-ms", "0", "--prefill-per-token-ms", "0", "--ttft-std-ms", "0"),
    *("--itl-ms", "0", "--itl-std-ms", "0", "--output-tokens-mean", "64"),
    *("--output-tokens-std", "0", "--seed", "1"),
]

ADAPTERS = """
[adapters.claude]
kind = "anthropic"
base_url = "http://{sim}"
models = ["m"]
api_key_env = "BENCH_KEY"
max_retries = 0

[adapters.gpt]
kind = "openai"
base_url = "http://{sim}/v1"
models = ["m"]
max_retries = 0
"""
#: Path name -> (route kind, adapter, the client's body).
MESSAGES: dict[str, Any] = {
    "model": "m",
    "max_tokens": 256,
    "stream": True,
    "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
    "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
}
CHAT: dict[str, Any] = {
    "model": "m",
    "max_tokens": 256,
    "stream": True,
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
}
PATHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "messages -> anthropic (native)": ("messages", "claude", MESSAGES),
    "messages -> anthropic (translated: native = false)": (
        "messages",
        "claude",
        {**MESSAGES, "system": "Be brief."},
    ),
    "messages -> openai (translated)": ("messages", "gpt", {**MESSAGES, "system": "Be brief."}),
    "chat -> anthropic (translated)": ("chat", "claude", CHAT),
    "chat -> openai": ("chat", "gpt", CHAT),
}


def _url(i: int) -> str:
    return f"/bench{i}/v1/{'messages' if list(PATHS.values())[i][0] == 'messages' else 'chat/completions'}"


def gateway(sim: str) -> App:
    extra = ADAPTERS.format(sim=sim)
    for i, (kind, adapter, _) in enumerate(PATHS.values()):
        extra += f'\n[[routes]]\npath = "{_url(i)}"\nname = "bench{i}"\nkind = "{kind}"\nadapter = "{adapter}"\n'
        if i == 1:
            extra += "native = false\n"
    return App(parse_config(config_text() + extra, source="<bench>"))


async def one(client: Client, i: int) -> None:
    body = list(PATHS.values())[i][2]
    r = await client.request("POST", _url(i), json_body=body)
    if r.status != 200 or not r.body:
        raise RuntimeError(f"{_url(i)}: {r.status} {r.body[:300]!r}")


async def measure(sim: str, n: int, rounds: int) -> dict[str, float]:
    app = gateway(sim)
    best: dict[str, float] = {}
    async with running(app) as client:
        for i in range(len(PATHS)):  # warm: connections, code paths
            for _ in range(20):
                await one(client, i)
        for _ in range(rounds):
            spent = [0.0] * len(PATHS)
            for _ in range(n):
                for i in range(len(PATHS)):
                    t0 = time.process_time()
                    await one(client, i)
                    spent[i] += time.process_time() - t0
            for i, name in enumerate(PATHS):
                per = spent[i] / n * 1e6
                best[name] = min(best.get(name, per), per)
    return best


def report(best: dict[str, float], n: int, rounds: int, argv: list[str]) -> str:
    native = best["messages -> anthropic (native)"]
    lines = [
        f"# Gateway CPU per streamed request, 64-token replies ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"`python -m bench.native_cpu {' '.join(argv)}`: {n} requests per path per round, "
        f"{rounds} rounds, best round; load average at the end {os.getloadavg()[0]:.2f}.",
        "",
        "| path | CPU µs / request | native minus this |",
        "|---|---|---|",
    ]
    for name, us in best.items():
        diff = "" if us is native else f"{native - us:+.0f}"
        lines.append(f"| {name} | {us:.0f} | {diff} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=400, help="per path per round (400)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="write the table here too")
    ns = p.parse_args()
    os.environ.setdefault("BENCH_KEY", "bench")
    with run_sim(SIM_ARGS) as sim:
        best = trio.run(measure, sim, ns.requests, ns.rounds)
    text = report(best, ns.requests, ns.rounds, sys.argv[1:])
    print(text)
    if ns.out is not None:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(text)


if __name__ == "__main__":
    main()
