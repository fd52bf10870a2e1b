"""The tail under overload, side by side in one run: p50, p99, p99.9 and max at
c = 1, 16, 64, 256 and 1,024, streamed and non-streamed, for the direct upstream, nginx
relaying it (``proxy_buffering off``), the gateway (one worker) with shedding off and on,
and Portkey and LiteLLM (one worker each) where they are installed.

    .venv/bin/python -m bench.tail                        # ~12 min: 6 s points, 20 s at c >= 256
    .venv/bin/python -m bench.tail --rounds 2 --duration 4 --concs 256,1024
    .venv/bin/python -m bench.tail --before 1bd15f0       # the gateway before the accept fix too

The upstream is ``bench/node/upstream.js`` (zero delay, 16 deltas) with wrk on the load
CPU; each system under test (nginx's one worker, the gateway's one worker) on the other.
``portkey`` and ``litellm`` are ``bench/throughput.py``'s (installed as ``bench/README.md``
says, in ``bench/work``); one that is not installed is left out with the reason printed,
and the run goes on without it. Both run on their own defaults.
Points are interleaved -- at each (mode, c), every system in turn -- so the systems see
the same moment of a shared machine; compare within a round, as ratios.
wrk runs with ``--timeout 30s``: a late answer is a latency, not a socket error.

``aiserve`` and ``aiserve-before`` run on the defaults (a 30 s deadline, shedding off);
``aiserve-shed`` adds ``[deadline] queue_share`` and ``ttft_ms`` (``--shed``) and its
requests carry ``X-Request-Timeout-Ms`` (``--timeout-ms``, 2,000 by default: the client
timeout the issue's 1.5 % loss was counted at). Its 503s are the non-2xx column, and its
percentiles are of every answer, 503s included.

Writes ``bench/results/<date>/tail.md`` and ``tail.json``; ``--rev`` (default HEAD)
is the gateway's source: a snapshot of that revision's ``src/``, so a work tree in the
middle of others' edits does not matter. ``--before REV`` adds that revision's gateway
as ``aiserve-before``, for a before/after table from one run; ``aiserve-before-shed`` in
``--systems`` is that gateway with ``aiserve-shed``'s shedding and timeout:

    .venv/bin/python -m bench.tail --before 3fbbeaf --systems aiserve-before-shed,aiserve-shed
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import systems
from .ab import _JSON, node_upstream, wrk_start
from .systems import LOAD_CPU, ROOT, SYSTEM_CPU, WORK, Running, free_port
from .throughput import System, aiserve, litellm, portkey

CONCS = (1, 16, 64, 256, 1024)
ALL = ("direct", "nginx", "portkey", "litellm", "aiserve", "aiserve-shed")
#: The peers a run leaves out, with the reason printed, when they are not installed.
PEERS = {"portkey": portkey, "litellm": litellm}
#: Why Portkey's streamed points fail on this machine (its log, bench/work/logs/portkey.log).
PORTKEY_STREAMS = (
    " Portkey 1.15.2 on Node 20 answers every stream 500 (`Something went wrong`; its log:"
    " `TypeError: immutable` appending a header to the upstream's fetch response), as in"
    " bench.throughput's streamed points."
)

NGINX_CONF = """worker_processes 1;
worker_rlimit_nofile 16384;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 8192; multi_accept on; }}
http {{
  access_log off;
  client_body_temp_path {dir}/body;
  proxy_temp_path {dir}/proxy;
  fastcgi_temp_path {dir}/fastcgi;
  uwsgi_temp_path {dir}/uwsgi;
  scgi_temp_path {dir}/scgi;
  upstream up {{ server 127.0.0.1:{up}; keepalive 2048; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    keepalive_requests 1000000;
    location / {{
      proxy_pass http://up;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_read_timeout 60s;
    }}
  }}
}}
"""


@contextlib.contextmanager
def nginx(upstream: Running) -> Iterator[System]:
    """nginx from Debian, one worker on the systems' CPU, relaying ``upstream`` unbuffered."""
    exe = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(exe).exists():
        raise RuntimeError("nginx is not installed (apt-get install -y nginx)")
    d = WORK / "nginx-tail"
    d.mkdir(parents=True, exist_ok=True)
    port = free_port()
    up = int(upstream.base.rsplit(":", 1)[1])
    conf = d / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=d, up=up, port=port))
    cmd = [exe, "-p", str(d), "-c", str(conf)]
    with systems.start("nginx", cmd, port=port, health="/v1/models", cpu=SYSTEM_CPU,
                       ours=False) as r:
        yield System("nginx", r.base + "/v1/chat/completions", running=r)


