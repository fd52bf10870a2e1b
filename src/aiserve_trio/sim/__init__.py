"""aiserve-sim: a simulated model backend for tests and load tests.

Run it with ``aiserve-sim`` (default ``127.0.0.1:8100``; ``aiserve-sim --help``).
It serves, on one port, under hypercorn's Trio worker:

HTTP (OpenAI-compatible)
    ``POST /v1/chat/completions`` -- ``stream: true`` gives ``text/event-stream``
    ``chat.completion.chunk`` events (the first carries ``role``), a finish
    chunk, a usage chunk (``choices: []``) when ``stream_options.include_usage``
    is set, then ``data: [DONE]``; otherwise one ``chat.completion`` JSON body
    with ``usage``. ``GET /v1/models``, ``GET /healthz``.

    ``POST /v1/embeddings`` -- ``input`` a string, strings, or token arrays;
    ``dimensions`` (default 8); ``encoding_format`` ``float`` or ``base64``.
    OpenAI's list of ``embedding`` objects, unit vectors seeded by a hash of
    each input; the fault headers and the budget apply as for chat.

    ``GET /sim/stats`` -- JSON counters: ``requests``, ``completed``,
    ``cancelled`` (the client went away mid-reply), ``expired`` (the request's
    budget ran out), ``open_streams``, ``ws_connections`` (handshakes),
    ``faults`` by kind, ``last_timeout_ms``, ``attempts`` per request key.
    ``POST /sim/reset`` zeroes them.

    ``GET /sim/requests`` -- the last 50 requests received (HTTP and
    WebSocket messages), newest last, each ``{"path", "transport": "http" |
    "ws", "headers": {lower-case name: value}, "body": "<exactly as
    received>"}``; ``POST /sim/reset`` clears them too.

WebSocket (the ``vllm_ws`` adapter's protocol), ``ws://HOST:PORT/v1/ws``
    A connection carries one request at a time and is reused for the next.
    All messages are JSON text frames.

    client -> sim::

        {"type": "generate", "id": "req-1", "model": "sim-model",
         "messages": [{"role": "user", "content": "hi"}],
         "max_tokens": 16,            # optional
         "timeout_ms": 5000,          # optional: the remaining budget
         "fault": "503", "fault_times": 1}   # optional, like the headers below

    sim -> client, per request::

        {"type": "token", "id": "req-1", "index": 0, "text": "the"}      # 1..n
        {"type": "done", "id": "req-1", "finish_reason": "stop",
         "usage": {"prompt_tokens": 12, "completion_tokens": 16}}
      or
        {"type": "error", "id": "req-1", "status": 429, "retry_after": 1.0,
         "message": "..."}            # the request failed; the connection stays usable

    Closing the connection mid-reply cancels the reply (the sim counts it in
    ``cancelled``). Close codes from the sim: 1008 a message that is not this
    protocol; 1011 a simulated drop mid-reply.

Timing model
    time to first token = ``prefill_overhead_ms`` + prompt tokens x
    ``prefill_per_token_ms`` (normal noise ``ttft_std_ms``); then (output
    tokens - 1) gaps of ``itl_ms`` (noise ``itl_std_ms``). Output length is the
    request's ``max_tokens`` (finish ``length``), else drawn from
    ``output_tokens_mean`` / ``output_tokens_std`` (finish ``stop``). Prompt
    tokens are counted with the real tokenizer (cl100k / o200k by model name).
    ``--seed`` makes jitter and random faults reproducible.

Fault injection
    By flag, for every request: ``--fault SPEC``; at random by rate:
    ``--rate-429``, ``--rate-5xx`` (``--status-5xx``), ``--rate-stall``,
    ``--rate-drop``, ``--rate-malformed`` (after ``--fault-after`` tokens).
    Per request (wins over flags), header ``X-Sim-Fault: SPEC`` (HTTP request,
    or the WebSocket handshake: then for every request on that connection) or
    the ``fault`` field. SPEC is one of

    - ``429`` / ``429:SECS`` -- HTTP 429 with ``Retry-After`` (default 1 s);
    - ``500`` .. ``599`` -- that status, before any token;
    - ``stall:N`` -- N tokens, then nothing: the stream stays open;
    - ``drop:N`` -- N tokens, then the connection is closed abruptly (HTTP: no
      terminating chunk; WebSocket: close code 1011);
    - ``malformed:N`` -- N tokens, then a chunk that is not JSON, then the rest;
    - ``none``.

    ``X-Sim-Fault-Times: K`` (or ``fault_times``) applies the fault only to the
    first K attempts of one request key -- the ``X-Request-Id`` header, or the
    WebSocket ``id`` -- so a retrying client succeeds on attempt K + 1.

Budget
    ``X-Request-Timeout-Ms`` (HTTP) / ``timeout_ms`` (WebSocket) bound the
    reply; when it runs out the sim stops (``expired``).
"""

from __future__ import annotations

from .app import SimApp
from .core import RequestLog, Stats
from .model import Fault, FaultRates, Plan, SimSettings, Timing, parse_fault, plan_reply
from .reply import Script, script_for
from .schema import SchemaError, instance
from .ws import WS_PATH

__all__ = [
    "WS_PATH",
    "Fault",
    "FaultRates",
    "Plan",
    "RequestLog",
    "SchemaError",
    "Script",
    "SimApp",
    "SimSettings",
    "Stats",
    "Timing",
    "instance",
    "parse_fault",
    "plan_reply",
    "script_for",
]
