"""The chain executor: a route's steps, run inside the inference stage.

The inference stage hands a chain route's request to :meth:`Chain.run` instead
of calling the route's adapter. The steps run in plan order (``plan.py``), each
in a span of its own (``step NAME``, under the inference span) and, when it
makes a call, inside a cancel scope at its cut point: a step that passes it
ends the request with :class:`~aiserve_trio.core.errors.StepDeadlineExceeded`
naming the step (a 504 before the answer began, the final error event after).

What the steps hand each other lives in one :class:`_Work` per request, owned
by the inference stage's task:

- ``transcribe`` replaces every ``input_audio`` part by a text part with its
  transcript (the adapter's ``transcribe``; several parts one after another); a
  request without audio skips it, as if it were disabled;
- ``classify`` puts its label into the request's variables and ``metadata``
  under its ``key`` (the upstream request carries it; the recording reads it);
- ``route`` sets the next ``generate`` step's adapter or model, or jumps;
- ``generate`` and a model ``rewrite`` before the streaming step are awaited
  (their text is the *draft* the next rewrite works on); a policy ``rewrite``
  there filters the draft;
- the streaming step sends its deltas into the stage's channel through
  :class:`_ChainSink`: the first delta carries the steps that ran
  (``X-Aiserve-Steps``) and, when a route step chose another adapter, which one
  served (``X-Aiserve-Deployment``); the policy rewrites after the streaming
  step filter its text and reasoning as they pass; the final delta's ``usage``
  counts every model call of the chain.

What the request's chain did is kept in a :class:`ChainRun` the inference stage
owns; the pipeline reads its :class:`~.plan.ChainReport` once the request ended.

Each kind of step is one :class:`StepKind` object in :data:`STEP_KINDS` (by the
``kind`` of its table, as ``policies/registry.py`` keeps policy kinds) with its
three behaviours: ``awaited`` (before the streaming step), ``call`` (its model
call, under its cut point) and ``stream`` (the streaming step's request). The
executor looks a step's kind up; it never tests a step's type.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import msgspec
import trio

from ..adapters.base import (
    Delta,
    DeltaSink,
    InferenceRequest,
    ServedBy,
    TranscriptionRequest,
    Usage,
)
from ..adapters.sidecalls import SideCall
from ..core.errors import BadRequest, GatewayError, StepDeadlineExceeded, UpstreamTimeout
from ..core.messages import Message, Part
from ..policies.base import OutputFilter, apply_filters, finish_filters
from ..util.intents import parse_label, prompt
from ..util.wav import FORMATS
from .plan import Plan, PlannedStep, build_plan, match_rules, route_choice
from .state import ChainRun
from .steps import ClassifyStep, GenerateStep, RewriteStep, RouteStep, StepBase, TranscribeStep

if TYPE_CHECKING:
    from ..adapters.base import Adapter
    from ..config import Config
    from ..policies.base import Policy, PolicyContext
    from ..routes import RouteConfig
    from ..stages.types import Prepared, RequestInfo

_encoder = msgspec.json.Encoder()
_raw_dict = msgspec.json.Decoder(dict[str, msgspec.Raw])


class _Audio(msgspec.Struct):
    data: str
    format: str


class _AudioPart(msgspec.Struct):
    input_audio: _Audio


_audio_part = msgspec.json.Decoder(_AudioPart)


@dataclass(slots=True)
class _Work:
    """What the steps of one request hand each other."""

    request: InferenceRequest
    variables: dict[str, str]
    metadata: dict[str, str] = field(default_factory=dict)
    #: A route step's choice for the next generate step.
    adapter: str | None = None
    model: str | None = None
    #: The text of the last awaited generate or rewrite.
    draft: str = ""
    #: Tokens of the calls made before the streaming step.
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def count(self, usage: Usage | None) -> None:
        if usage is not None:
            self.prompt_tokens += usage.prompt_tokens
            self.completion_tokens += usage.completion_tokens


class _Collect:
    """A delta sink that keeps an awaited call's text and usage."""

    __slots__ = ("chars", "generated", "parts", "usage")

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.usage: Usage | None = None
        #: Upstream tokens (events) and their characters: billed if no usage comes.
        self.generated = 0
        self.chars = 0

    async def send(self, value: Delta, /) -> None:
        if value.text:
            self.parts.append(value.text)
        if value.usage is not None:
            self.usage = value.usage
        self.generated += value.tokens
        self.chars += (
            len(value.text) + len(value.reasoning) + len(value.refusal)
            + sum(len(c.arguments or "") for c in value.tool_calls or ())
        )  # fmt: skip

    @property
    def text(self) -> str:
        return "".join(self.parts)


