"""Ten thousand held streams on one gateway worker, in one command: memory per stream,
a new stream's time to first token while they are held, and a connect storm.

    .venv/bin/python -m bench.held_streams                      # 10,000 streams, h2c upstream
    .venv/bin/python -m bench.held_streams --streams 9000 --http1
    .venv/bin/python -m bench.held_streams --streams 2000 --itl-ms 12000   # a quick look

1. ``aiserve-sim`` on the load CPU (first token at once, then one every ``--itl-ms``,
   1 s by default: a slow upstream) and the gateway (one worker, the revision ``--rev``,
   HEAD by default) on the other, with the defaults a deployment holding that many
   streams would use (``systems.HELD_STREAMS_TOML``: ``[limits] max_inflight`` and
   ``max_streams`` past the count, a deadline past the run). The gateway speaks h2c to
   the sim: over HTTP/1.1 each held stream is two descriptors, and this sandbox's hard
   limit is 20,000 (``--http1`` measures up to ~9,000).
2. ``--streams`` streams opened at ``--ramp`` a second (``bench.loadgen --hold``) and
   held until the sim has them all open; then the RSS of the gateway's process tree
   (hypercorn's parent and its worker) and of the worker alone, against the same before
   the streams: KB per held stream.
3. While they are held: new streams one after another for ``--probe-s`` seconds
   (``max_tokens = 1``), their time to first token (p50, p99).
4. The held streams end (the sim's reply runs out); then a connect storm: ``--streams``
   short streams (``max_tokens = 2``) opened at once, each on its own connection; every
   one must be answered, none refused or failed.

Writes ``bench/results/<date>/held-streams.md`` and ``.json``. RSS is robust to a shared
machine; TTFT is not (the load average is in the report).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import resource
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from . import systems
from .systems import LOAD_CPU, ROOT, pinned


def loadgen(url: str, key: str | None, *args: str) -> list[str]:
    cmd = [sys.executable, "-m", "bench.loadgen", "--url", url, *args]
    if key is not None:
        cmd += ["--header", f"Authorization: Bearer {key}"]
    return pinned(cmd, LOAD_CPU)


def open_streams(sim: systems.Running, last: int = 0) -> int:
    """The sim's open streams; ``last`` when it is too busy to say."""
    try:
        with urllib.request.urlopen(sim.base + "/sim/stats", timeout=10) as r:
            return int(json.loads(r.read())["open_streams"])
    except OSError:
        if sim.proc.poll() is not None:
            raise RuntimeError(f"the simulator exited ({sim.proc.returncode})") from None
        return last


