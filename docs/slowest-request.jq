# The slowest request of a /debug/trace answer, stage by stage:
#   jq -f docs/slowest-request.jq trace.json
# running_ms:  the stage's task steps (its own code, on the CPU)
# runnable_ms: scheduled but waiting for the run loop (the worker was busy elsewhere)
# waiting_io_ms / waiting_other_ms: blocked until woken by socket readiness (the
#   run loop's I/O wait) / by a timer or another task (a channel, a lock, a sleep)
# "request" is the request's own task and its body watcher, outside the stages.
def ms: . / 1000 | . * 100 | round / 100;
def order: . as $s | ["request", "parse", "context", "inference", "sse"] | index($s);
[.traceEvents[] | select(.ph == "X" and .args.request_id)]
| group_by(.args.request_id)
| max_by((map(.ts + .dur) | max) - (map(.ts) | min))
| {request_id: .[0].args.request_id,
   seen_ms: ((map(.ts + .dur) | max) - (map(.ts) | min) | ms),
   stages: (group_by(.args.stage // "request")
     | map({stage: (.[0].args.stage // "request"),
            steps: length,
            running_ms: (map(.dur) | add | ms),
            runnable_ms: (map(.args.runnable_us // 0) | add | ms),
            waiting_io_ms: (map(select(.args.woken_by == "io") | .args.blocked_us // 0) | add // 0 | ms),
            waiting_other_ms: (map(select(.args.woken_by != "io") | .args.blocked_us // 0) | add // 0 | ms)})
     | sort_by(.stage | order))}