class _ChainSink:
    """The streaming step's deltas on their way to the sse stage (see the module docstring)."""

    __slots__ = (
        "_filters", "_first", "_out", "_reasoning", "_served", "_state", "_steps", "_work",
    )  # fmt: skip

    def __init__(
        self,
        out: DeltaSink,
        steps: tuple[str, ...],
        served: ServedBy | None,
        filters: list[OutputFilter],
        reasoning: list[OutputFilter],
        work: _Work,
        state: ChainRun,
    ) -> None:
        self._state = state
        self._out = out
        self._steps = steps
        self._served = served
        self._filters = filters
        self._reasoning = reasoning
        self._work = work
        self._first = True

    async def send(self, value: Delta, /) -> None:
        changes: dict[str, Any] = {}
        if self._first:
            self._first = False
            changes["steps"] = self._steps
            if value.served is None and self._served is not None:
                changes["served"] = self._served
        if self._filters and value.text:
            changes["text"] = apply_filters(self._filters, value.text)
        if self._reasoning and value.reasoning:
            changes["reasoning"] = apply_filters(self._reasoning, value.reasoning)
        if value.finish_reason is not None:
            # What the filters held back goes out with the last delta.
            tail = finish_filters(self._filters) if self._filters else ""
            thought = finish_filters(self._reasoning) if self._reasoning else ""
            if tail or thought:
                changes["text"] = str(changes.get("text", value.text)) + tail
                changes["reasoning"] = str(changes.get("reasoning", value.reasoning)) + thought
                if not (value.text or value.reasoning):
                    changes["tokens"] = 0  # not a token the backend sent: no cap counts it
            work = self._work
            if value.usage is not None:
                # The steps before are billed with this usage, not on their own.
                self._state.folded = True
                if work.prompt_tokens or work.completion_tokens:
                    changes["usage"] = msgspec.structs.replace(
                        value.usage,
                        prompt_tokens=value.usage.prompt_tokens + work.prompt_tokens,
                        completion_tokens=value.usage.completion_tokens + work.completion_tokens,
                    )
        await self._out.send(msgspec.structs.replace(value, **changes) if changes else value)


def _has_audio(messages: Sequence[Message]) -> bool:
    return any("input_audio" in m.part_types() for m in messages)


def _last_user_text(messages: Sequence[Message]) -> str:
    return next((m.text() for m in reversed(messages) if m.role == "user"), "")


def _with_metadata(
    extra: dict[str, msgspec.Raw], metadata: Mapping[str, str]
) -> dict[str, msgspec.Raw]:
    """``extra`` with ``metadata`` merged into its ``metadata`` object (the client's keys kept)."""
    if not metadata:
        return extra
    fields: dict[str, msgspec.Raw] = {}
    raw = extra.get("metadata")
    if raw is not None:
        try:
            fields = dict(_raw_dict.decode(raw))
        except msgspec.DecodeError:  # `null`: the client sent none
            fields = {}
    for key, value in metadata.items():
        fields[key] = msgspec.Raw(_encoder.encode(value))
    return {**extra, "metadata": msgspec.Raw(_encoder.encode(fields))}


