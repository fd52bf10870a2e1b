"""A chain's plan, its budget and its decisions (pure: no I/O, no clock reads).

**Which step streams.** Only the last ``generate`` step or model ``rewrite`` (the
*streaming step*) writes to the client; every step before it is awaited. A
``rewrite`` step with a ``policy`` after the streaming step filters its stream
(the policy's output filter, so only a bounded tail is held back); before it, it
filters the awaited draft.

**The budget.** A chain runs inside the inference stage: its budget is the time
from when the chain starts to the inference cut point (``core/budgets.py``), time the
context stage did not use included. It is carved like the stages' budget, into
cumulative cut points in step order: a step must be done by ``start + W x (the
shares of the steps up to it)``, so time a step does not use rolls over to the
next, and the streaming step (and the policy steps that filter it) runs until
the inference cut. A step's ``share`` is a share of ``W``; the steps without one
split what the others leave in proportion to :data:`DEFAULT_WEIGHTS` (the
defaults: with every kind present they sum to ``W``, the inference share).
Steps that make no call (rules, ``route``, policy ``rewrite``) weigh nothing and
get no cut point of their own.

**Checks** (:func:`check_chain`), each naming the key: unique names; adapters,
policies and ``goto`` targets that exist; a ``transcribe`` step on an adapter
that can transcribe; models its adapter serves; shares that leave every calling
step something; and a shape with exactly one streaming step -- at least one
``generate``, only policy rewrites after the last streaming-capable step,
rewrites only after a ``generate``, ``goto`` only forward, never past the
streaming step nor over a ``generate``.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..adapters.sidecalls import SideCall
from ..core.messages import Message
from .steps import (
    ClassifyStep,
    GenerateStep,
    RewriteStep,
    RouteChoice,
    RouteStep,
    StepConfig,
    TranscribeStep,
)

if TYPE_CHECKING:
    pass

#: Default shares by kind, for the calling steps that have no ``share``.
DEFAULT_WEIGHTS: Mapping[str, float] = {
    "transcribe": 0.2,
    "classify": 0.1,
    "generate": 0.5,
    "rewrite": 0.2,
}
#: Adapter kinds that answer ``/audio/transcriptions``.
TRANSCRIBING = frozenset({"openai", "mock"})
SHARE_TOLERANCE = 0.001


@dataclass(frozen=True, slots=True)
class AdapterFacts:
    """What the checks need to know of a configured adapter."""

    kind: str
    models: tuple[str, ...]


def calls_model(step: StepConfig) -> bool:
    """Whether the step makes a call (a model, a transcription) and so needs time."""
    if isinstance(step, TranscribeStep | GenerateStep):
        return True
    if isinstance(step, ClassifyStep | RewriteStep):
        return step.calls_model
    return False


def can_stream(step: StepConfig) -> bool:
    """A ``generate`` step or a model ``rewrite``: what may write the answer to the client."""
    return isinstance(step, GenerateStep) or (isinstance(step, RewriteStep) and step.calls_model)


def is_policy_rewrite(step: StepConfig) -> bool:
    return isinstance(step, RewriteStep) and step.policy is not None


# --- checks ---------------------------------------------------------------------


def check_chain(
    steps: Sequence[StepConfig],
    route_adapter: str,
    adapters: Mapping[str, AdapterFacts],
    policies: Collection[str],
) -> tuple[str, str] | None:
    """What is wrong with a route's chain: (the key under the route, why), or None.

    Args:
        steps: the route's ``steps`` (each already checked on its own).
        route_adapter: the route's ``adapter`` (a configured one).
        adapters: every configured adapter.
        policies: every policy name a route may use.
    """
    positions: dict[str, int] = {}
    for j, step in enumerate(steps):
        if step.name in positions:
            earlier = positions[step.name]
            return f"steps[{j}].name", f"{step.name!r} is the name of steps[{earlier}]"
        positions[step.name] = j
    for j, step in enumerate(steps):
        problem = _check_refs(j, step, steps, route_adapter, adapters, policies)
        if problem is not None:
            return problem
    enabled = [j for j, s in enumerate(steps) if s.enabled]
    problem = _check_shape(steps, enabled)
    if problem is not None:
        return problem
    streaming = max(j for j in enabled if can_stream(steps[j]))
    for j in enabled:
        step = steps[j]
        if isinstance(step, RouteStep):
            problem = _check_route(j, step, steps, streaming, positions, route_adapter, adapters)
            if problem is not None:
                return problem
    return _check_shares(steps, enabled)


def _adapter_problem(key: str, name: str, adapters: Mapping[str, AdapterFacts]) -> str | None:
    if name in adapters:
        return None
    known = ", ".join(sorted(adapters)) or "none"
    return f"unknown adapter {name!r} (configured: {known})"


def _model_problem(model: str, adapter: str, adapters: Mapping[str, AdapterFacts]) -> str | None:
    served = adapters[adapter].models
    if model in served:
        return None
    return f"{model!r} is not served by adapter {adapter!r} (models: {', '.join(served)})"


def _check_refs(
    j: int,
    step: StepConfig,
    steps: Sequence[StepConfig],
    route_adapter: str,
    adapters: Mapping[str, AdapterFacts],
    policies: Collection[str],
) -> tuple[str, str] | None:
    """The adapters, models and policies one step names exist and fit."""
    key = f"steps[{j}]"
    if isinstance(step, RouteStep):
        for where, choice in _choices(step):
            if choice.adapter is not None:
                why = _adapter_problem(where, choice.adapter, adapters)
                if why is not None:
                    return f"{key}.{where}.adapter", why
            if choice.model is not None:
                target = choice.adapter or _next_generate_adapter(j, steps) or route_adapter
                why = _model_problem(choice.model, target, adapters)
                if why is not None:
                    return f"{key}.{where}.model", why
        return None
    if isinstance(step, RewriteStep) and step.policy is not None:
        if step.policy not in policies:
            known = ", ".join(sorted(policies)) or "none"
            return f"{key}.policy", f"unknown policy {step.policy!r} (known: {known})"
        return None
    adapter = getattr(step, "adapter", None)
    if adapter is not None:
        why = _adapter_problem(f"{key}.adapter", adapter, adapters)
        if why is not None:
            return f"{key}.adapter", why
    effective = adapter or route_adapter
    if isinstance(step, TranscribeStep):
        kind = adapters[effective].kind
        if kind not in TRANSCRIBING:
            where = f"{key}.adapter" if adapter is not None else key
            why = (
                f"adapter {effective!r} ({kind}) cannot transcribe audio; "
                f"name an adapter of kind {' or '.join(sorted(TRANSCRIBING))}"
            )
            return where, why
        return None  # a transcription model is not one of the chat models
    model = getattr(step, "model", None)
    if model is not None:
        why = _model_problem(model, effective, adapters)
        if why is not None:
            return f"{key}.model", why
    return None


def _choices(step: RouteStep) -> list[tuple[str, RouteChoice]]:
    out = [(f"when.{label}", choice) for label, choice in step.when.items()]
    if step.otherwise is not None:
        out.append(("otherwise", step.otherwise))
    return out


def _next_generate_adapter(j: int, steps: Sequence[StepConfig]) -> str | None:
    for step in steps[j + 1 :]:
        if isinstance(step, GenerateStep) and step.enabled:
            return step.adapter
    return None


def _check_shape(steps: Sequence[StepConfig], enabled: list[int]) -> tuple[str, str] | None:
    """Exactly one streaming step, policy rewrites only after it, rewrites after a generate."""
    if not any(isinstance(steps[j], GenerateStep) for j in enabled):
        return "steps", "a chain needs an enabled `generate` step (the model's answer)"
    streaming = max(j for j in enabled if can_stream(steps[j]))
    seen_generate = False
    for j in enabled:
        step = steps[j]
        if j > streaming and not is_policy_rewrite(step):
            name = steps[streaming].name
            why = (
                f"only policy rewrites may follow {name!r}, the step that streams the answer "
                f"(the last generate or model rewrite); move {step.name!r} before it"
            )
            return f"steps[{j}].kind", why
        if isinstance(step, RewriteStep) and not seen_generate:
            return f"steps[{j}].kind", "a rewrite step needs a generate step before it"
        seen_generate = seen_generate or isinstance(step, GenerateStep)
    return None


def _check_route(
    j: int,
    step: RouteStep,
    steps: Sequence[StepConfig],
    streaming: int,
    positions: Mapping[str, int],
    route_adapter: str,
    adapters: Mapping[str, AdapterFacts],
) -> tuple[str, str] | None:
    """``goto`` goes forward, not past the streaming step nor over a generate step."""
    key = f"steps[{j}]"
    later_generate = any(
        isinstance(s, GenerateStep) and s.enabled for s in steps[j + 1 : streaming + 1]
    )
    for where, choice in _choices(step):
        if (choice.adapter is not None or choice.model is not None) and not later_generate:
            field = "adapter" if choice.adapter is not None else "model"
            return f"{key}.{where}.{field}", "no enabled generate step follows this route step"
        target = choice.goto
        if target is None:
            continue
        at = f"{key}.{where}.goto"
        if target not in positions:
            return at, f"no step is named {target!r} (steps: {', '.join(positions)})"
        t = positions[target]
        if t <= j:
            return at, f"{target!r} is not after this step: a goto only goes forward"
        if t > streaming:
            why = f"{target!r} comes after {steps[streaming].name!r}, the step that streams"
            return at, why
        skipped = [s.name for s in steps[j + 1 : t] if isinstance(s, GenerateStep) and s.enabled]
        if skipped:
            return at, f"a goto to {target!r} would skip the generate step {skipped[0]!r}"
    return None


def _check_shares(steps: Sequence[StepConfig], enabled: list[int]) -> tuple[str, str] | None:
    fixed = sum(s.share for j in enabled if (s := steps[j]).share is not None)
    if fixed > 1.0 + SHARE_TOLERANCE:
        return "steps", f"the enabled steps' shares sum to {fixed:.3f}; at most 1"
    if fixed >= 1.0 - SHARE_TOLERANCE:
        for j in enabled:
            step = steps[j]
            if step.share is None and calls_model(step) and not _streams_last(steps, enabled, j):
                why = "the other steps' shares leave this step no time; give it a `share`"
                return f"steps[{j}].share", why
    return None


def _streams_last(steps: Sequence[StepConfig], enabled: list[int], j: int) -> bool:
    """The streaming step always runs until the inference cut, whatever is left."""
    return j == max(i for i in enabled if can_stream(steps[i]))


# --- the plan ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlannedStep:
    """One enabled step as a request runs it."""

    config: StepConfig
    name: str
    kind: str
    #: Its index in the route's ``steps`` (disabled steps count).
    position: int
    #: Its share of the chain's budget.
    share: float
    #: It makes a call, under a cut point of its own.
    calls: bool
    #: It writes the answer to the client.
    streams: bool
    #: A policy rewrite over the streaming step's answer (runs with it).
    filters: bool
    #: A classify step's rules, compiled.
    rules: tuple[tuple[str, re.Pattern[str]], ...] = ()


@dataclass(frozen=True, slots=True)
class Plan:
    """A route's enabled steps in order, their shares, and where a goto lands."""

    steps: tuple[PlannedStep, ...]
    #: Every step's name (disabled ones too) -> its position in the route's ``steps``.
    positions: Mapping[str, int]

    @property
    def streaming(self) -> int:
        """The index (in :attr:`steps`) of the step that streams."""
        return next(i for i, s in enumerate(self.steps) if s.streams)

    @property
    def transcribes(self) -> bool:
        return any(s.kind == "transcribe" for s in self.steps)

    def cuts(self, start: float, end: float) -> tuple[float, ...]:
        """Each step's absolute cut point for a chain that starts at ``start`` and
        must be done by ``end`` (cumulative; the streaming step's and later are ``end``)."""
        width = max(0.0, end - start)
        out: list[float] = []
        total = 0.0
        streaming = self.streaming
        for i, step in enumerate(self.steps):
            total += step.share
            out.append(end if i >= streaming else start + width * min(1.0, total))
        return tuple(out)

    def goto(self, target: str) -> int:
        """The index (in :attr:`steps`) a ``goto`` to ``target`` continues at: the
        target, or the first enabled step after it when it is disabled."""
        at = self.positions[target]
        return next(i for i, s in enumerate(self.steps) if s.position >= at)


