"""The immutable record of how one chat request ended.

The pipeline builds one :class:`Outcome` after the request's nursery has
joined; the observer (metrics, trace, baseline, debug list), the session
write-back and the gate's token charge all read it, and none of them can
change what another sees.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import msgspec

from ..observability.events import Hook, NullHook
from ..observability.metrics import label_value, status_label

if TYPE_CHECKING:
    from ..adapters.base import ServedBy, Usage
    from ..chains.plan import ChainReport
    from ..core.errors import GatewayError
    from ..core.messages import ToolCall
    from ..policies.base import PolicyContext
    from .types import Prepared, RequestInfo

#: ``status`` of a request whose client went away before it ended.
CLIENT_CLOSED = "client_closed"


class Outcome(msgspec.Struct, frozen=True, kw_only=True):
    """A frozen Struct, not a frozen dataclass: one is built for every request, and a
    frozen dataclass sets each of its ~35 fields through ``object.__setattr__`` (7 µs a
    request, against about 1 µs)."""

    request_id: str
    #: The route's label.
    route: str
    channel: str
    arrival: float
    ended: float
    #: ``ok``, ``client_closed``, or the HTTP status's label (``gateway_timeout``...).
    status: str
    #: What the request shared with its stages; None when refused before the pipeline.
    info: RequestInfo | None = None
    #: The model the client asked for; "" if the body was never decoded.
    model: str = ""
    #: The model that answered, as the reply names it (a group's fallback or a chain's
    #: step may answer with another); "" when nothing answered.
    served_model: str = ""
    stream: bool = False
    error: GatewayError | None = None
    error_stage: str | None = None
    #: The context stage's result, if it got that far.
    prepared: Prepared | None = None
    #: The policies' notes and actions (also when an input policy blocked the request).
    policy: PolicyContext | None = None
    #: Per stage that got its input: (when it got it, when it ended), clock seconds.
    stages: Mapping[str, tuple[float, float]] = msgspec.field(default_factory=dict)
    first_token_at: float | None = None
    usage: Usage | None = None
    finish_reason: str | None = None
    #: The reply text actually delivered to the client.
    delivered: str = ""
    #: The tool calls delivered, arguments as the client got them.
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    disconnected: bool = False
    #: The cap that ended the reply early (``max_tokens``, ``max_reply_bytes``,
    #: ``max_stream_s``), if one did.
    capped: str | None = None
    #: Writes to the client (ASGI sends, each at least one socket write) and body bytes.
    client_writes: int = 0
    client_bytes: int = 0
    #: Chunks read from the upstream (handed to the adapter's decoder) and their bytes.
    upstream_reads: int = 0
    upstream_bytes: int = 0
    #: What the route's response cache did: ``hit``, ``miss``, ``coalesced``
    #: (shared an identical request's answer), ``bypass``; None without a cache.
    cache: str | None = None
    #: What the route's chain did (its steps, labels, transcribed turns); None
    #: on a route without steps.
    chain: ChainReport | None = None
    #: The tenant and API key (None with auth off) the request acted as.
    tenant: str = ""
    key_id: str | None = None
    #: Which deployment of a group answered (None: not a group, or no answer).
    served: ServedBy | None = None
    #: What the request cost in ``[pricing] currency``, at ``served_model``'s price (0 for
    #: a cache hit or an unpriced model), for ``usage`` whatever ended the reply; never
    #: negative.
    cost: float = 0.0
    #: What a cache hit would have cost had the model answered.
    saved: float = 0.0
    #: The part of ``cost`` paid for the backend's prompt-cache reads and writes
    #: (``usage.cache_read_tokens`` / ``cache_write_tokens`` at their own rates).
    cache_cost: float = 0.0
    #: Where ``usage`` came from: ``provider`` (its own count, believed) or ``counted``
    #: (the gateway's count, in part or whole: none came, the reply never finished, or
    #: the provider's was not believable); None when nothing was billed (no answer).
    usage_source: str | None = None
    #: Why the provider's usage was replaced (``negative``, ``absurd``), if it was.
    distrusted: str | None = None
    #: The client's address, set only on a request the gate refused for its key: the
    #: audit log counts those per address and interval instead of a row each.
    client: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def cut(self) -> bool:
        """The reply did not end cleanly (error, disconnect, no finish)."""
        return self.error is not None or self.disconnected or self.finish_reason is None

    @property
    def model_label(self) -> str:
        return label_value(self.model) if self.model else "none"


def status_of(error: GatewayError | None, disconnected: bool) -> str:
    """The ``status`` label of a request that ended this way."""
    if disconnected:
        return CLIENT_CLOSED
    if error is not None:
        return status_label(error.status)
    return "ok"


class RequestHook(Hook, Protocol):
    """Everything the request path reports (``observability/events.py``), and the
    outcome: declared here, beside what it carries, so that the hook's module
    names nothing of the stages."""

    def request_complete(self, outcome: Outcome) -> None:
        """A chat request ended (once per request, whatever happened)."""
        ...


class NullRequestHook(NullHook):
    """A hook that records nothing, outcomes included."""

    def request_complete(self, outcome: Outcome) -> None:
        pass


NULL_REQUEST_HOOK = NullRequestHook()