class Chain:
    """A route's chain, built once with the adapters and policies its steps name."""

    def __init__(
        self,
        route: str,
        plan: Plan,
        route_adapter: Adapter,
        adapters: Mapping[str, Adapter],
        policies: Mapping[str, Policy],
    ) -> None:
        """Args:
        route: the route's label.
        plan: its steps (``plan.build_plan``).
        route_adapter: the route's adapter (a step's default).
        adapters: every adapter, by name.
        policies: the policies of its policy rewrites, built, by name.
        """
        self.route = route
        self.plan = plan
        self.route_adapter = route_adapter
        self.adapters = adapters
        self.policies = policies
        #: Content part types the chain turns into text (so the route's adapter
        #: need not carry them): ``input_audio`` when a transcribe step is on.
        self.consumes: frozenset[str] = (
            frozenset({"input_audio"}) if plan.transcribes else frozenset()
        )

    def adapter_for(self, name: str | None) -> Adapter:
        """The adapter a step names, else the route's."""
        return self.adapters[name] if name is not None else self.route_adapter

    @staticmethod
    def model_for(adapter: Adapter, explicit: str | None, client: str) -> str:
        """The model named, else the client's when the adapter serves it, else its first."""
        if explicit is not None:
            return explicit
        return client if client in adapter.models else adapter.models[0]

    # --- the run ------------------------------------------------------------------

    async def run(
        self,
        info: RequestInfo,
        prepared: Prepared,
        request: InferenceRequest,
        out: DeltaSink,
        state: ChainRun,
    ) -> None:
        """Run the steps; the streaming step's deltas go into ``out``.

        Args:
            request: the context stage's request (with the trace headers to forward).
            state: where what ran is kept (the inference stage reads it on expiry).

        Raises:
            StepDeadlineExceeded: a step did not finish by its cut point.
            BadRequest: audio that cannot be read or transcribed.
            UpstreamError: a step's call failed.
        """
        plan = self.plan
        cuts = plan.cuts(trio.current_time(), info.budget.inference_end)
        work = _Work(request=request, variables=dict(request.variables))
        steps = plan.steps
        i = 0
        while not steps[i].streams:
            jump = await self._awaited(i, cuts[i], info, prepared, work, state)
            i = jump if jump is not None else i + 1
        await self._stream(i, info, prepared, work, out, state)

    @contextmanager
    def _step(
        self,
        step: PlannedStep,
        cut: float,
        info: RequestInfo,
        state: ChainRun,
        *,
        alongside: bool = False,
    ) -> Iterator[None]:
        """A step's span and record; its deadline named when it passes. A step
        ``alongside`` the streaming step (a policy filtering its answer) names no
        deadline, and its span is not where the upstream call's spans go."""
        state.begin(step.name)
        result = "cancelled"
        try:
            with info.trace.live_step(step.name, step.kind, current=not alongside):
                yield
            result = "ok"
        except UpstreamTimeout as err:
            result = err.code or "upstream_timeout"
            if not alongside and trio.current_time() >= cut:  # its budget ran out
                raise StepDeadlineExceeded(step.name) from err
            raise
        except GatewayError as err:
            result = err.code or type(err).__name__
            raise
        finally:
            state.end(step, result)

    async def _awaited(
        self,
        i: int,
        cut: float,
        info: RequestInfo,
        prepared: Prepared,
        work: _Work,
        state: ChainRun,
    ) -> int | None:
        """Run step ``i`` (before the streaming step); returns where a goto goes on."""
        step = self.plan.steps[i]
        kind, at = STEP_KINDS[step.kind], _At(self, step, prepared, work, state)
        if kind.skipped(at):
            return None  # like a disabled step
        with self._step(step, cut, info, state):
            return await kind.awaited(at, cut)

    async def _stream(
        self,
        i: int,
        info: RequestInfo,
        prepared: Prepared,
        work: _Work,
        out: DeltaSink,
        state: ChainRun,
    ) -> None:
        """The streaming step, with the policy rewrites after it filtering its deltas."""
        steps = self.plan.steps
        step = steps[i]
        end = info.budget.inference_end
        filtering = steps[i + 1 :]
        ran = (*state.started, step.name, *(s.name for s in filtering))
        at = _At(self, step, prepared, work, state)
        adapter, request = await STEP_KINDS[step.kind].stream(at, end)
        text_filters: list[OutputFilter] = []
        side_filters: list[OutputFilter] = []
        for s in filtering:
            policy = self.policies[_rewrite_policy(s)]
            if (f := policy.output_filter(prepared.policy)) is not None:
                text_filters.append(f)
            if not policy.content_only and (g := policy.output_filter(prepared.policy)) is not None:
                side_filters.append(g)
        served = ServedBy(deployment=adapter.name) if adapter is not self.route_adapter else None
        sink = _ChainSink(out, ran, served, text_filters, side_filters, work, state)
        with ExitStack() as stack:
            stack.enter_context(self._step(step, end, info, state))
            for s in filtering:
                stack.enter_context(self._step(s, end, info, state, alongside=True))
            state.last = step.name  # what a deadline passing now names
            await adapter.stream(request, sink)

    def filter_draft(self, name: str, ctx: PolicyContext, draft: str) -> str:
        """``draft`` through the output filter of the policy ``name``."""
        f = self.policies[name].output_filter(ctx)
        if f is None:
            return draft
        return apply_filters([f], draft) + finish_filters([f])


