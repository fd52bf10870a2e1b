"""One recorded request: the JSON line the recorder writes and ``aiserve-replay`` reads.

::

    {"v":1,"started":1764547200.0,"offset":12.345,"route":"/v1/chat/completions",
     "body":{"model":"aiserve-mock","messages":[...],"stream":true,...},
     "headers":{"x-channel":"app","x-session-id":"3f5a...","x-request-timeout-ms":"8000"},
     "labels":{"intent":"sql","has_tools":"true"},
     "outcome":{"status":"ok","ttft_ms":61.2,"total_ms":240.8,"prompt_tokens":42,
                "completion_tokens":17,"stages_ms":{"parse":0.2,...}}}

A tool call through ``/mcp`` (version 2) is a line of its own::

    {"v":2,"started":1764547200.0,"offset":13.002,"route":"/mcp",
     "body":{"jsonrpc":"2.0","id":1,"method":"tools/call",
             "params":{"name":"tickets__search","arguments":{"q":"[EMAIL]"},
                       "_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28"}}},
     "headers":{"x-channel":"mcp"},
     "labels":{"server":"tickets","tool":"search"},
     "outcome":{"status":"ok","total_ms":41.3,"result_bytes":812}}

Its ``body`` is the JSON-RPC ``tools/call`` message, stateless (the 2026-07-28 protocol
version in its ``_meta``, no session), so that it can be sent again as it is; the
arguments as the ``[mcp] policies`` left them, then the recording's redaction.

``started`` is when the recording began (Unix seconds; one value for every line a
worker writes, also across its rotated files) and ``offset`` the request's arrival
in seconds after it, so lines of several files and workers merge onto one time
line. ``body`` is the request as the model's side saw it -- after the route's input
policies and the recording's redaction, without the session context the gateway
added -- or null when the request never got that far (refused, blocked).

Leaf module (msgspec only): the replay tool imports it without the gateway.
"""

from __future__ import annotations

import msgspec

#: 2: a line may be a ``/mcp`` tool call (``route`` :data:`MCP_ROUTE`, ``result_bytes``);
#: a line of version 1 reads as before.
VERSION = 2
#: The route of a recorded MCP tool call, and the protocol version its message carries.
MCP_ROUTE = "/mcp"
MCP_VERSION = "2026-07-28"
MCP_VERSION_META = "io.modelcontextprotocol/protocolVersion"

#: The request headers a record keeps (never ``Authorization``, never cookies).
CHANNEL_HEADER = "x-channel"
SESSION_HEADER = "x-session-id"
TIMEOUT_HEADER = "x-request-timeout-ms"
HEADERS = (CHANNEL_HEADER, SESSION_HEADER, TIMEOUT_HEADER)
#: What ``aiserve-replay`` marks its requests with (its run's id): a recording
#: gateway leaves them out unless ``[record] include_replays = true``.
REPLAY_HEADER = "x-aiserve-replay"
#: ``body`` of a request that never got past its policies.
NO_BODY = msgspec.Raw(b"null")


class RecordedOutcome(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How the request ended when it was recorded."""

    #: ``ok``, ``client_closed``, or the HTTP status's name (``gateway_timeout``...);
    #: a tool call: ``ok``, ``denied``, ``invalid``, ``timeout``, ``client_closed`` or
    #: ``error`` (``error`` then says which: ``upstream_error:-32603``, ``tool_error``...).
    status: str
    total_ms: float
    #: The model that answered (a fallback or a chain's step may be another than asked).
    model: str | None = None
    ttft_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    #: Milliseconds each stage worked (from getting its input to its end).
    stages_ms: dict[str, float] = msgspec.field(default_factory=dict)
    finish_reason: str | None = None
    #: What it cost in ``[pricing] currency`` (absent without prices, or for a cache hit).
    cost: float | None = None
    #: The error's code and the stage it came from, when it failed.
    error: str | None = None
    error_stage: str | None = None
    #: A tool call: the bytes of the result the upstream answered.
    result_bytes: int | None = None


class Record(msgspec.Struct, kw_only=True):
    """One line of a recording (see the module docstring)."""

    v: int = VERSION
    started: float
    offset: float
    route: str
    #: The body's JSON, or ``null`` (:data:`NO_BODY`). A Raw, not ``Raw | None``:
    #: msgspec decodes a Raw only where the type is exactly Raw.
    body: msgspec.Raw
    headers: dict[str, str] = msgspec.field(default_factory=dict)
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    outcome: RecordedOutcome | None = None

    @property
    def has_body(self) -> bool:
        return bytes(self.body).strip() != b"null"

    @property
    def at(self) -> float:
        """Arrival, in Unix seconds."""
        return self.started + self.offset


encoder = msgspec.json.Encoder()
decoder = msgspec.json.Decoder(Record)
