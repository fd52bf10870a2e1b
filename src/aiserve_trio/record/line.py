"""A finished request's :class:`~aiserve_trio.stages.outcome.Outcome` as one recorded line.

No I/O: the recorder's writer task calls :meth:`LineBuilder.line` off the
request path. What goes in (``schema.py`` has the format):

- the body **after the route's input policies**, rebuilt from ``outcome.prepared``
  like ``adapters/wire.py:chat_body`` rebuilds the upstream body, never from the
  client's bytes: the client's own messages as the policies left them (the
  session history and variables the gateway put in front stay out -- a replay
  sends the hashed session id, so a gateway with sessions rebuilds that context),
  the model and ``stream`` as asked, and every other top-level field as sent;
- redaction on top (``settings.py``): the messages through the default
  ``gdpr-redact`` when the route has no input-side ``gdpr-redact``, and the strings,
  object keys and numbers of the other fields always, unless ``redact = false``;
- three headers: the channel, the session id as an HMAC (a session's requests stay
  together; the id cannot be read back or confirmed without the key), the timeout;
- the labels of ``labels.py``, computed on the recorded body, whose ``metadata``
  has what a chain's classify steps decided (``intent``...), as the model got it;
- the outcome: status, TTFT, total time, tokens, stage times.

A tool call through ``/mcp`` (:class:`~.mcpcall.ToolCall`) is a line too
(:meth:`LineBuilder.call_line`): its JSON-RPC ``tools/call`` message made stateless
(the 2026-07-28 version in ``_meta``), its arguments as ``[mcp] policies`` left them
with the recording's redaction on top (every string, key and number, as a chat body's
other fields), the channel ``mcp``, the labels ``server`` and ``tool``, and its status,
time and result bytes.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from ..core.slices import Steps, finish
from ..policies.base import Policy, PolicyContext
from ..policies.redact import redacted_sides
from .labels import LabelRules
from .mcpcall import ToolCall
from .schema import (
    CHANNEL_HEADER,
    MCP_ROUTE,
    MCP_VERSION,
    MCP_VERSION_META,
    NO_BODY,
    SESSION_HEADER,
    TIMEOUT_HEADER,
    Record,
    RecordedOutcome,
    encoder,
)
from .settings import LABEL_VALUE_RE

if TYPE_CHECKING:
    from ..stages.outcome import Outcome
    from ..stages.types import Prepared, Route

_any = msgspec.json.Decoder()
#: A tool call's channel (as its audit row has it).
MCP_CHANNEL = "mcp"
#: A tool's label when it is not one the upstream lists, or no label value.
OTHER = "other"


def route_redacts_input(route: Route) -> bool:
    """The route's own policies already redact personal data in the messages."""
    return redacted_sides(route.policies)[0]


def hash_session(key: bytes, session_id: str) -> str:
    """The session id as it is recorded: 32 hex digits of HMAC-SHA256 (a valid session id)."""
    return hmac.new(key, session_id.encode(), hashlib.sha256).hexdigest()[:32]


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