# --- the step kinds ------------------------------------------------------------------

C = TypeVar("C", bound=StepBase)


@dataclass(frozen=True, slots=True)
class _At:
    """One step of one request: what a step kind's behaviour works with."""

    chain: Chain
    step: PlannedStep
    prepared: Prepared
    work: _Work
    state: ChainRun


class StepKind(Generic[C]):
    """What one kind of step does, registered in :data:`STEP_KINDS` by its ``kind``.

    - :meth:`awaited`: the step before the streaming one, inside its span; by
      default the kind's :meth:`call` under the step's cut point;
    - :meth:`call`: the model call the step makes; by default the :meth:`stream`
      request's whole answer becomes the draft;
    - :meth:`stream`: the request of the streaming step (a generate or a model
      rewrite; the plan lets no other kind stream).
    """

    #: The step table this kind reads.
    config: type[C]

    def settings(self, step: PlannedStep) -> C:
        cfg = step.config
        assert isinstance(cfg, self.config), f"a {type(cfg).__name__} is not a {step.kind} step"
        return cfg

    def skipped(self, at: _At) -> bool:
        """Nothing for the step to do: it is passed over, like a disabled step."""
        return False

    async def awaited(self, at: _At, cut: float) -> int | None:
        """Run the step before the streaming one; returns where a goto goes on."""
        with trio.move_on_at(cut) as scope:
            await self.call(at, cut)
        if scope.cancelled_caught:
            raise StepDeadlineExceeded(at.step.name)
        return None

    async def call(self, at: _At, cut: float) -> None:
        """The step's call, finished by ``cut``."""
        adapter, request = await self.stream(at, cut)
        at.work.draft, usage = await _collect(adapter, request, at.state)
        at.work.count(usage)

    async def stream(self, at: _At, end: float) -> tuple[Adapter, InferenceRequest]:
        """The adapter and request of the streaming step (or of an awaited call)."""
        raise AssertionError(f"a {at.step.kind} step makes no generating call")


class _Transcribe(StepKind[TranscribeStep]):
    """Every ``input_audio`` part becomes a text part with its transcript."""

    config = TranscribeStep

    def skipped(self, at: _At) -> bool:
        return not _has_audio(at.work.request.messages)  # nothing to hear

    async def call(self, at: _At, cut: float) -> None:
        cfg = self.settings(at.step)
        adapter = at.chain.adapter_for(cfg.adapter)
        model = cfg.model or adapter.models[0]
        request = at.work.request
        done: dict[int, Message] = {}
        client = -1
        for m in request.messages:
            if m.raw is not None:
                client += 1  # the client's own messages, as it numbered them
            if not isinstance(m.content, list) or "input_audio" not in m.part_types():
                continue
            parts: list[Part] = []
            for j, part in enumerate(m.content):
                if part.type == "input_audio":
                    where = f"messages[{client}].content[{j}]"
                    audio, fmt = _audio_of(part, where)
                    call = TranscriptionRequest(
                        request_id=request.request_id,
                        model=model,
                        audio=audio,
                        format=fmt,
                        deadline=cut,
                        forward_headers=request.forward_headers,
                    )
                    try:
                        text = await adapter.transcribe(call)
                    except BadRequest as err:
                        raise BadRequest(err.message, param=where, code=err.code) from None
                    part = Part(type="text", text=text)
                parts.append(part)
            done[id(m)] = msgspec.structs.replace(m, content=parts, edited=m.edited | {"content"})
        if not done:
            return
        messages = [done.get(id(m), m) for m in request.messages]
        at.work.request = msgspec.structs.replace(request, messages=messages)
        at.state.new_turns = tuple(done.get(id(m), m) for m in at.prepared.new_turns)


