"""``--weights``: oversampling classes of a recording (pure).

``intent=sql:3.2,complexity=high:2.8,has_tools:4.0`` gives every record whose
label ``intent`` is ``sql`` a factor 3.2, and so on; ``has_tools:4.0`` (no value)
matches the label whatever its value. A record's weight is the product of the
factors of every rule it matches (1 when none does), so a record that is both
SQL and uses tools weighs 3.2 x 4.0 = 12.8. Records are then drawn with
replacement with probability proportional to their weight: a class's share of
the replay, over its share of the recording, moves by its factor relative to
the unweighted records.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_NAME = r"[a-z][a-z0-9_]*"
_VALUE = r"[^\s,:=]{1,64}"
_RULE = re.compile(rf"^(?P<label>{_NAME})(?:=(?P<value>{_VALUE}))?:(?P<factor>[0-9.eE+-]+)$")


@dataclass(frozen=True, slots=True)
class Weight:
    """One ``label[=value]:factor`` of ``--weights``."""

    label: str
    #: None: any value of the label.
    value: str | None
    factor: float

    def matches(self, labels: Mapping[str, str]) -> bool:
        got = labels.get(self.label)
        return got is not None and (self.value is None or got == self.value)

    def __str__(self) -> str:
        name = self.label if self.value is None else f"{self.label}={self.value}"
        return f"{name}:{self.factor:g}"


def parse_weights(spec: str) -> list[Weight]:
    """The rules of a ``--weights`` value.

    Raises:
        ValueError: a part is not ``label[=value]:factor`` with a finite factor >= 0.
    """
    out = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        m = _RULE.match(part)
        if m is None:
            raise ValueError(f"{part!r} is not label[=value]:factor (e.g. intent=sql:3.2)")
        try:
            factor = float(m["factor"])
        except ValueError:
            raise ValueError(f"{part!r}: {m['factor']!r} is not a number") from None
        if not math.isfinite(factor) or factor < 0:
            raise ValueError(f"{part!r}: the factor must be a finite number >= 0")
        out.append(Weight(m["label"], m["value"], factor))
    return out


def weight_of(labels: Mapping[str, str], weights: Sequence[Weight]) -> float:
    """The product of the factors of the rules ``labels`` match (1.0 for none)."""
    w = 1.0
    for rule in weights:
        if rule.matches(labels):
            w *= rule.factor
    return w


class WeightedSampler:
    """Draws record indices with replacement, in proportion to their weights."""

    def __init__(
        self, labels: Sequence[Mapping[str, str]], weights: Sequence[Weight], rng: random.Random
    ) -> None:
        """Raises:
        ValueError: every record weighs 0 (nothing could be drawn).
        """
        self._cumulative = list(itertools.accumulate(weight_of(lb, weights) for lb in labels))
        if not self._cumulative or self._cumulative[-1] <= 0:
            raise ValueError("the weights leave no record to replay (every weight is 0)")
        self._rng = rng

    def draw(self) -> int:
        total = self._cumulative[-1]
        i = bisect.bisect_right(self._cumulative, self._rng.random() * total)
        # random() < 1, so i < len; min() guards float rounding at the top end.
        return min(i, len(self._cumulative) - 1)
