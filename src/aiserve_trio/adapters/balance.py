"""A group's choice of deployment (sans-IO): the order in which to try them.

:func:`order` ranks the deployments a request may use now; the first is tried
first and the rest are the order of failover. The ranking is the whole policy:

- ``least_outstanding`` (default): fewest requests in flight per unit of
  weight. It needs no measurement to react: a deployment that slows down
  accumulates requests and so gets fewer new ones.
- ``weighted``: a weighted random order (Efraimidis-Spirakis keys ``u**(1/w)``),
  so the first choice follows the weights and failover stays weighted too.
- ``lowest_ttft``: the lowest expected time to first token.

Ties in the first two are broken by rotation: the caller counts its requests
(``turn``) and the tied deployments take turns, so a quiet group, whose requests
come one at a time and always find every count at zero, still spreads them and
keeps every deployment's time-to-first-token estimate fresh.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Balance = Literal["least_outstanding", "weighted", "lowest_ttft"]


@dataclass(frozen=True, slots=True)
class Candidate:
    """What the balancer knows of one deployment."""

    name: str
    weight: float
    #: Requests in flight on it from this worker.
    outstanding: int
    #: Seconds (the health window's estimate).
    expected_ttft: float


def order(
    candidates: Sequence[Candidate], balance: Balance, rng: random.Random, turn: int = 0
) -> list[str]:
    """The names of ``candidates`` in the order a request should try them.

    Args:
        rng: the randomness of ``weighted``.
        turn: the caller's count of requests; among tied candidates the one
            ``turn`` places after the first in ``candidates`` goes first.
    """
    if balance == "weighted":
        keyed = [(rng.random() ** (1.0 / c.weight), c.name) for c in candidates]
        return [name for _, name in sorted(keyed, reverse=True)]
    n = len(candidates)
    ranked = [
        (
            c.outstanding / c.weight if balance == "least_outstanding" else c.expected_ttft,
            (i - turn) % n,
            c.name,
        )
        for i, c in enumerate(candidates)
    ]
    return [name for *_, name in sorted(ranked)]
