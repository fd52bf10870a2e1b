"""The adapter interface: how the inference stage talks to a model backend.

An adapter turns one :class:`InferenceRequest` into a stream of :class:`Delta`
sent into a Trio memory channel, and raises an :class:`~aiserve_trio.core.errors.UpstreamError`
subclass when the backend fails. It owns its connection pool, which lives for
the app's lifetime: :meth:`Adapter.aopen` runs in lifespan start-up (with the
app's lifetime nursery, for tasks a pool needs) and :meth:`Adapter.aclose` at
shutdown.

:meth:`Adapter.stream` is written once, here, for every backend: the check that
there is time left, retries before the first token (``retry.py``) reported to
an :class:`~aiserve_trio.observability.events.UpstreamHook`, and the guarantee
that a reply either ends with exactly one final delta or raises. A backend
implements :meth:`Adapter.attempt` -- one try -- and, if it fits prompts to a
context window, :meth:`Adapter.prepare`.

Adapters do not time themselves out: the inference stage runs them inside a
cancel scope whose deadline is the stage's cut point, and passes that deadline
in ``InferenceRequest.deadline`` so an adapter can tell its backend how long it
has (and keep its own client timeouts below it).
"""

from __future__ import annotations

import abc
import math
import random
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar, final

import msgspec
import trio

from ..core.api import NativeEvents
from ..core.errors import BadRequest, UpstreamProtocolError, UpstreamTimeout
from ..core.messages import Message
from ..observability.events import NULL_HOOK, UpstreamHook
from .retry import NO_RETRIES, Progress, RetryPolicy, run_with_retries

_T = TypeVar("_T")


class Usage(msgspec.Struct, kw_only=True):
    """A reply's token counts, in OpenAI's sense whatever the backend.

    ``prompt_tokens`` is every input token, those served from or written to the
    backend's prompt cache included (Anthropic's ``input_tokens`` +
    ``cache_read_input_tokens`` + ``cache_creation_input_tokens``); of them,
    ``cache_read_tokens`` were read from the cache and ``cache_write_tokens`` written
    to it, each priced at its own rate (``spend/prices.py``).
    """

    prompt_tokens: int
    completion_tokens: int
    #: ``prompt_tokens_details`` / ``completion_tokens_details`` as the backend sent them.
    prompt_details: msgspec.Raw | None = None
    completion_details: msgspec.Raw | None = None
    #: Prompt tokens the backend read from its prompt cache (OpenAI's ``cached_tokens``).
    cache_read_tokens: int = 0
    #: Prompt tokens the backend wrote to its prompt cache (Anthropic's cache creation).
    cache_write_tokens: int = 0


class _PromptDetails(msgspec.Struct):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


_prompt_details = msgspec.json.Decoder(_PromptDetails)


def prompt_details(usage: Usage) -> msgspec.Raw:
    """``usage``'s cache counts as an OpenAI ``prompt_tokens_details`` object."""
    return msgspec.Raw(
        b'{"cached_tokens":%d,"cache_write_tokens":%d}'
        % (usage.cache_read_tokens, usage.cache_write_tokens)
    )


def cache_counts(details: msgspec.Raw | None) -> tuple[int, int]:
    """(cache reads, cache writes) in an OpenAI ``prompt_tokens_details`` object:
    ``cached_tokens`` and ``cache_write_tokens`` (as OpenRouter reports writes); (0, 0)
    when absent, malformed or negative."""
    if details is None:
        return 0, 0
    try:
        d = _prompt_details.decode(details)
    except msgspec.DecodeError:
        return 0, 0
    return max(0, d.cached_tokens), max(0, d.cache_write_tokens)


class ToolCallDelta(msgspec.Struct, kw_only=True):
    """A streamed fragment of a tool call: ``index`` says which call it continues."""

    index: int
    #: On a call's first fragment: its id, type and function name.
    id: str | None = None
    type: str | None = None
    name: str | None = None
    arguments: str = ""

    @classmethod
    def of(cls, chunk: WireToolCall) -> ToolCallDelta:
        """The fragment a Chat Completions ``tool_calls`` chunk holds."""
        fn = chunk.function
        return cls(
            index=chunk.index,
            id=chunk.id,
            type=chunk.type,
            name=fn.name if fn is not None else None,
            arguments=(fn.arguments or "") if fn is not None else "",
        )


class WireFunction(Protocol):
    """A tool call chunk's ``function`` as any decoder reads it."""

    @property
    def name(self) -> str | None: ...
    @property
    def arguments(self) -> str | None: ...