class _Classify(StepKind[ClassifyStep]):
    """A label into the request's variables and ``metadata``: by the rules, else the model."""

    config = ClassifyStep

    async def awaited(self, at: _At, cut: float) -> int | None:
        cfg = self.settings(at.step)
        if cfg.labels:
            return await super().awaited(at, cut)
        # Rules only: no call.
        text = _last_user_text(at.work.request.messages)
        self._label(cfg, match_rules(at.step.rules, text), at)
        return None

    async def call(self, at: _At, cut: float) -> None:
        cfg = self.settings(at.step)
        work = at.work
        text = _last_user_text(work.request.messages)
        label = match_rules(at.step.rules, text)
        if label is None:
            adapter = at.chain.adapter_for(cfg.adapter)
            request = InferenceRequest(
                request_id=work.request.request_id,
                model=at.chain.model_for(adapter, cfg.model, at.prepared.parsed.model),
                messages=[
                    Message(role="system", content=prompt(cfg.prompt, cfg.labels)),
                    Message(role="user", content=text),
                ],
                deadline=cut,
                max_tokens=cfg.max_tokens,
                temperature=0.0,
                forward_headers=work.request.forward_headers,
            )
            answer, usage = await _collect(adapter, request, at.state)
            work.count(usage)
            label = parse_label(answer, cfg.labels)
        self._label(cfg, label, at)

    @staticmethod
    def _label(cfg: ClassifyStep, label: str | None, at: _At) -> None:
        label = label or cfg.default_label
        at.work.variables[cfg.key] = label
        at.work.metadata[cfg.key] = label
        at.state.labels[cfg.key] = label


class _Route(StepKind[RouteStep]):
    """The next generate step's adapter or model, or a jump (no call)."""

    config = RouteStep

    async def awaited(self, at: _At, cut: float) -> int | None:
        work = at.work
        choice = route_choice(self.settings(at.step), work.variables)
        if choice is None:
            return None
        work.adapter = choice.adapter or work.adapter
        work.model = choice.model or work.model
        return at.chain.plan.goto(choice.goto) if choice.goto is not None else None


class _Generate(StepKind[GenerateStep]):
    """The request as the earlier steps left it, to a route step's choice or the step's."""

    config = GenerateStep

    async def stream(self, at: _At, end: float) -> tuple[Adapter, InferenceRequest]:
        """The request of a generate step: a route step's choice first, then the step's."""
        cfg, work, chain = self.settings(at.step), at.work, at.chain
        adapter = chain.adapter_for(work.adapter or cfg.adapter)
        model = chain.model_for(adapter, work.model or cfg.model, at.prepared.parsed.model)
        work.adapter = work.model = None  # a route step's choice is for the next one only
        base = work.request
        request = msgspec.structs.replace(
            base,
            model=model,
            deadline=end,
            variables=work.variables,
            extra=_with_metadata(base.extra, work.metadata),
        )
        if adapter is not chain.route_adapter:
            request = await adapter.prepare(request)  # fitted to that model's window
        return adapter, request


