"""Deployment health for groups: sliding windows and outlier ejection (sans-IO).

Nothing here reads a clock or does I/O: every method takes ``now`` (seconds on
any monotonic clock; the group passes ``trio.current_time()``), so the windows,
cool-downs and the ejection state machine are tested on plain numbers.

- :class:`HealthWindow` keeps one deployment's recent tries (``record(now, ok,
  ttft)``): error and timeout rates over the last ``window`` seconds, the run of
  consecutive failures, the P95 of its first-token times and an EWMA of them
  (its *expected* TTFT, which decides whether a try still fits the budget).
  A *stall* (a first token, then silence: a hung worker) is a timeout after the
  first token: it counts in the timeout rate and the run of failures like any
  timeout, and its first token is a real TTFT. A timeout before the first token
  is no latency sample: what it waited only pushes the expected TTFT up (a lower
  bound), never the P95, which is the deployment's own give-up point (the
  group's cut-off and hedge delay) -- timeouts that raised it would make each
  next try wait longer before it is given up.
- :class:`Ejection` is the circuit of one deployment, a transition table
  (healthy -> ejected -> probing -> healthy or ejected again). The cool-down is
  ``base x consecutive ejections`` capped at ``max`` (Envoy's outlier detection):
  a deployment that keeps failing stays out longer each time, and one that
  stays healthy earns its count back one ``base`` interval at a time.
- :class:`Outliers` holds a group's deployments and applies the group rule:
  at most ``max_ejected_percent`` of them out at once (at least one when the
  share is not 0), so that a bad minute never empties a group by itself.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum, IntEnum

__all__ = [
    "TRANSITIONS",
    "Ejection",
    "HealthPolicy",
    "HealthWindow",
    "Outliers",
    "Signal",
    "State",
    "WindowStats",
]

#: Tries kept per window at most: the window is "the last N seconds, or the
#: last this many tries when busier", so memory stays bounded at any rate.
MAX_SAMPLES = 1024


class State(IntEnum):
    """A deployment's circuit; the values are the ``aiserve_upstream_deployment_state`` gauge."""

    HEALTHY = 0
    EJECTED = 1
    #: Cool-down over: one trial request (or the active probe) decides.
    PROBING = 2


class Signal(Enum):
    """What can happen to a circuit."""

    #: The window went over a threshold.
    TRIP = "trip"
    #: The cool-down ended.
    COOLED = "cooled"
    #: A trial request or a probe succeeded.
    PASS = "pass"
    #: A trial request or a probe failed.
    FAIL = "fail"


#: The whole state machine: anything not listed changes nothing (a failure of an
#: ejected deployment, a success of a healthy one...).
TRANSITIONS: dict[tuple[State, Signal], State] = {
    (State.HEALTHY, Signal.TRIP): State.EJECTED,
    (State.EJECTED, Signal.COOLED): State.PROBING,
    (State.PROBING, Signal.PASS): State.HEALTHY,
    (State.PROBING, Signal.FAIL): State.EJECTED,
    (State.PROBING, Signal.TRIP): State.EJECTED,
}


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """When a deployment is ejected and for how long (seconds, shares in 0..1)."""

    window: float = 30.0
    #: Rates are judged only over at least this many tries.
    min_requests: int = 5
    max_error_rate: float = 0.5
    max_timeout_rate: float = 0.5
    #: Failures in a row that eject at once (a killed backend fails fast and often).
    consecutive_failures: int = 5
    #: Eject when the window's P95 TTFT exceeds this; None: never for TTFT.
    max_ttft_p95: float | None = None
    base_ejection: float = 5.0
    max_ejection: float = 300.0
    max_ejected_percent: float = 50.0
    #: Weight of the newest TTFT in the expected-TTFT average.
    ttft_alpha: float = 0.3


@dataclass(frozen=True, slots=True)
class WindowStats:
    requests: int
    errors: int
    #: Timeouts before the first token and stalls after it.
    timeouts: int
    consecutive_failures: int
    #: P95 of the window's first-token times; None when it has none.
    ttft_p95: float | None
    #: Of the timeouts, those after a first token (the reply stalled).
    stalls: int = 0

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def timeout_rate(self) -> float:
        return self.timeouts / self.requests if self.requests else 0.0

    def trips(self, policy: HealthPolicy) -> str | None:
        """Why this window ejects its deployment under ``policy``, or None."""
        if self.consecutive_failures >= policy.consecutive_failures:
            return f"{self.consecutive_failures} failures in a row"
        if self.requests >= policy.min_requests:
            if self.error_rate > policy.max_error_rate:
                return f"error rate {self.error_rate:.0%} over {self.requests} tries"
            if self.timeout_rate > policy.max_timeout_rate:
                return f"timeout rate {self.timeout_rate:.0%} over {self.requests} tries"
            limit = policy.max_ttft_p95
            if limit is not None and self.ttft_p95 is not None and self.ttft_p95 > limit:
                return f"P95 TTFT {self.ttft_p95 * 1000:.0f} ms over {limit * 1000:.0f} ms"
        return None


