#!/usr/bin/env bash
# Requests/s of a short streamed reply (10 words, zero-delay mock) on one worker,
# over HTTP/1.1 (wrk, 50 connections) and h2c (h2load, 10 connections x 10 streams),
# for the gateway and for bench/ceiling_app.py (the bare hypercorn-Trio stack
# streaming the same ten chunks with no stages). Servers on CPU 0, load on CPU 1.
#   bench/short_stream.sh [seconds]      -> bench/results/short_stream.md
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
out=bench/results/short_stream.md
body=bench/configs/short-stream.json
url=/v1/chat/completions
hc=(.venv/bin/hypercorn --config configs/hypercorn.toml --access-logfile /dev/null)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
AISERVE_CONFIG=bench/configs/zero-mock.toml taskset -c 0 "${hc[@]}" --bind 127.0.0.1:18000 aiserve_trio:app >/dev/null 2>&1 & pids+=($!)
taskset -c 0 "${hc[@]}" --bind 127.0.0.1:18001 bench.ceiling_app:app >/dev/null 2>&1 & pids+=($!)
for port in 18000 18001; do
  for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$port/healthz" && break; sleep 0.1; done
done
n=$((secs * 400))
{
  echo "# Short streamed reply, one worker"
  echo
  echo "Command: \`bench/short_stream.sh $secs\` ($(date -u +%F), $(nproc) cores, $(.venv/bin/python -V 2>&1), hypercorn $(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("hypercorn"))'))."
  echo "Reply: 10 words streamed as 10 chunks + role + finish + [DONE] (\`$body\`); servers pinned to CPU 0, load generators to CPU 1."
  echo
  echo "| system | HTTP/1.1 wrk -c50 req/s | HTTP/1.1 p99 | h2c h2load -c10 -m10 req/s |"
  echo "|---|---|---|---|"
  for sys in "aiserve-trio:18000" "ceiling (bare hypercorn-Trio, no stages):18001"; do
    name=${sys%%:*}; port=${sys##*:}
    w=$(BODY=$body taskset -c 1 wrk -t1 -c50 -d"${secs}s" --latency -s bench/configs/post.lua "http://127.0.0.1:$port$url")
    rps=$(echo "$w" | awk '/Requests\/sec/ {print $2}')
    p99=$(echo "$w" | awk '$1=="99%" {print $2}')
    h=$(taskset -c 1 h2load -n "$n" -c 10 -m 10 -d "$body" -H 'content-type: application/json' "http://127.0.0.1:$port$url" 2>&1)
    h2=$(echo "$h" | awk '/finished in/ {print $4}')
    echo "| $name | $rps | $p99 | $h2 |"
  done
} | tee "$out"