class _Rewrite(StepKind[RewriteStep]):
    """The draft rewritten: by a model (a call), or through a policy's output filter."""

    config = RewriteStep

    async def awaited(self, at: _At, cut: float) -> int | None:
        cfg = self.settings(at.step)
        if cfg.policy is None:
            return await super().awaited(at, cut)
        at.work.draft = at.chain.filter_draft(cfg.policy, at.prepared.policy, at.work.draft)
        return None

    async def stream(self, at: _At, end: float) -> tuple[Adapter, InferenceRequest]:
        cfg, work = self.settings(at.step), at.work
        adapter = at.chain.adapter_for(cfg.adapter)
        request = InferenceRequest(
            request_id=work.request.request_id,
            model=at.chain.model_for(adapter, cfg.model, at.prepared.parsed.model),
            messages=[
                Message(role="system", content=cfg.system_prompt),
                Message(role="user", content=work.draft),
            ],
            deadline=end,
            max_tokens=work.request.max_tokens,
            variables=work.variables,
            forward_headers=work.request.forward_headers,
        )
        return adapter, request


#: Each step kind's behaviour, by the ``kind`` of its table (as ``policies.registry`` keeps
#: policy kinds): the executor looks a step up here instead of testing its type.
STEP_KINDS: Mapping[str, StepKind[Any]] = {
    "transcribe": _Transcribe(),
    "classify": _Classify(),
    "route": _Route(),
    "generate": _Generate(),
    "rewrite": _Rewrite(),
}


def _rewrite_policy(step: PlannedStep) -> str:
    """The policy of a rewrite that filters the streaming step's answer."""
    name = STEP_KINDS["rewrite"].settings(step).policy
    assert name is not None
    return str(name)


async def _collect(
    adapter: Adapter, request: InferenceRequest, state: ChainRun
) -> tuple[str, Usage | None]:
    """An awaited call: its whole text and its usage.

    The call is recorded for the request's bill however it ends (finished, cut by its
    step's deadline, failed, the client gone): the chain's final delta folds it into
    its usage when the streaming step finishes with one, and when it does not (the
    reply was cut) the call is billed on its own (:attr:`ChainReport.calls`).
    """
    sink = _Collect()
    try:
        await adapter.stream(request, sink)
    finally:
        config = getattr(adapter, "config", None)
        tokenizer = getattr(config, "tokenizer", None)
        state.calls.append(
            SideCall(
                model=request.model,
                request=request,
                tokenizer=tokenizer if isinstance(tokenizer, str) else None,
                usage=sink.usage,
                generated=sink.generated,
                generated_chars=sink.chars,
                text=sink.text,
            )
        )
    return sink.text, sink.usage


def _audio_of(part: Part, where: str) -> tuple[bytes, str]:
    """The bytes and format of an ``input_audio`` part.

    Raises:
        BadRequest: naming the part: not ``{"input_audio": {"data", "format"}}``,
            a format other than wav or mp3, data that is not base64.
    """
    try:
        decoded = _audio_part.decode(part.raw) if part.raw is not None else None
    except msgspec.DecodeError:
        decoded = None
    if decoded is None:
        raise BadRequest(
            f'`{where}` must be {{"type": "input_audio", "input_audio": {{"data", "format"}}}}',
            param=where,
            code="invalid_audio",
        )
    fmt = decoded.input_audio.format
    if fmt not in FORMATS:
        raise BadRequest(
            f"`{where}.input_audio.format` must be one of {', '.join(FORMATS)}, got {fmt[:20]!r}",
            param=where,
            code="invalid_audio",
        )
    try:
        audio = base64.b64decode(decoded.input_audio.data, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(
            f"`{where}.input_audio.data` is not base64", param=where, code="invalid_audio"
        ) from None
    return audio, fmt


def build_chain(
    route: RouteConfig, label: str, adapters: Mapping[str, Adapter], config: Config
) -> Chain | None:
    """A route's chain (None for a route without steps), its policies built.

    Raises:
        ConfigError: a policy's settings or rule pack are not valid.
    """
    if not route.steps:
        return None
    rewrites = [s for s in route.steps if isinstance(s, RewriteStep)]
    names = list(dict.fromkeys(s.policy for s in rewrites if s.policy is not None))
    policies = dict(zip(names, config.build_policies(names), strict=True))
    return Chain(label, build_plan(route.steps), adapters[route.adapter], adapters, policies)
