"""What travels between the stages of one request, and the little they share.

The stages hand each other typed values through their channels::

    parse --ParsedRequest--> context --Prepared--> inference --Delta--> sse
                                     \\--Prepared------------------------^

What every stage may read is :class:`RequestInfo`: fixed when the request
arrives, never written afterwards. Nothing else is shared: a stage learns what
the one before it found out from the value it receives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec

from ..apis import chat
from ..apis.common import Codec
from ..core.budgets import STAGES
from ..observability.metrics import label_value

if TYPE_CHECKING:
    from ..adapters.base import Adapter, DeltaSink, InferenceRequest, ServedBy
    from ..cache.service import Ticket
    from ..chains.state import ChainRun
    from ..core.api import ChatCompletionRequest
    from ..core.budgets import Budget
    from ..core.messages import Message
    from ..http.types import Headers
    from ..observability.tracing import RequestTrace
    from ..policies.base import OutputFilter, Policy, PolicyContext
    from ..routes import RouteConfig
    from ..spend.prices import Pricing

__all__ = ["STAGES", "ParsedRequest", "Prepared", "RequestInfo", "Route", "response_headers"]


class StepChain(Protocol):
    """A route's chain of steps as the stages use it (``chains/run.py``'s ``Chain``,
    which names these types: so this module names only the chain's state)."""

    @property
    def consumes(self) -> frozenset[str]:
        """Content part types the chain turns into text before the adapter sees them."""
        ...

    async def run(
        self,
        info: RequestInfo,
        prepared: Prepared,
        request: InferenceRequest,
        out: DeltaSink,
        state: ChainRun,
    ) -> None:
        """Run the steps; the streaming step's deltas go into ``out``."""
        ...


@dataclass(frozen=True, slots=True)
class Route:
    """A configured route, ready to serve: its adapter and policies are built."""

    config: RouteConfig
    label: str
    adapter: Adapter
    policies: list[Policy]
    tenant: str
    #: The route's chain of steps (``chains/``); None: the adapter answers.
    chain: StepChain | None = None
    #: ``[pricing]``, when it prices any model (None: every request costs 0).
    pricing: Pricing | None = None
    #: Its client API (``apis/``): how a body is decoded and a reply framed, its
    #: errors' shape, what the API asks of the stages besides (``apis.codec_of``).
    codec: Codec = chat.CODEC


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What every stage of one request may read; fixed when it arrives."""

    request_id: str
    route: Route
    budget: Budget
    #: Unix seconds, for the ``created`` field of the reply.
    created: int
    channel: str
    session_id: str | None
    tenant: str
    #: Request headers, names lower-cased (last value wins).
    headers: dict[str, str]
    trace: RequestTrace
    #: The API key's id (None with auth off).
    key_id: str | None = None
    #: The models the key may call (``Principal.models``); None: every model of the route.
    models: frozenset[str] | None = None
    #: Streams the key may hold open at once in this worker (``Principal.max_streams``;
    #: 0: no cap of its own).
    key_max_streams: int = 0


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """The parse stage's result: the body decoded and validated."""

    body: ChatCompletionRequest
    #: The messages, each with its original JSON.
    messages: list[Message]
    #: Every top-level field but model, messages and stream, as sent.
    extra: dict[str, msgspec.Raw]
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    stop: list[str]
    #: On a route of another API than chat (``apis/``): the request as its client
    #: sent it (what the reply echoes); None on chat.
    api: object = None
    #: On a native route (the backend speaks the client's API, ``apis/``): the body
    #: as the client sent it, which goes upstream (after the input policies).
    native: bytes | None = None
    #: On a translated route: the hints the route's backend cannot carry, left out
    #: (``stages/parse.py`` ``HINTS``; ``X-Aiserve-Dropped``).
    dropped: tuple[str, ...] = ()

    @property
    def model_label(self) -> str:
        return label_value(self.model)


@dataclass(frozen=True, slots=True)
class Prepared:
    """The context stage's result: what the model is asked, and how to answer the client."""

    parsed: ParsedRequest
    #: The adapter's request: session context in, input policies applied, fitted to the window.
    inference: InferenceRequest
    #: Per-request output filters of the content, in policy order (the sse stage owns them).
    filters: list[OutputFilter]
    #: Makes a fresh chain of the filters for every other text the model writes
    #: (reasoning, refusals, tool-call argument strings): all but content-only ones.
    side_filters: Callable[[], list[OutputFilter]]
    #: Policy notes and actions, counted when the request ends.
    policy: PolicyContext
    #: ``"context"`` when the route went on without session context.
    degraded: str | None
    #: What the request adds to the conversation, as the model saw it (after the
    #: input policies): stored in the session with the reply.
    new_turns: list[Message]
    #: What the request does with the route's response cache (None: the route has none).
    cache: Ticket | None = None
    #: False: the turns are not stored (a Responses request's ``store: false``).
    store: bool = True
    #: The client API's request as the reply echoes it (``ParsedRequest.api`` after the
    #: input policies: a Responses object's ``instructions``, ``metadata``... as sent
    #: upstream); None: ``parsed.api`` as the client sent it.
    view: object = None


@runtime_checkable
class Dropping(Protocol):
    """A client API's request (``ParsedRequest.api``) that names what its translation left
    out: hints the backend cannot honour (``X-Aiserve-Dropped``)."""

    @property
    def dropped(self) -> tuple[str, ...]: ...


def response_headers(
    info: RequestInfo,
    prepared: Prepared | None,
    served: ServedBy | None = None,
    *,
    cache: str | None = None,
    steps: Sequence[str] | None = None,
    similarity: float | None = None,
) -> Headers:
    """The gateway's own response headers: request id, what a client API's translation
    dropped, degradation, trimming, trace,
    (``served``, from the first delta) which deployment of a group answered, on a
    route with a cache what it did (``hit``, ``semantic-hit`` with its similarity,
    ``miss``, ``bypass``, ``coalesced``),
    and on a chain the steps that ran, in order."""
    out = [(b"x-request-id", info.request_id.encode())]
    if prepared is not None and prepared.parsed.native is None:  # native: nothing dropped
        view = prepared.parsed.api
        dropped = prepared.parsed.dropped
        if view is not None and isinstance(view, Dropping):  # None on chat: quick
            dropped = view.dropped + dropped
        if dropped:
            out.append((b"x-aiserve-dropped", ", ".join(dropped).encode()))
    if steps:
        out.append((b"x-aiserve-steps", ",".join(steps).encode()))
    if cache is not None:
        out.append((b"x-aiserve-cache", cache.encode()))
    if similarity is not None:
        out.append((b"x-aiserve-cache-similarity", b"%.4f" % similarity))
    trimmed = served.trimmed if served is not None else 0
    if prepared is not None:
        if prepared.degraded:
            out.append((b"x-aiserve-degraded", prepared.degraded.encode()))
        trimmed = trimmed or prepared.inference.trimmed
    if trimmed:
        out.append((b"x-aiserve-trimmed-messages", b"%d" % trimmed))
    if served is not None:
        out.append((b"x-aiserve-deployment", served.deployment.encode()))
        out.append((b"x-aiserve-fallback", b"%d" % served.fallback))
    tr = info.trace.traceresponse()
    if tr is not None:
        out.append((b"traceresponse", tr.encode()))
    return out
