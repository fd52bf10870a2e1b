"""What one request's chain did: the steps begun and ended, the labels, the new turns.

Its own module so that the stages can name it (``stages/types.py``'s
``StepChain``) without naming the executor, which names the stages' types.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from ..adapters.sidecalls import SideCall
from .plan import ChainReport, PlannedStep, StepRun

if TYPE_CHECKING:
    from ..core.messages import Message


class ChainRun:
    """What one request's chain did so far (owned by the inference stage's task)."""

    __slots__ = ("_open", "calls", "folded", "labels", "last", "new_turns", "started", "steps")

    def __init__(self) -> None:
        #: Names of the steps begun, in order.
        self.started: list[str] = []
        #: The step begun last: the one a deadline that passes names.
        self.last: str | None = None
        self.steps: list[StepRun] = []
        self.labels: dict[str, str] = {}
        self.new_turns: tuple[Message, ...] | None = None
        self._open: dict[str, float] = {}
        #: The model calls of the steps before the streaming one, and whether the
        #: reply's final usage counts them (the chain folded them in).
        self.calls: list[SideCall] = []
        self.folded = False

    def begin(self, name: str) -> None:
        self.started.append(name)
        self.last = name
        self._open[name] = trio.current_time()

    def end(self, step: PlannedStep, result: str) -> None:
        started = self._open.pop(step.name)
        self.steps.append(StepRun(step.name, step.kind, started, trio.current_time(), result))

    def report(self) -> ChainReport:
        return ChainReport(
            steps=tuple(sorted(self.steps, key=lambda s: self.started.index(s.name))),
            labels=dict(self.labels),
            new_turns=self.new_turns,
            calls=() if self.folded else tuple(self.calls),
        )