def build_plan(steps: Sequence[StepConfig]) -> Plan:
    """The plan of a checked chain (:func:`check_chain` found nothing wrong)."""
    enabled = [(j, s) for j, s in enumerate(steps) if s.enabled]
    streaming = max(j for j, s in enabled if can_stream(s))
    fixed = sum(s.share for _, s in enabled if s.share is not None)
    rest = max(0.0, 1.0 - fixed)
    weights = {j: DEFAULT_WEIGHTS[s.KIND] for j, s in enabled if s.share is None and calls_model(s)}
    total = sum(weights.values())
    planned = []
    for j, step in enabled:
        if step.share is not None:
            share = step.share
        elif j in weights:
            share = rest * weights[j] / total
        else:
            share = 0.0
        rules: tuple[tuple[str, re.Pattern[str]], ...] = ()
        if isinstance(step, ClassifyStep):
            rules = tuple((r.label, re.compile(r.pattern, re.I)) for r in step.rules)
        planned.append(
            PlannedStep(
                config=step,
                name=step.name,
                kind=step.KIND,
                position=j,
                share=share,
                calls=calls_model(step),
                streams=j == streaming,
                filters=j > streaming,
                rules=rules,
            )
        )
    return Plan(steps=tuple(planned), positions={s.name: j for j, s in enumerate(steps)})


