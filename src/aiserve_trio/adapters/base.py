"""The adapter interface: how the inference stage talks to a model backend.

An adapter turns one :class:`InferenceRequest` into a stream of :class:`Delta`
sent into a Trio memory channel, and raises an :class:`~aiserve_trio.errors.UpstreamError`
subclass when the backend fails. It owns its connection pool, which lives for
the app's lifetime: :meth:`Adapter.aopen` runs in lifespan start-up and
:meth:`Adapter.aclose` at shutdown.

Adapters do not time themselves out: the inference stage runs them inside a
cancel scope whose deadline is the stage's cut point, and passes that deadline
in ``InferenceRequest.deadline`` so an adapter can tell its backend how long it
has (and keep its own client timeouts below it).
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import msgspec
import trio


class Message(msgspec.Struct, kw_only=True):
    """One prompt message as the backend sees it (text only)."""

    role: str
    content: str
    name: str | None = None


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int


class Delta(msgspec.Struct, kw_only=True):
    """A piece of the reply: text, and on the last piece the finish reason and usage."""

    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None


class InferenceRequest(msgspec.Struct, kw_only=True):
    request_id: str
    model: str
    messages: list[Message]
    #: Absolute ``trio.current_time()`` by which the last token must have arrived.
    deadline: float
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    #: Session variables (for templated replies and system prompts).
    variables: dict[str, str] = msgspec.field(default_factory=dict)
    #: Headers to forward upstream (e.g. ``traceparent``).
    forward_headers: dict[str, str] = msgspec.field(default_factory=dict)
    #: Set by :meth:`Adapter.prepare`: old history messages dropped to fit the context window.
    trimmed: int = 0
    #: Set by :meth:`Adapter.prepare` when fitting counted the prompt's tokens.
    prompt_tokens: int | None = None


class Adapter(abc.ABC):
    """A model backend. Subclasses implement :meth:`stream`."""

    def __init__(self, name: str, models: list[str]) -> None:
        self.name = name
        self.models = models

    async def aopen(self) -> None:  # noqa: B027 - optional hook, default does nothing
        """Open pools and connections; called once in lifespan start-up."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook, default does nothing
        """Close pools and connections; called once at shutdown."""

    async def ready(self) -> bool:
        """Whether the backend can take requests (for ``/readyz``)."""
        return True

    async def prepare(self, request: InferenceRequest) -> InferenceRequest:
        """The request as this backend should get it (e.g. fitted to its context window).

        Called once per request, before :meth:`stream`. Returns a new request
        when something changes; ``request`` itself is never changed.
        The default returns it as it is.

        Raises:
            BadRequest: the request cannot be served by this backend as it is
                (e.g. ``context_length_exceeded``).
        """
        return request

    @abc.abstractmethod
    async def stream(self, request: InferenceRequest, send: trio.MemorySendChannel[Delta]) -> None:
        """Send the reply's deltas into ``send`` (the caller closes it).

        Raises:
            UpstreamError: a subclass saying how the backend failed.
        """


AdapterFactory = Callable[..., Adapter]
