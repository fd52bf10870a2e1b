"""When each replayed request is sent and which record it is (pure).

A replay is a sequence of :class:`Slot`: the request's number, its send time in
seconds after the replay starts (None: as soon as a worker is free, under
``--concurrency``), and the record it sends. The times come from one of:

- :func:`recorded` -- the recording's own arrival times divided by ``--speed``
  (a replay longer than the recording plays its time line again, one mean gap
  after its end);
- :func:`fixed_rate` -- one request every ``1 / --rate`` seconds;
- :func:`unpaced` -- no times: ``--concurrency`` workers send back to back.

Which record fills a slot is the caller's ``pick(n)``: the n-th record of the
recording in order, or a draw by weight (``weights.py``) -- so with weights the
recording still gives the arrival pattern and the weights give the mix.
:func:`plan` stops at ``--max-requests`` or at ``--duration``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Slot:
    """One request of the replay."""

    n: int
    #: Seconds after the replay's start; None: unpaced.
    at: float | None
    #: Index of the record it sends.
    record: int


def recorded(times: Sequence[float], speed: float = 1.0) -> Iterator[float]:
    """The recording's arrival times (any origin, sorted), from 0, divided by ``speed``;
    looped for as long as it is read.

    Raises:
        ValueError: no times, or ``speed`` is not positive.
    """
    if not times:
        raise ValueError("no arrival times")
    if speed <= 0:
        raise ValueError("speed must be positive")
    return _looped(times, speed)


def _looped(times: Sequence[float], speed: float) -> Iterator[float]:
    first = times[0]
    offsets = [t - first for t in times]
    span = offsets[-1]
    # The next pass starts one mean gap after the last arrival, not on top of it.
    period = span + (span / (len(offsets) - 1) if len(offsets) > 1 else 1.0)
    for loop in itertools.count():
        base = loop * period
        for offset in offsets:
            yield (base + offset) / speed


def fixed_rate(rate: float) -> Iterator[float]:
    """``0, 1/rate, 2/rate, ...``

    Raises:
        ValueError: ``rate`` is not positive.
    """
    if rate <= 0:
        raise ValueError("rate must be positive")
    return (i / rate for i in itertools.count())


def unpaced() -> Iterator[None]:
    return itertools.repeat(None)


def in_order(count: int) -> Callable[[int], int]:
    """``pick`` for a replay without weights: the records in their order, then again."""
    return lambda n: n % count


def plan(
    times: Iterable[float | None],
    pick: Callable[[int], int],
    *,
    max_requests: int | None = None,
    duration: float | None = None,
) -> Iterator[Slot]:
    """The slots of a replay, until ``max_requests`` of them or a time past ``duration``.

    With neither limit it never ends: the caller bounds it (an unpaced replay's
    ``duration`` is checked when a worker takes a slot, not here).
    """
    for n, at in enumerate(times):
        if max_requests is not None and n >= max_requests:
            return
        if duration is not None and at is not None and at >= duration:
            return
        yield Slot(n, at, pick(n))
