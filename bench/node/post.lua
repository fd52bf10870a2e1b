-- wrk: POST a chat completion. BENCH_STREAM=1 asks for a stream; BENCH_KEY adds a bearer key;
-- BENCH_EXTRA is more body fields, each followed by a comma ('"temperature":0,');
-- BENCH_CACHE_CONTROL is sent as Cache-Control; BENCH_HEADERS adds headers.
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local key = os.getenv("BENCH_KEY")
if key and key ~= "" then wrk.headers["Authorization"] = "Bearer " .. key end
-- BENCH_HEADERS: more headers, "Name: value" separated by "|".
for pair in string.gmatch(os.getenv("BENCH_HEADERS") or "", "[^|]+") do
  local name, value = string.match(pair, "^%s*([^:]+):%s*(.-)%s*$")
  if name then wrk.headers[name] = value end
end
local control = os.getenv("BENCH_CACHE_CONTROL")
if control and control ~= "" then wrk.headers["Cache-Control"] = control end
local stream = os.getenv("BENCH_STREAM") == "1"
wrk.body = '{"model":"sim-model",' .. (os.getenv("BENCH_EXTRA") or "") .. '"stream":'
  .. (stream and "true" or "false")
  .. ',"messages":[{"role":"user","content":"hello there, how are you?"}]}'

done = function(summary, latency, requests)
  io.write(string.format("JSON {\"requests\":%d,\"duration_us\":%d,\"errors\":%d,\"non2xx\":%d,\"p50_us\":%d,\"p90_us\":%d,\"p99_us\":%d,\"p999_us\":%d,\"max_us\":%d}\n",
    summary.requests, summary.duration,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    summary.errors.status,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), latency.max))
end
