"""The simulator's pure parts: the timing model, fault selection, reply text.

Nothing here does I/O or reads a clock; :mod:`.app` is the shell that sleeps
and writes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

#: Words the simulated model "generates"; each is one output token.
_WORDS = (
    *("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "the"),
    *("gateway", "streams", "every", "token", "in", "order", "and", "keeps", "its"),
    *("deadline", "budget", "under", "control"),
)


@dataclass(frozen=True, slots=True)
class Timing:
    """The simulated latency model (milliseconds)."""

    #: Fixed part of time-to-first-token (queueing, scheduling, first decode step).
    prefill_overhead_ms: float = 5.0
    #: Prefill cost per prompt token.
    prefill_per_token_ms: float = 0.02
    ttft_std_ms: float = 0.0
    #: Inter-token latency between output tokens.
    itl_ms: float = 10.0
    itl_std_ms: float = 0.0
    #: Output length when the request gives no ``max_tokens``.
    output_tokens_mean: float = 32.0
    output_tokens_std: float = 0.0


@dataclass(frozen=True, slots=True)
class Plan:
    """When each output token of one reply is due, in seconds after the request started.

    The first ``reasoning`` tokens are the reasoning; the rest are the visible
    reply (content or a tool call's arguments).
    """

    ttft: float
    gaps: list[float]
    finish_reason: str
    reasoning: int = 0

    @property
    def tokens(self) -> int:
        return len(self.gaps) + 1

    @property
    def visible(self) -> int:
        return self.tokens - self.reasoning

    @property
    def total(self) -> float:
        return self.ttft + sum(self.gaps)


def _normal(rng: random.Random, mean: float, std: float) -> float:
    return rng.gauss(mean, std) if std > 0 else mean


def prefill_delay(timing: Timing, prompt_tokens: int, rng: random.Random) -> float:
    """Seconds until the first token: overhead + prompt tokens x per-token prefill, plus noise."""
    ttft_ms = timing.prefill_overhead_ms + prompt_tokens * timing.prefill_per_token_ms
    return max(0.0, _normal(rng, ttft_ms, timing.ttft_std_ms)) / 1000.0


def plan_reply(
    timing: Timing,
    prompt_tokens: int,
    max_tokens: int | None,
    rng: random.Random,
    *,
    length: int | None = None,
    at_least: int = 1,
    reasoning: int = 0,
) -> Plan:
    """Plan one reply.

    TTFT = overhead + prompt tokens x per-token prefill (plus noise); then
    (tokens - 1) gaps of the inter-token latency (each with noise). Noise never
    makes a time negative.

    The visible length of free text is ``max_tokens`` when given (finish
    ``length``), else drawn from the configured distribution, but at least
    ``at_least`` (finish ``stop``). A reply with a natural ``length`` (JSON, a
    tool call's arguments) has that many tokens, cut to ``max_tokens`` (then
    finish ``length``). ``reasoning`` tokens come first and are not bounded by
    ``max_tokens``.
    """
    ttft = prefill_delay(timing, prompt_tokens, rng)
    if length is not None:
        n = max(1, length if max_tokens is None else min(length, max_tokens))
        finish = "length" if max_tokens is not None and max_tokens < length else "stop"
    elif max_tokens is not None:
        n, finish = max(1, max_tokens), "length"
    else:
        drawn = _normal(rng, timing.output_tokens_mean, timing.output_tokens_std)
        n, finish = max(1, at_least, round(drawn)), "stop"
    gaps = [
        max(0.0, _normal(rng, timing.itl_ms, timing.itl_std_ms)) / 1000.0
        for _ in range(reasoning + n - 1)
    ]
    return Plan(ttft=ttft, gaps=gaps, finish_reason=finish, reasoning=reasoning)


def token_text(i: int) -> str:
    """The ``i``-th output token's text (deterministic, so tests can check it)."""
    word = _WORDS[i % len(_WORDS)]
    return word if i == 0 else " " + word


class FaultSpecError(ValueError):
    """A fault spec (``--fault`` or ``X-Sim-Fault``) is not one the simulator knows."""


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected failure.

    ``kind`` is ``status`` (answer ``status`` before any token, with
    ``Retry-After`` for 429), ``stall`` (stop sending after ``after`` tokens and
    hold the stream open), ``drop`` (close the connection abruptly after
    ``after`` tokens) or ``malformed`` (send a chunk that is not JSON after
    ``after`` tokens, then carry on).
    """

    kind: str
    status: int = 0
    after: int = 0
    retry_after: float | None = None


def parse_fault(spec: str) -> Fault | None:
    """Parse ``429``, ``429:2`` (Retry-After 2 s), ``503``, ``stall:N``, ``drop:N``,
    ``malformed:N`` or ``none``.

    Raises:
        FaultSpecError: anything else.
    """
    spec = spec.strip().lower()
    if spec in ("", "none"):
        return None
    head, _, arg = spec.partition(":")
    try:
        if head.isdigit():
            status = int(head)
            if status != 429 and not 500 <= status <= 599:
                raise FaultSpecError(f"fault status must be 429 or 5xx, got {status}")
            retry_after = float(arg) if arg else (1.0 if status == 429 else None)
            return Fault("status", status=status, retry_after=retry_after)
        if head in ("stall", "drop", "malformed"):
            after = int(arg) if arg else 0
            if after < 0:
                raise FaultSpecError(f"`{head}` needs a token count >= 0, got {after}")
            return Fault(head, after=after)
    except ValueError as exc:
        if isinstance(exc, FaultSpecError):
            raise
        raise FaultSpecError(f"bad fault argument in {spec!r}") from exc
    raise FaultSpecError(
        f"unknown fault {spec!r} (use 429[:secs], 5xx, stall:N, drop:N, malformed:N, none)"
    )


@dataclass(frozen=True, slots=True)
class FaultRates:
    """Random faults by rate (each in [0, 1]), drawn once per request in this order."""

    rate_429: float = 0.0
    rate_5xx: float = 0.0
    status_5xx: int = 503
    rate_stall: float = 0.0
    rate_drop: float = 0.0
    rate_malformed: float = 0.0
    #: Tokens sent before a random stall / drop / malformed chunk.
    after: int = 3
    retry_after: float = 1.0

    def draw(self, rng: random.Random) -> Fault | None:
        x = rng.random()
        for rate, fault in (
            (self.rate_429, Fault("status", status=429, retry_after=self.retry_after)),
            (self.rate_5xx, Fault("status", status=self.status_5xx)),
            (self.rate_stall, Fault("stall", after=self.after)),
            (self.rate_drop, Fault("drop", after=self.after)),
            (self.rate_malformed, Fault("malformed", after=self.after)),
        ):
            if x < rate:
                return fault
            x -= rate
        return None


@dataclass(slots=True)
class SimSettings:
    """Everything configurable about one simulator process."""

    timing: Timing = field(default_factory=Timing)
    rates: FaultRates = field(default_factory=FaultRates)
    #: A fault applied to every request (``--fault``); headers override it.
    fault: Fault | None = None
    models: list[str] = field(default_factory=lambda: ["sim-model"])
    seed: int | None = None
    #: The provider dialects served (``sim/dialect.py``), each under its own paths.
    dialects: tuple[str, ...] = ("anthropic", "azure", "gemini", "bedrock", "responses")


def choose_fault(
    settings: SimSettings,
    header: str | None,
    times: int | None,
    attempt: int,
    rng: random.Random,
) -> Fault | None:
    """The fault for one request attempt.

    Args:
        header: the per-request spec (``X-Sim-Fault`` or the WS ``fault`` field).
        times: apply the requested fault only to the first ``times`` attempts of
            the same request key (``X-Sim-Fault-Times``); ``None``: every attempt.
        attempt: 1-based attempt number of this request key.

    Raises:
        FaultSpecError: ``header`` is not a valid spec.
    """
    if header is not None:
        fault = parse_fault(header)
        if times is not None and attempt > times:
            return None
        return fault
    if settings.fault is not None:
        return settings.fault
    return settings.rates.draw(rng)