def point(s: System, c: int, seconds: float, stream: bool) -> dict[str, Any]:
    """One wrk point against ``s``: req/s, p50/p99/p99.9/max (ms), errors, non-2xx."""
    proc = wrk_start(s.url, c, seconds, stream=stream, key=s.key, headers=s.headers,
                     cpu=LOAD_CPU, threads=1 if c < 4 else 2, timeout_s=30)
    out, _ = proc.communicate()
    m = _JSON.search(out or "")
    if proc.returncode or m is None:
        raise RuntimeError(f"wrk failed ({proc.returncode}):\n{out}")
    raw = json.loads(m.group(1))
    return {
        "rps": raw["requests"] / (raw["duration_us"] / 1e6),
        "p50_ms": raw["p50_us"] / 1000,
        "p99_ms": raw["p99_us"] / 1000,
        "p999_ms": raw["p999_us"] / 1000,
        "max_ms": raw["max_us"] / 1000,
        "errors": raw["errors"],
        "non2xx": raw["non2xx"],
        "requests": raw["requests"],
    }


def loadavg() -> float:
    return os.getloadavg()[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tail", description=__doc__.split("\n")[0])
    ap.add_argument("--rev", default="HEAD", help="the gateway's revision (default HEAD)")
    ap.add_argument("--systems", default=",".join(ALL))
    ap.add_argument("--concs", default=",".join(map(str, CONCS)))
    ap.add_argument("--modes", default="json,stream")
    ap.add_argument("--duration", type=float, default=6.0, help="seconds a point")
    ap.add_argument("--high-duration", type=float, default=20.0,
                    help="seconds a point at c >= 256 (its first wave of connections "
                    "takes seconds: a short point measures mostly that)")
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds of warm-up a point")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout-ms", type=int, default=2000,
                    help="X-Request-Timeout-Ms on each aiserve-shed request")
    ap.add_argument("--shed", default="queue_share = 0.25\nttft_ms = 1000",
                    help="[deadline] lines of aiserve-shed")
    ap.add_argument("--before", default=None,
                    help="also measure this revision's gateway (aiserve-before), shedding off")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    names = [n for n in args.systems.split(",") if n]
    if "aiserve-before-shed" in names and not args.before:
        raise SystemExit("aiserve-before-shed needs --before REV")
    if args.before and not {"aiserve-before", "aiserve-before-shed"} & set(names):
        names.insert(names.index("aiserve") if "aiserve" in names else len(names), "aiserve-before")
    concs = [int(c) for c in args.concs.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    out_dir = Path(args.out) if args.out else ROOT / "bench" / "results" / str(datetime.date.today())
    out_dir.mkdir(parents=True, exist_ok=True)
    src, sha = systems.snapshot(args.rev)
    systems.SNAPSHOT = src
    hdr = f"X-Request-Timeout-Ms: {args.timeout_ms}"
    results: dict[str, Any] = {"rev": sha, "argv": argv, "load": [("start", loadavg())],
                               "points": []}
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        up = stack.enter_context(node_upstream(deltas=16))
        targets: list[System] = []
        for n in names:
            if n == "direct":
                targets.append(System("direct", up.base + "/v1/chat/completions"))
            elif n == "nginx":
                targets.append(stack.enter_context(nginx(up)))
            elif n in ("aiserve-before", "aiserve-before-shed"):
                before, before_sha = systems.snapshot(args.before)
                results["before"] = before_sha
                systems.SNAPSHOT = before
                shed = n == "aiserve-before-shed"
                extra = f"\n[deadline]\n{args.shed}\n" if shed else ""
                s = stack.enter_context(aiserve(up, name=n, extra=extra))
                systems.SNAPSHOT = src
                if shed:
                    s.headers = hdr
                targets.append(s)
            elif n == "aiserve":
                s = stack.enter_context(aiserve(up, name="aiserve"))
                targets.append(s)
            elif n in PEERS:
                try:
                    targets.append(stack.enter_context(PEERS[n](up)))
                except RuntimeError as err:  # not installed: say so, go on without it
                    print(f"{n}: skipped: {err}", flush=True)
                    results.setdefault("skipped", {})[n] = str(err)
            elif n == "aiserve-shed":
                extra = f"\n[deadline]\n{args.shed}\n"
                s = stack.enter_context(aiserve(up, name="aiserve-shed", extra=extra))
                s.headers = hdr
                targets.append(s)
            else:
                raise SystemExit(f"unknown system {n!r}")
        for rnd in range(args.rounds):
            for mode in modes:
                for c in concs:
                    for s in targets:
                        stream = mode == "stream"
                        if args.warmup:
                            point(s, c, args.warmup, stream)
                        seconds = args.high_duration if c >= 256 else args.duration
                        p = point(s, c, seconds, stream)
                        p.update(system=s.name, c=c, mode=mode, round=rnd)
                        results["points"].append(p)
                        print(f"[{time.monotonic() - t0:5.0f} s] r{rnd} {mode:6} c={c:<5} "
                              f"{s.name:13} {p['rps']:7.0f} req/s  p50 {p['p50_ms']:8.1f}  "
                              f"p99 {p['p99_ms']:8.1f}  p99.9 {p['p999_ms']:8.1f}  "
                              f"max {p['max_ms']:8.1f} ms  err {p['errors']} non2xx "
                              f"{p['non2xx']}", flush=True)
    results["load"].append(("end", loadavg()))
    (out_dir / "tail.json").write_text(json.dumps(results, indent=1))
    (out_dir / "tail.md").write_text(render(results, args))
    print(f"wrote {out_dir / 'tail.md'}")
    return 0


def render(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"# The tail under overload (`python -m bench.tail`), gateway at {results['rev']}",
        "",
        f"load average: {results['load'][0][1]:.2f} at the start, {results['load'][-1][1]:.2f} at "
        "the end (a shared 2-core machine: other engineers' tests ran meanwhile). "
        f"{args.duration:g} s a point ({args.high_duration:g} s at c >= 256) after "
        f"{args.warmup:g} s of warm-up; systems interleaved "
        f"at each point; aiserve-shed: `[deadline] {' '.join(args.shed.split())}`, its "
        f"requests with `X-Request-Timeout-Ms: {args.timeout_ms}`; the others on the defaults."
        + (f" aiserve-before: the gateway at {results['before']}." if "before" in results else "")
        + "".join(f" {n}: skipped ({why})." for n, why in results.get("skipped", {}).items()),
        "",
        "| round | mode | c | system | req/s | p50 ms | p99 ms | p99.9 ms | max ms | p99/p50 "
        "| p99.9/p50 | errors | non-2xx |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    failed = []
    for p in results["points"]:
        if p["requests"] and p["non2xx"] + p["errors"] >= p["requests"]:
            failed.append(f"{p['system']} {p['mode']} c={p['c']}")
        r99 = p["p99_ms"] / p["p50_ms"] if p["p50_ms"] else 0.0
        r999 = p["p999_ms"] / p["p50_ms"] if p["p50_ms"] else 0.0
        lines.append(
            f"| {p['round']} | {p['mode']} | {p['c']} | {p['system']} | {p['rps']:.0f} | "
            f"{p['p50_ms']:.1f} | {p['p99_ms']:.1f} | {p['p999_ms']:.1f} | {p['max_ms']:.1f} | "
            f"{r99:.1f} | {r999:.1f} | {p['errors']} | {p['non2xx']} |"
        )
    if failed:
        lines += ["", "Every answer an error (its latencies are of the errors, not of "
                  f"answers): {', '.join(failed)}." + PORTKEY_STREAMS * any(
                      f.startswith("portkey stream") for f in failed)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
