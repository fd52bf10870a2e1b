"""The ``[[routes.steps]]`` tables: one msgspec Struct per step kind, a union tagged on ``kind``.

A route with steps is a chain (``RouteConfig.steps``; empty: a plain route)::

    [[routes.steps]]
    name = "asr"            # unique within the route; default: the kind
    kind = "transcribe"     # transcribe | classify | generate | rewrite | route
    enabled = true          # false: skipped (the console toggles this)
    share = 0.2             # optional share of the chain's budget

Each Struct checks its own keys here (msgspec runs ``__post_init__`` while
decoding and names the key); what involves other steps, adapters or policies
is checked by :func:`~.plan.check_chain`. Nothing here imports the config: the
config imports this module.
"""

from __future__ import annotations

import re
from typing import ClassVar

import msgspec

from ..core.decoding import field_error
from ..util.intents import DEFAULT_PROMPT

#: Step names and labels: they become metric label values and header items.
NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
#: Session variable names (as ``sessions.bus.check_vars`` accepts them).
VAR_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
#: A model ``rewrite`` step's default system prompt (the draft is the user message).
REWRITE_PROMPT = (
    "Rewrite the answer below so that a bank may send it to a customer: no interest-rate "
    "figures, no promise of approval, a polite and neutral tone. Keep its meaning and its "
    "language. Answer with the rewritten text only."
)


def _name(key: str, value: str) -> None:
    if not NAME_RE.match(value):
        raise field_error(key, f"must match {NAME_RE.pattern}, got {value!r}")