def run_json(cmd: list[str], timeout: float) -> dict[str, Any]:
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         check=False)
    if out.returncode:
        raise RuntimeError(f"{cmd}: exit {out.returncode}\n{out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.held_streams",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=10_000)
    ap.add_argument("--ramp", type=float, default=500.0, help="new streams a second")
    ap.add_argument("--itl-ms", type=int, default=1000, help="the sim's time between tokens")
    ap.add_argument("--probe-s", type=float, default=10.0,
                    help="seconds of new streams, one after another, timed while held")
    ap.add_argument("--http1", action="store_true", help="HTTP/1.1 to the sim, not h2c")
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--extra", default="", help="more gateway TOML (whole tables)")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    n = ns.streams
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # children inherit it
    src, sha = systems.snapshot(ns.rev)
    systems.SNAPSHOT = src
    out_dir = Path(ns.out) if ns.out else ROOT / "bench" / "results" / str(datetime.date.today())
    out_dir.mkdir(parents=True, exist_ok=True)
    ramp_s = n / ns.ramp
    # Long enough a reply to outlast the ramp, the settling and the probes.
    hold_s = ramp_s + 60
    tokens = 1 + int(hold_s * 1000 / ns.itl_ms)
    res: dict[str, Any] = {"rev": sha, "streams": n, "itl_ms": ns.itl_ms, "ramp": ns.ramp,
                           "upstream": "HTTP/1.1" if ns.http1 else "h2c",
                           "nofile": {"soft": soft, "hard": hard},
                           "load": [("start", os.getloadavg()[0])]}
    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:5.0f} s] {msg}", flush=True)

    with systems.sim(systems.held_sim_args(ns.itl_ms, tokens), "sim-held") as sim:
        auth = systems.gateway_auth()
        key = auth.plain if auth is not None else None
        cfg = systems.WORK / "held-streams.toml"
        cfg.write_text(systems.gateway_toml(
            {"/v1/chat/completions": sim.base}, auth=auth,
            extra=systems.HELD_STREAMS_TOML + ns.extra, http2=not ns.http1))
        port = systems.free_port()
        env = {"AISERVE_CONFIG": str(cfg.relative_to(ROOT))}
        with systems.start("gateway-held", systems.hypercorn_cmd(port, "aiserve_trio:app"),
                           port=port, cpu=systems.SYSTEM_CPU, env=env) as gw:
            url = gw.base + "/v1/chat/completions"
            run_json(loadgen(url, key, "--concurrency", "4", "--duration", "2",
                             "--max-tokens", "2"), 60)  # what loads lazily, loaded
            time.sleep(2)
            idle_tree, idle_worker = gw.rss_mb(), gw.worker_rss_mb()
            say(f"idle: tree {idle_tree:.1f} MB, worker {idle_worker:.1f} MB")
            hold = subprocess.Popen(
                loadgen(url, key, "--hold", str(n), "--ramp", str(ns.ramp),
                        "--duration", str(hold_s + 60)),
                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            opened = 0
            end = time.monotonic() + ramp_s * 3 + 60
            try:
                while time.monotonic() < end and opened < n:
                    time.sleep(1)
                    opened = open_streams(sim, opened)
                    say(f"{opened} upstream streams open")
                time.sleep(3)
                held_tree, held_worker = gw.rss_mb(), gw.worker_rss_mb()
                opened = open_streams(sim, opened)
            except BaseException:
                hold.kill()
                raise
            say(f"held {opened} upstream streams: tree {held_tree:.1f} MB, "
                f"worker {held_worker:.1f} MB")
            res["memory"] = {
                "idle_tree_mb": idle_tree, "idle_worker_mb": idle_worker,
                "held_tree_mb": held_tree, "held_worker_mb": held_worker,
                "upstream_streams": opened,
                # Over the streams open upstream at the time: on a busy machine the
                # first may have ended before the last opened.
                "kb_per_stream_tree": (held_tree - idle_tree) * 1024 / max(opened, 1),
                "kb_per_stream_worker": (held_worker - idle_worker) * 1024 / max(opened, 1),
            }
            probe = run_json(loadgen(url, key, "--concurrency", "1", "--duration",
                                     str(ns.probe_s), "--max-tokens", "1"), ns.probe_s + 120)
            res["probe"] = {k: probe[k] for k in ("requests", "ok", "errors", "ttft_ms")}
            say(f"new streams while held: {probe['ok']} ok, errors {probe['errors']}, "
                f"TTFT {probe['ttft_ms']}")
            held_out, _ = hold.communicate(timeout=hold_s + 180)
            held = json.loads(held_out.strip().splitlines()[-1])
            res["held"] = {k: held[k] for k in ("requests", "ok", "errors", "ttft_ms", "gap_ms")}
            say(f"held streams: {held['ok']} of {held['requests']} ok, errors {held['errors']}")
            storm = run_json(loadgen(url, key, "--hold", str(n), "--ramp", "1000000",
                                     "--duration", "120", "--max-tokens", "2"), 300)
            res["storm"] = {k: storm[k] for k in ("requests", "ok", "errors", "ttft_ms",
                                                  "total_ms", "span_s")}
            say(f"connect storm: {storm['ok']} of {storm['requests']} ok, errors "
                f"{storm['errors']}, TTFT {storm['ttft_ms']}")
    res["load"].append(("end", os.getloadavg()[0]))
    name = f"held-streams-{n}-{'h1' if ns.http1 else 'h2c'}"
    (out_dir / f"{name}.json").write_text(json.dumps(res, indent=1))
    (out_dir / f"{name}.md").write_text(render(res))
    print(render(res))
    return 0


def render(r: dict[str, Any]) -> str:
    m, p, h, s = r["memory"], r["probe"], r["held"], r["storm"]
    return "\n".join([
        f"# {r['streams']:,} held streams, one worker (`python -m bench.held_streams`), "
        f"gateway at {r['rev']}",
        "",
        f"Upstream: aiserve-sim over {r['upstream']}, first token at once, then one every "
        f"{r['itl_ms']} ms; streams opened at {r['ramp']:g}/s. Open files: soft "
        f"{r['nofile']['soft']}, hard {r['nofile']['hard']}. Load average "
        f"{r['load'][0][1]:.2f} at the start, {r['load'][-1][1]:.2f} at the end (a shared "
        "2-core machine).",
        "",
        "| what | value |",
        "|---|---|",
        f"| upstream streams open at once | {m['upstream_streams']:,} |",
        f"| RSS, process tree: idle -> held | {m['idle_tree_mb']:.1f} -> {m['held_tree_mb']:.1f} MB |",
        f"| **KB per held stream (tree)** | **{m['kb_per_stream_tree']:.1f}** |",
        f"| RSS, worker: idle -> held | {m['idle_worker_mb']:.1f} -> {m['held_worker_mb']:.1f} MB |",
        f"| KB per held stream (worker) | {m['kb_per_stream_worker']:.1f} |",
        f"| held streams ok / errors | {h['ok']:,} / {sum(h['errors'].values())} {h['errors'] or ''} |",
        f"| held streams' TTFT p50 / p99 (ms) | {num(h['ttft_ms']['p50'])} / {num(h['ttft_ms']['p99'])} |",
        f"| new stream's TTFT while held, p50 / p99 (ms, {p['ok']} streams) | "
        f"{num(p['ttft_ms']['p50'])} / {num(p['ttft_ms']['p99'])} |",
        f"| connect storm: {s['requests']:,} at once, ok / errors | {s['ok']:,} / "
        f"{sum(s['errors'].values())} {s['errors'] or ''} |",
        f"| connect storm TTFT p50 / p99 (ms), span (s) | {num(s['ttft_ms']['p50'])} / "
        f"{num(s['ttft_ms']['p99'])}, {s['span_s']:.1f} |",
        "",
    ])


def num(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


if __name__ == "__main__":
    raise SystemExit(main())