def match_rules(rules: Sequence[tuple[str, re.Pattern[str]]], text: str) -> str | None:
    """The label of the first rule whose pattern is found in ``text``."""
    for label, pattern in rules:
        if pattern.search(text):
            return label
    return None


def route_choice(step: RouteStep, variables: Mapping[str, str]) -> RouteChoice | None:
    """What a route step does, given the request's variables (labels included)."""
    return step.choice(variables.get(step.on))


# --- what a request's chain did ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepRun:
    """One step as it ran in one request."""

    name: str
    kind: str
    #: Clock seconds (``trio.current_time()``) it began and ended.
    started: float
    ended: float
    #: ``ok``, the code of the error that ended it, or ``cancelled``.
    result: str


@dataclass(frozen=True, slots=True)
class ChainReport:
    """What a request's chain did: read by the observer, the recording and the session
    write-back once the request has ended."""

    #: The steps that ran, in order (skipped and disabled ones are absent).
    steps: tuple[StepRun, ...]
    #: What the classify steps decided, by their ``key`` (also in the request's ``metadata``).
    labels: Mapping[str, str]
    #: The request's own turns after transcription (audio parts as their text), for
    #: the session; None when no step changed them.
    new_turns: tuple[Message, ...] | None = None
    #: The steps' calls the reply's usage does not count (it never came with the
    #: final delta, which folds them in when it does): billed on their own.
    calls: tuple[SideCall, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.steps)
