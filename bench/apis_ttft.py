"""Added time to first token of the Responses and Messages codecs: a streamed
``/v1/responses`` and ``/v1/messages`` call against ``/v1/chat/completions``, at c = 1.

Starts ``aiserve-sim`` (zero-delay timing) and the gateway under hypercorn's Trio worker
with ``configs/examples/sim-openai.toml`` (its ``base_url`` pointed at the sim) plus a
``responses`` and a ``messages`` route on the same adapter. Then, in ``--rounds`` rounds
(so that drift on the machine hits every path alike), it runs ``--requests`` streamed
requests on one keep-alive connection to each path in turn (bench/loadgen.py), and
writes the TTFT p50 / p99 per path and each API's difference from chat, with the
command line, to ``bench/results/apis_ttft.md``.

    python -m bench.apis_ttft                          # 3 rounds of 400 requests per path
    python -m bench.apis_ttft --rounds 1 --requests 50 # a short run: proves it works

Loopback only; bounded by ``--rounds`` x ``--requests`` per path (plus a warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

from . import systems
from .added_latency import SIM_ARGS, _ms, gateway_config, run_point
from .loadgen import Sample, Target, chat_body
from .systems import LOAD_CPU, ROOT, SYSTEM_CPU, free_port, hypercorn_cmd, sim, start

RESULT = ROOT / "bench" / "results" / "apis_ttft.md"
ROUTES = """
[[routes]]
path = "/v1/responses"
name = "responses"
kind = "responses"
adapter = "sim"

[[routes]]
path = "/v1/messages"
name = "messages"
kind = "messages"
adapter = "sim"
"""


def targets(base: str, tokens: int) -> dict[str, Target]:
    """The three streamed calls, each asking the same of the same upstream."""
    responses = {"model": "sim-model", "stream": True, "input": "hi", "max_output_tokens": tokens}
    messages = {
        "model": "sim-model",
        "stream": True,
        "max_tokens": tokens,
        "messages": [{"role": "user", "content": "hi"}],
    }
    return {
        "chat": Target.from_url(f"{base}/v1/chat/completions", chat_body(max_tokens=tokens)),
        "responses": Target.from_url(
            f"{base}/v1/responses",
            json.dumps(responses).encode(),
            text=re.compile(rb"event: response\.output_text\.delta"),
            failed=b"event: response.failed",
        ),
        "messages": Target.from_url(
            f"{base}/v1/messages",
            json.dumps(messages).encode(),
            text=re.compile(rb'"type":"text_delta"'),
            failed=b"event: error",
        ),
    }


async def measure(base: str, rounds: int, requests: int, tokens: int) -> dict[str, list[Sample]]:
    out: dict[str, list[Sample]] = {}
    for r in range(rounds):
        for name, target in targets(base, tokens).items():
            samples, span = await run_point(target, 1, requests)
            out.setdefault(name, []).extend(samples)
            print(f"  round {r + 1} {name:<9} {len(samples)} requests in {span:.2f} s", file=sys.stderr)
    return out


def table(results: dict[str, list[Sample]]) -> str:
    rows = [
        "| path | requests | errors | TTFT p50 ms | TTFT p99 ms | added p50 ms | added p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    ttfts = {
        name: [s.ttft for s in samples if s.error is None and s.ttft is not None]
        for name, samples in results.items()
    }
    chat = ttfts["chat"]
    for name, samples in results.items():
        t = ttfts[name]
        added = "" if name == "chat" else f"**{_ms(t, 50) - _ms(chat, 50):.3f}**"
        added99 = "" if name == "chat" else f"**{_ms(t, 99) - _ms(chat, 99):.3f}**"
        rows.append(
            f"| {name} | {len(samples)} | {len(samples) - len(t)} | "
            f"{_ms(t, 50):.3f} | {_ms(t, 99):.3f} | {added} | {added99} |"
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.apis_ttft", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=400, help="measured requests per path and round")
    p.add_argument("--tokens", type=int, default=16, help="tokens per reply")
    p.add_argument("--out", type=Path, default=RESULT)
    p.add_argument(
        "--snapshot",
        default="HEAD",
        help="git revision whose src/ the sim and gateway run; 'none': the installed package",
    )
    ns = p.parse_args(argv)
    sha = "work tree"
    if ns.snapshot != "none":
        systems.SNAPSHOT, sha = systems.snapshot(ns.snapshot)
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {int(LOAD_CPU)})  # the client shares the sim's CPU
    command = ("python -m bench.apis_ttft " + shlex.join(sys.argv[1:] if argv is None else argv)).rstrip()
    with sim(SIM_ARGS, name="apis-ttft-sim") as upstream:
        cfg = gateway_config(upstream.base)
        cfg.write_text(cfg.read_text() + ROUTES)
        port = free_port()
        with start(
            "apis-ttft-gateway",
            hypercorn_cmd(port, "aiserve_trio:app"),
            port=port,
            cpu=SYSTEM_CPU,
            env={"AISERVE_CONFIG": str(cfg)},
        ) as gw:
            results = trio.run(measure, gw.base, ns.rounds, ns.requests, ns.tokens)
    text = (
        "# Added time to first token of the Responses and Messages APIs (c = 1)\n\n"
        f"Command: `{command}`\n\n"
        f"Machine: {platform.machine()}, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}; code at {sha}; aiserve-sim with zero-delay timing, "
        f"{ns.tokens} tokens per streamed reply; gateway = hypercorn (1 Trio worker) with "
        "configs/examples/sim-openai.toml and a responses and a messages route on the same "
        "adapter; client = bench/loadgen.py, one keep-alive connection, closed loop, the paths "
        f"in turn for {ns.rounds} round(s). TTFT: to the first body chunk with text (chat: a "
        "`content` delta; responses: `response.output_text.delta`; messages: a `text_delta`). "
        "Added: the API's TTFT minus chat's.\n\n" + table(results) + "\n"
    )
    print(text)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