class WireToolCall(Protocol):
    """One entry of a Chat Completions chunk's ``tool_calls``, as any decoder reads it."""

    @property
    def index(self) -> int: ...
    @property
    def id(self) -> str | None: ...
    @property
    def type(self) -> str | None: ...
    @property
    def function(self) -> WireFunction | None: ...


class ServedBy(msgspec.Struct, frozen=True, kw_only=True):
    """Which backend served a reply, when an adapter chose among several (a group).

    It rides on the reply's first :class:`Delta`, the moment the choice is final
    (a hedged request has two tries until one sends a token), and that is when
    the sse stage writes the response head: ``X-Aiserve-Deployment`` and
    ``X-Aiserve-Fallback``.
    """

    #: The ``[adapters.NAME]`` that answered (the innermost, for a group inside a group).
    deployment: str
    #: 0: one of the group's own deployments; n: its n-th fallback.
    fallback: int = 0
    #: Messages that adapter's ``prepare`` dropped to fit its context window.
    trimmed: int = 0


class Delta(msgspec.Struct, kw_only=True):
    """A piece of the reply, and on the last piece the finish reason and usage.

    ``text`` is the content; ``reasoning`` the reasoning text (``reasoning_content``,
    as vLLM, DeepSeek and Qwen stream it); ``refusal`` a refusal; ``tool_calls``
    fragments of tool calls; ``logprobs`` the choice's logprobs object as the
    backend sent it.
    """

    text: str = ""
    reasoning: str = ""
    refusal: str = ""
    tool_calls: list[ToolCallDelta] | None = None
    logprobs: msgspec.Raw | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    #: Upstream events (about one token each) this delta joins, for the token cap.
    tokens: int = 1
    #: On the first delta only, from an adapter that chose a backend (a group).
    served: ServedBy | None = None
    #: On the first delta only: the model that answered, by the name the gateway serves
    #: it under (a group's fallback or a chain's step may answer with another model
    #: than the client asked for). Set by :meth:`Adapter.stream` when the backend's
    #: try did not set it.
    model: str | None = None
    #: On the first delta only, from a chain: the steps that ran, in order
    #: (``X-Aiserve-Steps``; ``chains/run.py``).
    steps: tuple[str, ...] | None = None
    #: On a native route (the client speaks the provider's API), the provider's own
    #: events this delta was read from; the fields above say what they hold.
    native: NativeEvents | None = None


__all__ = [
    "Adapter",
    "Capabilities",
    "Delta",
    "EmbeddingRequest",
    "InferenceRequest",
    "Message",
    "ServedBy",
    "ToolCallDelta",
    "TranscriptionRequest",
    "Usage",
]


#: Top-level request fields every backend carries (see :class:`Capabilities`).
CORE_FIELDS = frozenset(
    {
        "model",
        "messages",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "user",
        "metadata",
    }
)


