"""aiserve-sim: a simulated model backend for tests and load tests.

Run it with ``aiserve-sim`` (default ``127.0.0.1:8100``; ``aiserve-sim --help``).
It serves, on one port, under hypercorn's Trio worker:

HTTP (OpenAI-compatible)
    ``POST /v1/chat/completions`` -- OpenAI's request shape as the official SDK
    sends it: ``content`` a string or a list of parts (``text``, ``image_url``
    {url, detail}, ``input_audio`` {data, format}, ``file``), assistant
    messages with ``tool_calls``, ``tool`` messages with ``tool_call_id``; any
    other field is accepted and ignored (``temperature``, ``stop``, ``seed``,
    ``n``, ...: the reply does not depend on them). What the reply says is
    decided (:func:`~.reply.script_for`) in this order:

    0. ``tools`` and ``tool_choice`` not ``"none"``, and the last message is
       a user message with a line ``sim-call: NAME {"arg": ...}``: a call of
       ``NAME`` with exactly those arguments (a JSON object; ``{}`` if left
       out; anything else is a 400) -- how a test makes an agent such as
       Claude Code run the tool it chooses (every dialect reads it);
    1. ``tools`` and ``tool_choice`` not ``"none"``: a call of the function
       ``tool_choice`` names (``{"type": "function", "function": {"name": N}}``)
       or else the first tool, with arguments generated from its
       ``parameters`` schema (:func:`~.schema.instance`; every property when the
       function is ``strict``) -- unless the last message is a ``tool`` message
       and ``tool_choice`` is ``"auto"`` or absent: then the rules below
       decide (3. quotes the result, so a round trip ends). One call per
       reply, whatever ``parallel_tool_calls`` says;
    2. ``response_format`` ``{"type": "json_schema", "json_schema": {"schema":
       S, "strict": ...}}``: content is a JSON instance of S;
       ``{"type": "json_object"}``: ``{"answer":"sim","ok":true}``;
    3. the last message is a ``tool`` message: ``The tool returned: <its
       content>`` (the trailing tool messages' contents joined with ``; ``);
    4. a system message with a ``Labels: a, b, c`` line (a chain's classify
       prompt): exactly the listed label the last user message names (a word
       beginning with it), else ``unknown``;
    5. image parts in the messages: ``I see N image(s).``;
    6. otherwise the usual words (``the quick brown fox ...``).

    After 3. and 5. the usual words follow for as long as the timing model
    says. ``reasoning_effort`` (``minimal`` 1, ``low`` 3, ``medium`` 6,
    ``high`` 12 pieces; ``none`` 0; anything else as medium) puts reasoning
    before any of these. ``logprobs: true`` (``top_logprobs: k``, at most 20)
    adds log-probabilities to content (not to tool calls). A schema with no
    instance (a ``$ref`` that does not resolve, a required cycle) is a 400.

    ``stream: true`` gives ``text/event-stream`` ``chat.completion.chunk``
    events, one per output token (``choices[0].delta``; the first carries
    ``"role": "assistant"``)::

        {"reasoning_content": "Let"}                  # reasoning pieces first
        {"content": "the"}                            # text or JSON content
          (choice also has "logprobs": {"content": [{"token": "the",
           "logprob": -0.01, "bytes": [116, 104, 101],
           "top_logprobs": [{"token", "logprob", "bytes"} x k]}]} if asked)
        {"tool_calls": [{"index": 0, "id": "call_<24 hex>", "type": "function",
                         "function": {"name": N, "arguments": ""}}]}
        {"tool_calls": [{"index": 0, "function": {"arguments": "<piece>"}}]}
                                                      # the call's name, then its
                                                      # arguments in pieces

    then a finish chunk (``delta: {}``, ``finish_reason`` ``stop`` /
    ``length`` / ``tool_calls``), a usage chunk (``choices: []``) when
    ``stream_options.include_usage`` is set, then ``data: [DONE]``.
    Otherwise one ``chat.completion`` body: ``choices[0].message`` is
    ``{"role": "assistant", "content": text}``, or ``{"role": "assistant",
    "content": null, "tool_calls": [{"id", "type": "function", "function":
    {"name", "arguments"}}]}``, plus ``"reasoning_content"`` when there was
    reasoning; ``choices[0].logprobs`` is ``{"content": [entry per token]}``
    when asked (``{"content": null}`` for a tool call). ``usage`` everywhere is::

        {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
         "prompt_tokens_details": {"cached_tokens": 0},
         "completion_tokens_details": {"reasoning_tokens": r}}   # c includes r

    ``POST /v1/embeddings`` -- ``input`` a string, a list of strings, a token
    array or a list of token arrays; ``dimensions`` (default 512);
    ``encoding_format`` ``float`` (default) or ``base64`` (little-endian
    float32). Answers ``{"object": "list", "data": [{"object": "embedding",
    "index": i, "embedding": [...]}], "model": ..., "usage": {"prompt_tokens":
    n, "total_tokens": n}}`` with lexical unit vectors (hashed word and
    character n-grams of the normalised text: texts sharing their words are
    near, the same text embeds the same in every process), after the prefill time of its tokens. The
    fault headers and the budget apply as for chat.

    ``POST /v1/audio/transcriptions`` -- OpenAI's ``multipart/form-data``: a
    ``file`` part (wav or mp3, by file name or ``Content-Type``), a ``model``
    field, ``response_format`` ``json`` (default: ``{"text": ...}``) or
    ``text``. The sim cannot hear speech; it answers the way ``util/wav.py`` says
    (the gateway's mock model does the same): a WAV's ``LIST``/``INFO``
    comment (``ICMT``) is its transcript, a WAV without one is ``[1.5 seconds
    of audio without speech]``, mp3 audio ``[N bytes of mp3 audio without
    speech]``. ``python -m aiserve_trio.util.wavtool make TEXT FILE`` writes such a
    WAV. After the prefill time of the transcript's words; the fault headers
    and the budget apply as for chat; a form it cannot read is a 400.

    ``GET /v1/models``, ``GET /healthz``. The provider dialects' paths
    (``--dialect``) are in :mod:`.anthropic`, :mod:`.azure`, :mod:`.gemini`,
    :mod:`.bedrock` and :mod:`.responses` (OpenAI's Responses API, ``POST
    /v1/responses``: typed events, reasoning items with ``encrypted_content``
    when ``include`` asks for it); Anthropic's also has ``POST
    /v1/messages/count_tokens``.

Debug endpoints
    ``GET /sim/stats`` -- JSON counters: ``requests``, ``completed``,
    ``cancelled`` (the client went away mid-reply), ``expired`` (the request's
    budget ran out), ``open_streams``, ``ws_connections`` (handshakes),
    ``faults`` by kind, ``last_timeout_ms``, ``attempts`` per request key.

    ``GET /sim/requests`` -- the last 50 requests received, newest last, bad
    ones too (not ``/sim/*`` nor ``/healthz``)::

        {"requests": [{"path": "/v1/chat/completions", "transport": "http",
                       "headers": {"content-type": "application/json", ...},
                       "body": "<the body exactly as received>"}]}

    Header names are lower-cased (repeats joined with ``, ``). A WebSocket
    message is one entry: ``"transport": "ws"``, the path ``/v1/ws``, the
    handshake's headers, the message text as the body.

    ``POST /sim/reset`` zeroes the counters and clears the request log.

WebSocket (the ``vllm_ws`` adapter's protocol), ``ws://HOST:PORT/v1/ws``
    A connection carries one request at a time and is reused for the next.
    All messages are JSON text frames.

    client -> sim::

        {"type": "generate", "id": "req-1", "model": "sim-model",
         "messages": [{"role": "user", "content": "hi"}],   # or any OpenAI shape
         "max_tokens": 16,            # optional
         "timeout_ms": 5000,          # optional: the remaining budget
         "fault": "503", "fault_times": 1,   # optional, like the headers below
         # optional, as in HTTP (same decisions):
         "tools": [...], "tool_choice": "auto", "response_format": {...},
         "reasoning_effort": "low",
         # optional, accepted for the gateway to relay; the reply ignores them:
         "stop": ["END"], "temperature": 0.7, "top_p": 1.0, "seed": 1}

    sim -> client, per request, in this order::

        {"type": "reasoning", "id": "req-1", "text": "Let"}            # 0..r
        {"type": "token", "id": "req-1", "index": 0, "text": "the"}    # content,
                                                      # index counting from 0
      or, for a tool call,
        {"type": "tool_call", "id": "req-1", "index": 0,
         "call_id": "call_<24 hex>", "name": "get_weather", "arguments": ""}
        {"type": "tool_call", "id": "req-1", "index": 0, "arguments": "{\\\"city"}
                                                      # 1..n argument pieces
      then
        {"type": "done", "id": "req-1", "finish_reason": "stop",  # length, tool_calls
         "usage": {"prompt_tokens": 12, "completion_tokens": 16,
                   "total_tokens": 28, "prompt_tokens_details": {"cached_tokens": 0},
                   "completion_tokens_details": {"reasoning_tokens": 0}}}
      or
        {"type": "error", "id": "req-1", "status": 429, "retry_after": 1.0,
         "message": "..."}            # the request failed; the connection stays usable
                                      # (status 400: a schema with no instance;
                                      # 504: timeout_ms ran out)

    Closing the connection mid-reply cancels the reply (the sim counts it in
    ``cancelled``). Close codes from the sim: 1008 a message that is not this
    protocol; 1011 a simulated drop mid-reply.

Timing model
    time to first token = ``prefill_overhead_ms`` + prompt tokens x
    ``prefill_per_token_ms`` (normal noise ``ttft_std_ms``); then (output
    tokens - 1) gaps of ``itl_ms`` (noise ``itl_std_ms``). Output tokens are
    the reasoning pieces, then the visible ones. Free text is the request's
    ``max_tokens`` long (finish ``length``), else drawn from
    ``output_tokens_mean`` / ``output_tokens_std`` (finish ``stop``; never
    shorter than an opening sentence, 3. and 5. above). JSON content, a label and tool
    arguments have their natural length (pieces of up to 12 characters), cut
    to ``max_tokens`` (then finish ``length``). Reasoning does not count
    against ``max_tokens``. Prompt tokens are counted with the real tokenizer
    (cl100k / o200k by model name) over the text parts and tool calls, plus 3
    per message, plus 85 per image. ``--seed`` makes jitter and random faults
    reproducible.

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

    Tokens count every output token (reasoning included). A JSON reply (not
    streamed, or embeddings) stalls, drops (no response) or is replaced by
    the malformed chunk, whatever N. ``X-Sim-Fault-Times: K`` (or
    ``fault_times``) applies the fault only to the first K attempts of one
    request key -- the ``X-Request-Id`` header, or the WebSocket ``id`` -- so
    a retrying client succeeds on attempt K + 1.

Budget
    ``X-Request-Timeout-Ms`` (HTTP) / ``timeout_ms`` (WebSocket) bound the
    reply; when it runs out the sim stops (``expired``).

Modules: :mod:`.model` (timing, faults), :mod:`.schema` (JSON Schema
instances), :mod:`.reply` (what a reply says), :mod:`.wire` (the messages it
is sent as), :mod:`.embeddings` -- all pure; :mod:`.request` (decoding),
:mod:`.core` (shared state), :mod:`.app` (HTTP) and :mod:`.ws` (WebSocket).
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