class LineBuilder:
    """Builds recorded lines; one per recorder."""

    def __init__(
        self,
        rules: LabelRules,
        *,
        redactor: Policy | None,
        session_key: bytes,
        started: float,
        clock_start: float,
    ) -> None:
        """Args:
        rules: the label rules.
        redactor: the default ``gdpr-redact`` policy; None when ``redact = false``.
        session_key: the HMAC key session ids are hashed with.
        started: Unix time the recording began (every line's ``started``).
        clock_start: ``trio.current_time()`` at that moment (arrivals are on that clock).
        """
        self.rules = rules
        self.redactor = redactor
        self.session_key = session_key
        self.started = started
        self.clock_start = clock_start

    def line(self, outcome: Outcome, path: str) -> bytes:
        """The JSON line (with its newline) of ``outcome``, a request to route ``path``."""
        return finish(self.line_steps(outcome, path))

    def line_steps(self, outcome: Outcome, path: str) -> Steps[bytes]:
        """:meth:`line` in bounded steps (the recorder runs them sliced)."""
        record = yield from self.record_steps(outcome, path)
        return encoder.encode(record) + b"\n"

    def record(self, outcome: Outcome, path: str) -> Record:
        return finish(self.record_steps(outcome, path))

    def record_steps(self, outcome: Outcome, path: str) -> Steps[Record]:
        info = outcome.info
        body: bytes | None = None
        labels: dict[str, str] = {}
        if outcome.prepared is not None and info is not None:
            chain = outcome.chain
            body = yield from self.body_steps(
                outcome.prepared, info.route, chain.labels if chain else None
            )
            decoded = _any.decode(body)
            labels = self.rules.labels(decoded if isinstance(decoded, Mapping) else {})
        headers: dict[str, str] = {}
        if info is not None:
            headers[CHANNEL_HEADER] = info.channel
            if info.session_id is not None:
                headers[SESSION_HEADER] = hash_session(self.session_key, info.session_id)
            timeout = info.headers.get(TIMEOUT_HEADER)
            if timeout is not None and timeout.strip().isdigit():
                headers[TIMEOUT_HEADER] = timeout.strip()
        return Record(
            started=self.started,
            offset=round(outcome.arrival - self.clock_start, 6),
            route=path,
            body=msgspec.Raw(body) if body is not None else NO_BODY,
            headers=headers,
            labels=labels,
            outcome=recorded_outcome(outcome),
        )

    def body(
        self, prepared: Prepared, route: Route, labels: Mapping[str, str] | None = None
    ) -> bytes:
        """The request body as recorded (see the module docstring); ``labels`` (a
        chain's) are put into its ``metadata``."""
        return finish(self.body_steps(prepared, route, labels))

    def body_steps(
        self, prepared: Prepared, route: Route, labels: Mapping[str, str] | None = None
    ) -> Steps[bytes]:
        """:meth:`body` in bounded steps."""
        inference = prepared.inference
        # The client's messages carry their JSON; what the gateway made (session
        # history, the variables' system prompt) does not.
        messages = [m for m in inference.messages if m.raw is not None]
        redactor = self.redactor
        extra = inference.extra
        if redactor is not None:
            ctx = _context(route)
            if not route_redacts_input(route):
                messages = yield from redactor.input_steps(messages, ctx)
            # Always: keys, numbers and strings of every other field.
            extra = yield from redactor.fields_steps(extra, ctx)
        out: dict[str, Any] = {
            "model": prepared.parsed.model,
            "messages": [m.to_raw() for m in messages],
            "stream": prepared.parsed.stream,
        }
        out.update(extra)
        if labels:
            metadata = _any.decode(out["metadata"]) if "metadata" in out else None
            out["metadata"] = {**(metadata if isinstance(metadata, dict) else {}), **labels}
        return encoder.encode(out)

    # --- a tool call through /mcp ---------------------------------------------------

    def call_line(self, call: ToolCall) -> bytes:
        """The JSON line (with its newline) of one tool call."""
        return finish(self.call_line_steps(call))

    def call_line_steps(self, call: ToolCall) -> Steps[bytes]:
        """:meth:`call_line` in bounded steps (the recorder runs them sliced)."""
        record = yield from self.call_record_steps(call)
        return encoder.encode(record) + b"\n"

    def call_record_steps(self, call: ToolCall) -> Steps[Record]:
        arguments: Any = {}
        if call.arguments is not None:
            arguments = call.arguments
            if self.redactor is not None:
                ctx = PolicyContext(route=MCP_ROUTE, channel="", tenant="", request_id="")
                fields = {"arguments": msgspec.Raw(encoder.encode(arguments))}
                fields = yield from self.redactor.fields_steps(fields, ctx)
                arguments = _any.decode(fields["arguments"])
        message_id = call.message_id if isinstance(call.message_id, int) else 1
        message = {
            "jsonrpc": "2.0",
            "id": message_id,
            "method": "tools/call",
            "params": {
                "name": f"{call.server}__{call.tool}",
                "arguments": arguments,
                "_meta": {MCP_VERSION_META: MCP_VERSION},
            },
        }
        headers = {CHANNEL_HEADER: MCP_CHANNEL}
        if call.timeout is not None and call.timeout.strip().isdigit():
            headers[TIMEOUT_HEADER] = call.timeout.strip()
        status, error = call.recorded_status()
        return Record(
            started=self.started,
            offset=round(call.arrival - self.clock_start, 6),
            route=MCP_ROUTE,
            body=msgspec.Raw(encoder.encode(message)),
            headers=headers,
            labels={
                "server": _label(call.server),
                "tool": _label(call.tool) if call.known else OTHER,
            },
            outcome=RecordedOutcome(
                status=status,
                total_ms=_ms(call.ended - call.arrival),
                error=error,
                result_bytes=call.result_bytes,
            ),
        )


def _label(value: str) -> str:
    """``value`` as a label value, or :data:`OTHER` when the weights' syntax could not name it."""
    return value if LABEL_VALUE_RE.match(value) else OTHER


def _context(route: Route) -> PolicyContext:
    # The actions the redactor records here are not the request's: not counted.
    return PolicyContext(route=route.label, channel="", tenant="", request_id="")


def recorded_outcome(outcome: Outcome) -> RecordedOutcome:
    """What a record keeps of how the request ended."""
    arrival = outcome.arrival
    usage = outcome.usage
    error = outcome.error
    return RecordedOutcome(
        status=outcome.status,
        total_ms=_ms(outcome.ended - arrival),
        model=outcome.served_model or None,
        ttft_ms=(
            _ms(outcome.first_token_at - arrival) if outcome.first_token_at is not None else None
        ),
        prompt_tokens=usage.prompt_tokens if usage is not None else None,
        completion_tokens=usage.completion_tokens if usage is not None else None,
        stages_ms={name: _ms(t1 - t0) for name, (t0, t1) in outcome.stages.items()},
        finish_reason=outcome.finish_reason,
        cost=outcome.cost or None,
        error=(error.code or type(error).__name__) if error is not None else None,
        error_stage=outcome.error_stage if outcome.status != "ok" else None,
    )