class Capabilities(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend can carry. A request needing more gets a 400 naming the field.

    The core of every request (``model``, ``messages``, ``stream``,
    ``stream_options``, ``max_tokens``, ``max_completion_tokens``, ``n``,
    ``user``, ``metadata``) is always carried.
    """

    #: Other top-level request fields it carries; None: any field (relayed as is).
    fields: frozenset[str] | None = None
    #: Content part types it carries; None: any.
    parts: frozenset[str] | None = None
    #: It answers ``POST /v1/embeddings``.
    embeddings: bool = False
    #: It turns speech into text (``POST {base_url}/audio/transcriptions``).
    transcription: bool = False

    def carries(self, field: str) -> bool:
        """Whether the top-level request field ``field`` reaches the backend."""
        return self.fields is None or field in CORE_FIELDS or field in self.fields


#: A backend that relays the whole OpenAI request as it was sent.
EVERYTHING = Capabilities(embeddings=True, transcription=True)


class EmbeddingRequest(msgspec.Struct, kw_only=True, frozen=True):
    """One ``/v1/embeddings`` call: the client's body as sent, and where it goes."""

    request_id: str
    #: The model the client asked for (the adapter may map it).
    model: str
    #: Absolute ``trio.current_time()`` by which the answer must be in.
    deadline: float
    #: The client's top-level fields, as sent.
    body: dict[str, msgspec.Raw]
    forward_headers: dict[str, str] = msgspec.field(default_factory=dict)


class TranscriptionRequest(msgspec.Struct, kw_only=True, frozen=True):
    """One speech-to-text call (a chain's ``transcribe`` step): the audio and where it goes."""

    request_id: str
    #: The transcription model (``whisper-1``...), sent as it is.
    model: str
    audio: bytes
    #: ``wav`` or ``mp3`` (the formats of OpenAI's ``input_audio`` parts).
    format: str
    #: Absolute ``trio.current_time()`` by which the transcript must be in.
    deadline: float
    forward_headers: dict[str, str] = msgspec.field(default_factory=dict)


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
    #: The functions the request offers as tools, and its ``tool_choice`` (a mode,
    #: or the name of the function it requires): for backends that act on them.
    tool_names: list[str] = msgspec.field(default_factory=list)
    tool_choice: str | None = None
    #: Every other top-level field of the client's body, exactly as it was sent
    #: (tools, response_format, seed, fields unknown today...): relayed as is.
    extra: dict[str, msgspec.Raw] = msgspec.field(default_factory=dict)
    #: On a native route: the client's body in its own API (after the input policies
    #: and session context), sent as it is by an adapter that :attr:`Adapter.speaks`
    #: :attr:`native_api`; the fields above are its translation, for everything else.
    native: bytes | None = None
    native_api: str = ""


def budget_ms(deadline: float) -> int:
    """The time left until ``deadline`` in whole milliseconds, as sent upstream.

    Rounded up, and at least 1 (the clock may have passed the deadline since the
    caller checked there was time left): an upstream that keeps the budget it is
    told stops no earlier than the gateway's own cut, so a call cut short by the
    deadline ends as the gateway's timeout, not as a reply the backend broke off.
    """
    return max(1, math.ceil((deadline - trio.current_time()) * 1000))


class DeltaSink(Protocol):
    """Where an attempt sends the reply's deltas (a ``trio.MemorySendChannel[Delta]`` is one)."""

    async def send(self, value: Delta, /) -> None: ...


@final
class _Reply:
    """The sink :meth:`Adapter.stream` gives each try: the caller's channel plus progress.

    The first delta through it ends retrying; the final one ends the reply, and
    anything after that is refused.
    """

    __slots__ = ("_model", "_name", "_out", "_progress")

    def __init__(self, out: DeltaSink, progress: Progress, name: str, model: str) -> None:
        self._out = out
        self._progress = progress
        self._name = name
        self._model = model

    async def send(self, value: Delta, /) -> None:
        progress = self._progress
        if progress.finished:
            raise UpstreamProtocolError(f"{self._name}: the reply went on after its final delta")
        if not progress.started and value.model is None:
            value = msgspec.structs.replace(value, model=self._model)
        progress.started = True
        if value.finish_reason is not None:
            progress.finished = True
        await self._out.send(value)


class Adapter(abc.ABC):
    """A model backend.

    Subclasses implement :meth:`attempt`, and may override :meth:`prepare`,
    :meth:`aopen`, :meth:`aclose` and :meth:`ready`; :meth:`stream` is final.
    :attr:`capabilities` says what the backend can carry.
    """

    #: What this backend can carry (class-wide; a backend relaying everything keeps the default).
    capabilities: Capabilities = EVERYTHING
    #: The client APIs (``apis/``: ``messages``, ``responses``) whose requests this
    #: backend takes as the client wrote them (``InferenceRequest.native``).
    speaks: frozenset[str] = frozenset()
    #: The model a request naming none gets, when the route sets no ``default_model``
    #: (a router: its default adapter's first model).
    default_model: str | None = None

    def __init__(
        self,
        name: str,
        models: list[str],
        *,
        policy: RetryPolicy = NO_RETRIES,
        hook: UpstreamHook = NULL_HOOK,
        rng: random.Random | None = None,
    ) -> None:
        """Build the adapter; its pool opens later, in :meth:`aopen`.

        Args:
            name: the ``[adapters.NAME]`` key (in errors, metrics and traces).
            models: the model names it serves.
            policy: retries before the first token (see ``retry.py``).
            hook: told of each upstream try, retry and final error.
            rng: backoff jitter source (tests seed it).
        """
        self.name = name
        self.models = models
        self.policy = policy
        self.hook = hook
        self.rng = rng if rng is not None else random.Random()

    def serving(self, model: str) -> Adapter:
        """The adapter that answers a request for ``model`` (this one; a router: the one
        its table names). Capabilities and the models listing are that adapter's."""
        return self

    async def aopen(self, nursery: trio.Nursery) -> None:  # noqa: B027 - optional hook
        """Open pools and connections; called once in lifespan start-up.

        Args:
            nursery: the app's lifetime nursery, for tasks the pool runs
                (closed after :meth:`aclose`).
        """

    async def aclose(self) -> None:  # noqa: B027 - optional hook, default does nothing
        """Close pools and connections; called once at shutdown."""

    async def ready(self) -> bool:
        """Whether the backend can take requests (for ``/readyz``)."""
        return True

    async def probe(self) -> bool:
        """A cheap check that the backend answers (a group's active health check).

        The caller bounds it with a cancel scope. The default asks :meth:`ready`;
        a network backend makes a real call (``openai``: ``GET /models``).
        """
        return await self.ready()

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

    @final
    async def stream(self, request: InferenceRequest, send: DeltaSink) -> None:
        """Send the reply's deltas into ``send`` (the caller closes it).

        On return exactly one final delta (with a ``finish_reason``) has been
        sent, after any text. ``request`` is not changed.

        Raises:
            UpstreamTimeout: no inference budget is left (before any try).
            UpstreamError: a subclass saying how the backend failed, after
                the retries the policy allows before the first token.
        """
        if request.deadline - trio.current_time() <= 0:
            late = UpstreamTimeout("no inference budget left for the upstream call")
            # No try was made, but the call failed: counted like any final error.
            self.hook.failed(self.name, late)
            raise late

        async def one_try(progress: Progress) -> None:
            await self.attempt(request, _Reply(send, progress, self.name, request.model), progress)
            if not progress.finished:
                raise UpstreamProtocolError(
                    f"{self.name}: the model backend ended the reply without finishing it"
                )

        await run_with_retries(
            one_try,
            policy=self.policy,
            deadline=request.deadline,
            rng=self.rng,
            adapter=self.name,
            hook=self.hook,
        )

    @final
    async def embed(self, request: EmbeddingRequest) -> bytes:
        """The backend's answer to an embeddings request (its JSON body).

        The same guard and retries as :meth:`stream` (a retry is always safe:
        nothing has reached the client).

        Raises:
            UpstreamTimeout: no time is left (before any try).
            UpstreamError: how the backend failed, after the retries.
        """
        return await self._whole_call(
            request.deadline, "the upstream call", lambda: self.embed_once(request)
        )

    async def embed_once(self, request: EmbeddingRequest) -> bytes:
        """One try at an embeddings request (backends with ``capabilities.embeddings``).

        Raises:
            BadRequest: this backend does not answer embeddings (the route checks
                ``capabilities.embeddings`` first, so a client never gets here).
        """
        raise BadRequest(
            f"the backend of this route ({self.name}) does not answer embeddings",
            code="unsupported_endpoint",
        )

    @final
    async def transcribe(self, request: TranscriptionRequest) -> str:
        """The text spoken in ``request.audio``.

        The same guard and retries as :meth:`embed` (nothing has reached the
        client yet, so a retry is always safe).

        Raises:
            UpstreamTimeout: no time is left (before any try).
            BadRequest: the audio cannot be read (a 400 from the backend included).
            UpstreamError: how the backend failed, after the retries.
        """
        return await self._whole_call(
            request.deadline, "the transcription call", lambda: self.transcribe_once(request)
        )

    async def _whole_call(
        self, deadline: float, what: str, once: Callable[[], Awaitable[_T]]
    ) -> _T:
        """``once()`` under the deadline guard and the retry policy: for calls whose
        answer comes whole, so that a retry is always safe."""
        if deadline - trio.current_time() <= 0:
            late = UpstreamTimeout(f"no time left for {what}")
            self.hook.failed(self.name, late)
            raise late
        answers: list[_T] = []

        async def one_try(progress: Progress) -> None:
            answers.append(await once())

        await run_with_retries(
            one_try,
            policy=self.policy,
            deadline=deadline,
            rng=self.rng,
            adapter=self.name,
            hook=self.hook,
        )
        return answers[-1]

    async def transcribe_once(self, request: TranscriptionRequest) -> str:
        """One try at a transcription (backends with ``capabilities.transcription``).

        Raises:
            BadRequest: this backend does not transcribe (the config refuses a
                ``transcribe`` step on such an adapter, so a client never gets here).
        """
        raise BadRequest(
            f"the backend {self.name} does not transcribe audio", code="unsupported_endpoint"
        )

    @abc.abstractmethod
    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        """One try at the reply: send its deltas, the final one last.

        Args:
            request: as :meth:`prepare` returned it; not to be changed.
            send: where the deltas go. The first one sent ends retrying; the
                one with a ``finish_reason`` ends the reply, and nothing may
                follow it.
            progress: what this request's tries have sent so far (kept by
                ``send``; read it, do not set it).

        Raises:
            UpstreamError: a subclass saying how the backend failed (retried
                when retryable and nothing has been sent yet). Returning without
                having sent the final delta counts as an ``UpstreamProtocolError``.
        """