class _Table(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base: an unknown key is an error (as in every config table)."""


class StepBase(_Table):
    """What every step has."""

    KIND: ClassVar[str] = ""
    #: Unique within the route; default: the kind. In ``X-Aiserve-Steps`` and metrics.
    name: str = ""
    #: A disabled step is skipped (its budget share goes to the others).
    enabled: bool = True
    #: Share of the chain's budget (0, 1]; default: by kind (``plan.DEFAULT_WEIGHTS``).
    share: float | None = None

    def __post_init__(self) -> None:
        if not self.name:
            self.name = self.KIND
        _name("name", self.name)
        if self.share is not None and not 0.0 < self.share <= 1.0:
            raise field_error("share", f"must be in (0, 1], got {self.share}")


class TranscribeStep(StepBase, tag="transcribe", tag_field="kind"):
    """Speech to text: every ``input_audio`` part becomes a text part with its transcript."""

    KIND: ClassVar[str] = "transcribe"
    #: The adapter whose ``/audio/transcriptions`` is called; default: the route's.
    adapter: str | None = None
    #: The model sent to it (``whisper-1``...); default: the adapter's first model.
    model: str | None = None


class ClassifyRule(_Table):
    """``[[routes.steps.rules]]``: a regular expression searched in the customer's message."""

    label: str
    #: Searched case-insensitively in the last user message (after transcription).
    pattern: str

    def __post_init__(self) -> None:
        _name("label", self.label)
        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise field_error("pattern", f"not a regular expression: {exc}") from None


class ClassifyStep(StepBase, tag="classify", tag_field="kind"):
    """Intent: the first rule that matches, else a model call choosing among ``labels``."""

    KIND: ClassVar[str] = "classify"
    #: Where the label goes: this session variable and this key of the request's ``metadata``.
    key: str = "intent"
    rules: list[ClassifyRule] = msgspec.field(default_factory=list)
    #: The labels a model chooses among when no rule matched (none: no model call).
    labels: list[str] = msgspec.field(default_factory=list)
    #: The label when no rule matched and the model gave none of ``labels``.
    default_label: str = "other"
    #: The model call's adapter (default: the route's) and model (default: the
    #: client's if that adapter serves it, else its first).
    adapter: str | None = None
    model: str | None = None
    #: The model call's system prompt; ``{labels}`` becomes the labels, comma-separated.
    prompt: str = DEFAULT_PROMPT
    #: Tokens the model may answer with.
    max_tokens: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        if not VAR_RE.match(self.key):
            raise field_error("key", f"must match {VAR_RE.pattern}, got {self.key!r}")
        if not self.rules and not self.labels:
            raise ValueError("a classify step needs `rules`, `labels` (a model call), or both")
        for i, label in enumerate(self.labels):
            _name(f"labels[{i}]", label)
            if label in self.labels[:i]:
                raise field_error(f"labels[{i}]", f"{label!r} is listed twice")
        _name("default_label", self.default_label)
        if self.labels and "{labels}" not in self.prompt:
            raise field_error("prompt", "must contain `{labels}`, where the labels go")
        if not self.labels and (self.adapter is not None or self.model is not None):
            key = "adapter" if self.adapter is not None else "model"
            raise field_error(key, "is for the model call, which needs `labels`")
        if self.max_tokens < 1:
            raise field_error("max_tokens", "must be positive")

    @property
    def calls_model(self) -> bool:
        return bool(self.labels)


class GenerateStep(StepBase, tag="generate", tag_field="kind"):
    """The model's answer (the route's inference); streamed when it is the chain's last."""

    KIND: ClassVar[str] = "generate"
    #: Default: the route's adapter (or what a ``route`` step chose).
    adapter: str | None = None
    #: Default: the client's model (or what a ``route`` step chose).
    model: str | None = None


class RewriteStep(StepBase, tag="rewrite", tag_field="kind"):
    """Compliance: a policy's output filter over the answer, or a model that rewrites it."""

    KIND: ClassVar[str] = "rewrite"
    #: A policy with an output filter (``no-rate-figures``, a ``compliance`` pack...):
    #: the answer streams through it. Without it the step is a model call.
    policy: str | None = None
    #: The model call: adapter (default: the route's), model, system prompt.
    adapter: str | None = None
    model: str | None = None
    prompt: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.policy is not None:
            for key in ("adapter", "model", "prompt"):
                if getattr(self, key) is not None:
                    raise field_error(key, "is for a model rewrite; a `policy` rewrite has none")

    @property
    def calls_model(self) -> bool:
        return self.policy is None

    @property
    def system_prompt(self) -> str:
        return self.prompt if self.prompt is not None else REWRITE_PROMPT


class RouteChoice(_Table):
    """What a ``route`` step does for one label."""

    #: The adapter (and model) of the next ``generate`` step.
    adapter: str | None = None
    model: str | None = None
    #: Go on at this step (a later one) instead of the next.
    goto: str | None = None

    def __post_init__(self) -> None:
        if self.adapter is None and self.model is None and self.goto is None:
            raise ValueError("say what to do: `adapter`, `model`, `goto`")


class RouteStep(StepBase, tag="route", tag_field="kind"):
    """Choose by a label: the next generate step's adapter or model, or the step to go on at."""

    KIND: ClassVar[str] = "route"
    #: The variable read: a classify step's ``key``, or a session or ``metadata`` variable.
    on: str = "intent"
    #: By label: ``[routes.steps.when.mortgage] adapter = "big"``.
    when: dict[str, RouteChoice] = msgspec.field(default_factory=dict)
    #: For any other label (or none): None goes on unchanged.
    otherwise: RouteChoice | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not VAR_RE.match(self.on):
            raise field_error("on", f"must match {VAR_RE.pattern}, got {self.on!r}")
        if not self.when and self.otherwise is None:
            raise ValueError("a route step needs `when` tables, `otherwise`, or both")
        for label in self.when:
            _name(f"when.{label}", label)

    def choice(self, label: str | None) -> RouteChoice | None:
        """What to do for ``label`` (None: the variable is not set)."""
        if label is not None and label in self.when:
            return self.when[label]
        return self.otherwise


StepConfig = TranscribeStep | ClassifyStep | GenerateStep | RewriteStep | RouteStep

__all__ = [
    "REWRITE_PROMPT",
    "ClassifyRule",
    "ClassifyStep",
    "GenerateStep",
    "RewriteStep",
    "RouteChoice",
    "RouteStep",
    "StepBase",
    "StepConfig",
    "TranscribeStep",
]