def quantile(values: Iterable[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``values``; None when empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class HealthWindow:
    """One deployment's recent tries."""

    __slots__ = (
        "_alpha", "_samples", "_streak", "expected_reply", "expected_ttft", "prior", "window"
    )  # fmt: skip

    def __init__(self, window: float, prior_ttft: float, alpha: float = 0.3) -> None:
        self.window = window
        self.prior = prior_ttft
        self._alpha = alpha
        #: (when, ok, timed out, stalled, a TTFT sample or None)
        self._samples: deque[tuple[float, bool, bool, bool, float | None]] = deque(
            maxlen=MAX_SAMPLES
        )
        self._streak = 0
        #: EWMA of the first-token times (a timed-out try counts with the time it
        #: was given: a lower bound, so the estimate moves the right way).
        self.expected_ttft = prior_ttft
        #: EWMA of whole successful replies (start to final delta): the room a
        #: candidate needs to answer, not only to begin.
        self.expected_reply = prior_ttft

    def record(
        self,
        now: float,
        ok: bool,
        ttft: float | None,
        *,
        timeout: bool = False,
        stalled: bool = False,
        duration: float | None = None,
    ) -> None:
        """One try ended at ``now``: ``ok`` or not, its TTFT if a token came (or
        the time it waited, for a timeout), and how long a successful one took.

        ``stalled``: it sent a first token (``ttft``), then nothing -- a timeout
        whose TTFT is a real sample. A ``timeout`` before the first token adds
        no TTFT sample to the window (what it waited is no latency), only to the
        expected TTFT's average, as the lower bound it is.
        """
        failed = not ok
        timed_out = failed and (timeout or stalled)
        stall = failed and stalled
        sample = None if timed_out and not stall else ttft
        self._samples.append((now, ok, timed_out, stall, sample))
        self._streak = 0 if ok else self._streak + 1
        if ttft is not None:
            self.expected_ttft += self._alpha * (ttft - self.expected_ttft)
        if ok and duration is not None:
            self.expected_reply += self._alpha * (duration - self.expected_reply)
        self._prune(now)

    def _prune(self, now: float) -> None:
        old = now - self.window
        samples = self._samples
        while samples and samples[0][0] < old:
            samples.popleft()

    def stats(self, now: float) -> WindowStats:
        self._prune(now)
        samples = self._samples
        errors = sum(1 for _, ok, to, _, _ in samples if not ok and not to)
        timeouts = sum(1 for _, _, to, _, _ in samples if to)
        stalls = sum(1 for _, _, _, st, _ in samples if st)
        ttfts = [t for *_, t in samples if t is not None]
        return WindowStats(
            len(samples), errors, timeouts, self._streak, quantile(ttfts, 0.95), stalls
        )

    def ttft_p95(self, now: float) -> float:
        """The window's P95 TTFT, or the prior while it has measured none (the hedge delay)."""
        p95 = self.stats(now).ttft_p95
        return self.prior if p95 is None else p95

    def reset(self) -> None:
        """Forget the window (not the expected TTFT): a readmitted deployment starts clean."""
        self._samples.clear()
        self._streak = 0


class Ejection:
    """One deployment's circuit: :data:`TRANSITIONS` plus the cool-down arithmetic."""

    __slots__ = ("ejections", "healthy_since", "state", "trial", "until")

    def __init__(self) -> None:
        self.state = State.HEALTHY
        #: Consecutive ejections (the cool-down multiplier).
        self.ejections = 0
        #: When an ejection's cool-down ends.
        self.until = 0.0
        self.healthy_since = 0.0
        #: A trial request is in flight while PROBING (one at a time).
        self.trial = False

    def fire(self, signal: Signal, now: float, policy: HealthPolicy) -> State:
        """Apply ``signal`` at ``now``; returns the new state."""
        new = TRANSITIONS.get((self.state, signal))
        if new is None:
            return self.state
        if new is State.EJECTED:
            if self.state is State.HEALTHY:
                # Healthy for k base intervals earns k ejections back.
                earned = int((now - self.healthy_since) // policy.base_ejection)
                self.ejections = max(0, self.ejections - earned)
            self.ejections += 1
            self.until = now + min(policy.base_ejection * self.ejections, policy.max_ejection)
        elif new is State.HEALTHY:
            self.healthy_since = now
        self.state = new
        self.trial = False
        return new

    def poll(self, now: float, policy: HealthPolicy) -> State:
        """The state at ``now`` (an ejection whose cool-down is over becomes PROBING)."""
        if self.state is State.EJECTED and now >= self.until:
            self.fire(Signal.COOLED, now, policy)
        return self.state


@dataclass(slots=True)
class _Tracked:
    window: HealthWindow
    circuit: Ejection
    #: Counted towards max_ejected_percent (a group's deployments; not its fallbacks).
    counted: bool


class Outliers:
    """The health of a group's deployments (and of its fallbacks, for their TTFT)."""

    def __init__(self, policy: HealthPolicy) -> None:
        self.policy = policy
        self._tracked: dict[str, _Tracked] = {}

    def add(self, name: str, prior_ttft: float, *, counted: bool = True) -> None:
        """Track ``name`` (``counted``: it is one of the group's deployments)."""
        window = HealthWindow(self.policy.window, prior_ttft, self.policy.ttft_alpha)
        self._tracked[name] = _Tracked(window, Ejection(), counted)

    def window(self, name: str) -> HealthWindow:
        return self._tracked[name].window

    def state(self, name: str, now: float) -> State:
        return self._tracked[name].circuit.poll(now, self.policy)

    def states(self, now: float) -> list[tuple[str, State]]:
        return [(name, self.state(name, now)) for name in self._tracked]

    def expected_ttft(self, name: str) -> float:
        return self._tracked[name].window.expected_ttft

    def expected_reply(self, name: str) -> float:
        return self._tracked[name].window.expected_reply

    def available(self, name: str, now: float) -> bool:
        """Whether a request may go to ``name`` now (a probing one: if no trial is out)."""
        t = self._tracked[name]
        state = t.circuit.poll(now, self.policy)
        return state is State.HEALTHY or (state is State.PROBING and not t.circuit.trial)

    def begin(self, name: str, now: float) -> None:
        """A request goes to ``name``: if it is probing, this request is its trial."""
        t = self._tracked[name]
        if t.circuit.poll(now, self.policy) is State.PROBING:
            t.circuit.trial = True

    def abandon(self, name: str) -> None:
        """A try ended without a verdict (cancelled): a probing deployment may be tried again."""
        self._tracked[name].circuit.trial = False

    def _ejectable(self, now: float) -> bool:
        counted = [t for t in self._tracked.values() if t.counted]
        out = sum(1 for t in counted if t.circuit.poll(now, self.policy) is not State.HEALTHY)
        pct = self.policy.max_ejected_percent
        allowed = 0 if pct <= 0 else max(1, math.floor(len(counted) * pct / 100.0))
        return out < allowed

    def record(
        self,
        name: str,
        now: float,
        ok: bool,
        ttft: float | None,
        *,
        timeout: bool = False,
        stalled: bool = False,
        duration: float | None = None,
    ) -> State:
        """One try of ``name`` ended; returns its state afterwards."""
        t = self._tracked[name]
        t.window.record(now, ok, ttft, timeout=timeout, stalled=stalled, duration=duration)
        circuit = t.circuit
        state = circuit.poll(now, self.policy)
        if state is State.PROBING and circuit.trial:
            state = circuit.fire(Signal.PASS if ok else Signal.FAIL, now, self.policy)
            if state is State.HEALTHY:
                t.window.reset()
            return state
        tripped = t.window.stats(now).trips(self.policy) is not None
        if state is State.HEALTHY and tripped and (not t.counted or self._ejectable(now)):
            state = circuit.fire(Signal.TRIP, now, self.policy)
        return state

    def probed(self, name: str, now: float, ok: bool, *, timeout: bool = False) -> State:
        """The active probe of ``name`` answered (``ok``) or not, at ``now``
        (``timeout``: not within its bound)."""
        t = self._tracked[name]
        state = t.circuit.poll(now, self.policy)
        if state is State.PROBING:
            state = t.circuit.fire(Signal.PASS if ok else Signal.FAIL, now, self.policy)
            if state is State.HEALTHY:
                t.window.reset()
            return state
        if state is State.HEALTHY and not ok:
            # A failed probe is a failed try (no TTFT): a dead idle deployment is
            # found before a request has to find it.
            return self.record(name, now, False, None, timeout=timeout)
        return state
