"""Replay the sample recording against the gateway in front of aiserve-sim, per label.

Starts ``aiserve-sim`` (a latency model where a longer prompt costs prefill time
and the reply is exactly ``max_tokens`` long) and the gateway under hypercorn
(``bench/systems.py``: one Trio worker, auth on with one key), then runs
``aiserve-replay``:

0. ``direct``: the recording straight to the sim, the floor per class;
1. ``baseline``: through the gateway, at the recording's own timing, unweighted;
2. ``again``: the same, compared with (1) -- run-to-run noise, what a
   ``--max-regression`` for this setup has to allow;
3. ``weighted``: the design's weights (``intent=sql:3.2,complexity=high:2.8,has_tools:4.0``)
   at the same arrival times: the mix moves to the expensive classes.
4. ``sessions``: (1) with ``--sessions``: the recorded session ids sent, so the gateway
   puts each conversation's history in front of its next request (last, so that no
   earlier run left history behind).

Writes ``bench/results/<date>/replay.md`` (the commands, each report's table, the
comparison) and the three JSON reports next to it.

    PYTHONPATH=src .venv/bin/python -m bench.replay
    PYTHONPATH=src .venv/bin/python -m bench.replay --speed 2 --recording bench/recordings/sample.jsonl
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from . import systems
from .systems import LOAD_CPU, RECORDER, ROOT, pinned

RECORDING = ROOT / "bench" / "recordings" / "sample.jsonl"
WEIGHTS = "intent=sql:3.2,complexity=high:2.8,has_tools:4.0"
#: Prefill 20 ms + 0.2 ms per prompt token, 25 ms per output token (40 tokens/s, a
#: served model's pace), some jitter.
SIM_ARGS = [
    "--prefill-overhead-ms", "20", "--prefill-per-token-ms", "0.2", "--ttft-std-ms", "3",
    "--itl-ms", "25", "--itl-std-ms", "2",
]


def scheduler_lag(base: str, key: str | None) -> tuple[float, float]:
    """``trio_scheduler_lag_seconds`` (sum, count) of the gateway: how late its event loop
    ran tasks, which other processes on the machine make worse."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    text = urllib.request.urlopen(urllib.request.Request(base + "/metrics", headers=headers)).read()
    found = dict(re.findall(rb"^trio_scheduler_lag_seconds_(sum|count) (\S+)$", text, re.M))
    return float(found.get(b"sum", 0)), float(found.get(b"count", 0))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def replay(args: list[str], key: str | None) -> tuple[int, str]:
    """``aiserve-replay`` as a process on the load generator's CPU; its exit status and output."""
    cmd = pinned([sys.executable, "-m", "aiserve_trio.replay", *args, "--quiet"], LOAD_CPU)
    env = {**os.environ}
    if key is not None:
        env["AISERVE_API_KEY"] = key
    shown = [c if not c.startswith(str(ROOT)) else os.path.relpath(c, ROOT) for c in cmd]
    RECORDER.add({"AISERVE_API_KEY": "<the bench key>"} if key else {}, shown)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if out.returncode not in (0, 1):
        raise RuntimeError(f"aiserve-replay failed ({out.returncode}):\n{out.stderr}")
    return out.returncode, out.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recording", type=Path, default=RECORDING)
    ap.add_argument("--speed", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()

    day = time.strftime("%Y-%m-%d")
    out_dir = ROOT / "bench" / "results" / day
    out_dir.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(args.recording, ROOT)
    auth = systems.gateway_auth()
    key = auth.plain if auth is not None else None
    sections: list[str] = []
    load_start = os.getloadavg()
    sha = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    with systems.sim(SIM_ARGS) as sim, systems.gateway(
        "aiserve-replay-bench", {"/v1/chat/completions": sim.base}, auth=auth
    ) as gw:
        common = [rel, "--target", gw.base, "--speed", f"{args.speed:g}", "--warmup", "10"]
        direct = [rel, "--target", sim.base, "--speed", f"{args.speed:g}", "--warmup", "10"]
        runs = [
            ("direct", [*direct, "--report", str(out_dir / "replay-direct")]),
            ("baseline", [*common, "--report", str(out_dir / "replay-baseline")]),
            (
                "again",
                [
                    *common, "--report", str(out_dir / "replay-again"),
                    "--compare", str(out_dir / "replay-baseline.json"),
                ],
            ),
            (
                "weighted",
                [
                    *common, "--weights", WEIGHTS, "--seed", str(args.seed),
                    "--report", str(out_dir / "replay-weighted"),
                ],
            ),
            ("sessions", [*common, "--sessions", "--report", str(out_dir / "replay-sessions")]),
        ]
        worker = gw.worker_pid()
        for name, run_args in runs:
            print(f"bench.replay: {name} ...", file=sys.stderr)
            cpu0, t0 = cpu_seconds(worker), time.monotonic()
            lag0 = scheduler_lag(gw.base, key)
            code, text = replay(run_args, None if name == "direct" else key)
            busy = (cpu_seconds(worker) - cpu0) / (time.monotonic() - t0)
            lag1 = scheduler_lag(gw.base, key)
            lag_ms = 1000 * (lag1[0] - lag0[0]) / max(lag1[1] - lag0[1], 1)
            table = text.split("| group |", 1)[1] if "| group |" in text else text
            section = [f"## {name}", ""]
            if name != "direct":
                section += [
                    f"Gateway worker CPU while it ran: {busy:.0%} of one core; mean scheduler "
                    f"lag {lag_ms:.1f} ms (`trio_scheduler_lag_seconds`, load average "
                    f"{os.getloadavg()[0]:.1f}).",
                    "",
                ]
            section.append("| group |" + table.split("\nreport:", 1)[0].rstrip())
            if "compared with" in text:
                cmp = text.split("compared with", 1)[1]
                section += ["", f"Compared with{cmp.split(chr(10), 1)[0]}", "", "```", cmp.split("\n", 1)[1].rstrip(), "```"]
                section.append(f"\nExit status of the gate: {code}.")
            sections.append("\n".join(section))
    load_end = os.getloadavg()
    body = [
        f"# Replay of `{rel}` against the gateway in front of aiserve-sim",
        "",
        f"- {time.strftime('%Y-%m-%dT%H:%M:%S')}, git {sha} (working tree), "
        f"{os.cpu_count()} cores; load average at start / end: "
        f"{', '.join(f'{x:.1f}' for x in load_start)} / {', '.join(f'{x:.1f}' for x in load_end)}",
        "",
        "Synthetic recording (`bench/make_sample_recording.py`, seed 19): 400 requests over",
        "20 s at ~20 req/s, ~1 % refused by a policy (no body, not replayed). The sim answers",
        "exactly `max_tokens` tokens, 25 ms apart (SQL 120-200, long prompts 60-120, tools 20-40,",
        "the rest 24-80) and charges 0.2 ms of prefill per prompt token, so the classes differ the way",
        "the design says they cost. TTFT and total time are measured by `aiserve-replay` from",
        "each request's scheduled start (open loop at the recorded arrival times).",
        "",
        "Commands (2-core machine; the gateway on CPU 0, the sim and the replay on CPU 1):",
        "",
        "```sh",
        "PYTHONPATH=src .venv/bin/python -m bench.replay",
        *RECORDER.commands,
        "```",
        "",
        "\n\n".join(sections),
        "",
    ]
    report = out_dir / "replay.md"
    report.write_text("\n".join(body))
    print(report)


if __name__ == "__main__":
    main()
