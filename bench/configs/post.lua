-- wrk: POST the short streamed chat request
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = io.open(os.getenv("BODY") or "bench/configs/short-stream.json", "r")
wrk.body = f:read("*a")
f:close()
