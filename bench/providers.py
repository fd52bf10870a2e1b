"""Added time to first token per native provider adapter, against the openai adapter, at c = 1.

    .venv/bin/python -m bench.providers [--requests 500] [--out bench/results/DATE/providers.md]

One aiserve-sim process with zero model time (no prefill, no noise, 4 tokens) speaks
every provider's API; the gateway (in process, the app driven by the tests' ASGI
client over the real upstream sockets) has one route per adapter -- ``openai``,
``anthropic``, ``azure_openai``, ``gemini``, ``bedrock`` (SigV4 signing included) --
all pointing at it. Requests go one at a time, the adapters in turn (so drift on a
shared machine hits them alike); each sample is the time from the request to the
first content event. The table gives p50 / p99 per adapter and each native adapter's
p50 minus openai's: the added TTFT (the sim's own rendering of each dialect is in it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

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
    *("--itl-ms", "0", "--itl-std-ms", "0", "--output-tokens-mean", "4"),
    *("--output-tokens-std", "0", "--seed", "1"),
]
KINDS = {
    "openai": 'kind = "openai"\nbase_url = "http://{sim}/v1"\nmodels = ["m"]',
    "anthropic": 'kind = "anthropic"\nbase_url = "http://{sim}"\nmodels = ["m"]\napi_key_env = "BENCH_KEY"',
    "azure_openai": 'kind = "azure_openai"\nbase_url = "http://{sim}"\nmodels = ["m"]\napi_key_env = "BENCH_KEY"',
    "gemini": 'kind = "gemini"\nbase_url = "http://{sim}"\nmodels = ["m"]\napi_key_env = "BENCH_KEY"',
    "bedrock": 'kind = "bedrock"\nregion = "us-east-1"\nbase_url = "http://{sim}"\nmodels = ["m"]',
}


def gateway(sim: str) -> App:
    extra = ""
    for kind, table in KINDS.items():
        extra += f"\n[adapters.{kind}]\n{table.format(sim=sim)}\nmax_retries = 0\n"
        extra += f'\n[[routes]]\npath = "/v1/{kind}"\nname = "{kind}"\nadapter = "{kind}"\n'
    return App(parse_config(config_text() + extra, source="<bench>"))


async def first_token(client: Client, kind: str) -> float:
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    t0 = trio.current_time()
    r = await client.request("POST", f"/v1/{kind}", json_body=body)
    for at, chunk in r.chunks:
        if b'"content":"' in chunk:
            return (at - t0) * 1000
    raise RuntimeError(f"{kind}: no content in the reply ({r.status}: {r.body[:200]!r})")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


async def measure(sim: str, n: int) -> dict[str, list[float]]:
    app = gateway(sim)
    samples: dict[str, list[float]] = {k: [] for k in KINDS}
    async with running(app) as client:
        for kind in KINDS:  # warm: connections, tokenizer tables, code paths
            for _ in range(5):
                await first_token(client, kind)
        for _ in range(n):
            for kind in KINDS:
                samples[kind].append(await first_token(client, kind))
    return samples


def report(samples: dict[str, list[float]], n: int) -> str:
    base = statistics.median(samples["openai"])
    lines = [
        f"# Added TTFT per native adapter at c = 1 ({n} requests each, {time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"load average at the end: {os.getloadavg()[0]:.2f}",
        "",
        "| adapter | TTFT p50 ms | TTFT p99 ms | p50 minus openai's ms |",
        "|---|---|---|---|",
    ]
    for kind, xs in samples.items():
        added = statistics.median(xs) - base
        lines.append(
            f"| {kind} | {statistics.median(xs):.3f} | {pct(xs, 99):.3f} | "
            f"{'' if kind == 'openai' else f'{added:+.3f}'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=500, help="per adapter (default 500)")
    p.add_argument("--out", type=Path, default=None, help="write the table here too")
    ns = p.parse_args()
    os.environ.setdefault("BENCH_KEY", "bench")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "AKIDBENCH")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench-secret")
    with run_sim(SIM_ARGS) as sim:
        samples = trio.run(measure, sim, ns.requests)
    text = report(samples, ns.requests)
    print(text)
    if ns.out is not None:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(text)


if __name__ == "__main__":
    main()
