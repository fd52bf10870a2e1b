"""The ``group`` adapter: several deployments of a model, health-aware, with fallbacks.

``[adapters.NAME] kind = "group"`` names other configured adapters as its
``deployments`` (each keeps its own pool and limits) and an ordered list of
``fallbacks`` (other adapters or groups: a smaller model, a mock with a canned
apology). To routes, the pipeline and the inference stage it is one more
:class:`~.base.Adapter`; :meth:`GroupAdapter.attempt` does the choosing.

One request, before its first token::

    plan = balanced order of the deployments available now, then the fallbacks
    for each candidate, in order:
        skip it if the remaining budget cannot fit its expected TTFT
        try it, until its first token or its cut-off (it has had its own P95
        TTFT and the next candidate would no longer fit); a failure or the
        cut-off -> the next candidate
        hedge = true: no token after the deployment's P95 TTFT -> also start
        the next deployment; the first to send a token wins, the other is cancelled
    nothing fits any more -> 504 ``no_fallback_fits`` at once, saying why

After the first token nothing moves: the client has part of this answer, and a
second backend would write a different one after it (as ``retry.py`` says). But
the try is still judged: a reply that breaks off counts against its deployment,
and so does one that *stalls* -- after its first token, ``stall_ms`` without a
delta from the backend (a hung worker sends its first token and then nothing).
The stalled try is cut at once with ``upstream_timeout`` (the client's stream
ends with that error rather than at the deadline) and recorded as a stall, so
the deployment is ejected by its timeout rate or run of failures like any other.
The watch is on the backend, not the client: the time the reply waits for the
client to take a delta is not silence. A try cut by the deadline after its first
token is judged by the same silence, against ``min(stall_ms, half of the time
since its first token)`` (at least :data:`_MIN_STALL`): a reply still flowing at
the deadline is the budget's doing and gets no verdict, one that went quiet is
a stall. A try cut because the client left, or because another try won, is
never judged: neither is the deployment's doing.

The active probe (``probe_interval_ms``) asks what requests ask: by default a
two-token completion (a first token and one after it) that must finish within
``probe_timeout_ms``. ``probe = "models"`` asks the member's own cheap check
instead (``GET /v1/models``), which a server streaming at a byte a second still
answers at once -- and so readmits.

Retries are counted once: the group has ``NO_RETRIES`` on the base and calls
its members' :meth:`~.base.Adapter.attempt` directly, never their ``stream``,
so a member's own ``max_retries`` does not apply inside a group -- moving to
another deployment is the retry, and a backend that just failed is the worst
place to retry within a deadline. Each try is reported to the hook under the
deployment's name (``attempt(deployment, n)``, ``failed(deployment, error)``);
the group's name is reported once, with the error that ends the request.

The member's :meth:`~.base.Adapter.prepare` (its context window) is applied to
the request before that member's try, as the model it is asked of; a request
asks a member for its own first model unless the member serves the one asked.

Who served goes out on the first delta (:class:`~.base.ServedBy`), which the
sse stage writes into the response head.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import trio

from ..core.errors import (
    BadRequest,
    GatewayError,
    NoFallbackFits,
    NoHealthyDeployment,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from ..observability.events import NULL_HOOK, UpstreamHook
from .balance import Candidate, order
from .base import Adapter, Capabilities, Delta, DeltaSink, InferenceRequest, Message, ServedBy
from .health import HealthPolicy, Outliers, State
from .retry import NO_RETRIES, Progress
from .settings import GroupAdapterConfig
from .sidecalls import SideCall, chars_of, record, tokenizer_of

log = logging.getLogger("aiserve_trio.adapters.group")
#: Rounding room in "does it fit": a try cut to leave the next one exactly its
#: expected TTFT must still find it fitting.
_SLACK = 1e-6
#: A try cut by the deadline after its first token is a stall only if its backend was
#: silent at least this long: a few ordinary inter-token gaps are not a hang.
_MIN_STALL = 0.25

__all__ = ["GroupAdapter", "Member", "carries", "policy_from_config"]


@dataclass(frozen=True, slots=True)
class Member:
    """A candidate of a group: one of its deployments, or a fallback."""

    adapter: Adapter
    #: 0: a deployment; n: the n-th fallback.
    fallback: int
    weight: float = 1.0
    #: Expected TTFT (seconds) before any is measured.
    prior_ttft: float = 0.5

    @property
    def name(self) -> str:
        return self.adapter.name


def policy_from_config(config: GroupAdapterConfig) -> HealthPolicy:
    """The health policy the ``[adapters.NAME]`` table of a group sets."""
    return HealthPolicy(
        window=config.window_s,
        min_requests=config.min_requests,
        max_error_rate=config.max_error_rate,
        max_timeout_rate=config.max_timeout_rate,
        consecutive_failures=config.consecutive_failures,
        max_ttft_p95=config.max_ttft_p95_ms / 1000.0 if config.max_ttft_p95_ms else None,
        base_ejection=config.base_ejection_ms / 1000.0,
        max_ejection=config.max_ejection_ms / 1000.0,
        max_ejected_percent=float(config.max_ejected_percent),
    )


class _NoSpan:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_SPAN = _NoSpan()


class _GroupHook:
    """The hook the base class sees: the group's outer try is not an upstream attempt.

    The base wraps :meth:`GroupAdapter.attempt` in ``hook.attempt(group, 1)``;
    the tries inside it are reported per deployment, so the outer one is left
    out (each attempt counted once). Retries and the final error pass through.
    """

    def __init__(self, inner: UpstreamHook) -> None:
        self.inner = inner

    def attempt(self, adapter: str, number: int) -> _NoSpan:
        return _NO_SPAN

    def retrying(self, adapter: str, error: UpstreamError) -> None:
        self.inner.retrying(adapter, error)

    def failed(self, adapter: str, error: UpstreamError) -> None:
        self.inner.failed(adapter, error)

    def tls_handshake(self, adapter: str, kind: str) -> None:
        self.inner.tls_handshake(adapter, kind)


def carries(caps: Capabilities, request: InferenceRequest) -> bool:
    """Whether a backend with ``caps`` can carry ``request`` (fallbacks may carry less)."""
    if caps.fields is not None:
        if not all(caps.carries(key) for key in request.extra):
            return False
        if "tools" not in caps.fields and any(
            m.tool_calls or m.role == "tool" for m in request.messages
        ):
            return False
    if caps.parts is not None:
        return all(m.part_types() <= caps.parts for m in request.messages)
    return True


def _common(caps: list[Capabilities]) -> Capabilities:
    """What every one of ``caps`` carries."""
    fields: frozenset[str] | None = None
    parts: frozenset[str] | None = None
    for c in caps:
        if c.fields is not None:
            fields = c.fields if fields is None else fields & c.fields
        if c.parts is not None:
            parts = c.parts if parts is None else parts & c.parts
    return Capabilities(fields=fields, parts=parts, embeddings=False)


class _Try:
    """One member's try within a request."""

    __slots__ = (
        "done", "error", "first_at", "member", "model", "number", "quiet_since", "scope",
        "started", "trimmed",
    )  # fmt: skip

    def __init__(
        self, member: Member, number: int, started: float, cutoff: float, request: InferenceRequest
    ) -> None:
        self.member = member
        #: The model the member is asked for (a fallback may serve another).
        self.model = request.model
        self.number = number
        self.started = started
        #: Messages the member's ``prepare`` dropped (for ``X-Aiserve-Trimmed-Messages``).
        self.trimmed = request.trimmed
        #: Cancelled at the cut-off unless a token came first; then at ``stall_ms``
        #: after the backend's last delta (the stall watch).
        self.scope = trio.CancelScope(deadline=cutoff)
        self.first_at: float | None = None
        #: Since when the backend has been asked for its next delta and sent none
        #: (after the first token; the client's pace is not counted).
        self.quiet_since: float | None = None
        self.error: GatewayError | None = None
        self.done = False


class _Race:
    """The tries of one request, and the one that won."""

    __slots__ = ("broken", "changed", "hedged", "skipped", "tries", "winner")

    def __init__(self) -> None:
        self.tries: list[_Try] = []
        self.winner: _Try | None = None
        #: The winner's error after its first token (the reply is broken; nothing moves).
        self.broken: GatewayError | None = None
        #: A hedge was considered (one per request: its timer fires once).
        self.hedged = False
        #: Set when a try got its first token or ended (the loop then decides).
        self.changed = trio.Event()
        #: (candidate, its expected TTFT, the budget left) for each one that did not fit.
        self.skipped: list[tuple[str, float, float]] = []

    def live(self) -> list[_Try]:
        return [t for t in self.tries if not t.done]

    def wake(self) -> None:
        self.changed.set()


class _TrySink:
    """Where a member's try sends its deltas: the race's judge, then the reply."""

    __slots__ = ("_out", "_race", "_stall", "_try", "finished", "lost")

    def __init__(self, race: _Race, t: _Try, out: DeltaSink, stall: float) -> None:
        self._race = race
        self._try = t
        self._out = out
        #: Seconds of silence after the first token that cut the try (inf: never).
        self._stall = stall
        self.finished = False
        #: The first delta of a try that lost the race (billed, never delivered).
        self.lost: Delta | None = None

    async def send(self, value: Delta, /) -> None:
        t, race = self._try, self._race
        if t.first_at is None:
            t.first_at = trio.current_time()
            if race.winner is None:
                # No checkpoint between the test and the claim: exactly one winner.
                race.winner = t
                for other in race.tries:
                    if other is not t:
                        other.scope.cancel(reason=f"{t.member.name} sent the first token")
                race.wake()
                value = GroupAdapter.stamp(value, t)
            else:
                # Lost the race: the winner cancelled this try's scope, so this
                # raises Cancelled at once and the token never reaches the client.
                self.lost = value
                await trio.sleep_forever()
        if value.finish_reason is not None:
            self.finished = True
        # Waiting for the client to take the delta is not the backend's silence.
        t.scope.deadline = math.inf
        t.quiet_since = None
        await self._out.send(value)
        if not self.finished:
            t.quiet_since = trio.current_time()
            t.scope.deadline = t.quiet_since + self._stall


class _ProbeSink:
    """Where a probe's completion goes: only whether it finished matters."""

    __slots__ = ("finished",)

    def __init__(self) -> None:
        self.finished = False

    async def send(self, value: Delta, /) -> None:
        if value.finish_reason is not None:
            self.finished = True


class GroupAdapter(Adapter):
    """Deployments of a model behind one adapter, with health, hedging and fallbacks."""

    def __init__(
        self,
        name: str,
        config: GroupAdapterConfig,
        members: list[Member],
        *,
        hook: UpstreamHook = NULL_HOOK,
        rng: random.Random | None = None,
    ) -> None:
        """Build the group over adapters already built (and opened by the app on their own).

        Args:
            name: the ``[adapters.NAME]`` key.
            config: its table.
            members: its deployments (``fallback == 0``) then its fallbacks in order.
            hook: told of each try, per deployment, and of the error that ends a request.
            rng: the balancer's randomness (tests seed it).
        """
        super().__init__(name, config.models, policy=NO_RETRIES, hook=_GroupHook(hook), rng=rng)
        self.config = config
        self.events = hook
        self.members = members
        self.deployments = [m for m in members if m.fallback == 0]
        self.fallbacks = [m for m in members if m.fallback > 0]
        self.health = Outliers(policy_from_config(config))
        for m in members:
            self.health.add(m.name, m.prior_ttft, counted=m.fallback == 0)
        self.outstanding = dict.fromkeys((m.name for m in members), 0)
        #: Requests planned: tied deployments take turns by it.
        self._turn = -1
        self._probes: trio.CancelScope | None = None
        # The route refuses what the group's own deployments cannot carry;
        # a fallback that carries less is skipped for such a request.
        self.capabilities = _common([m.adapter.capabilities for m in self.deployments])
        # Native only when every deployment speaks it: a fallback must take the same body.
        self.speaks = frozenset.intersection(*(m.adapter.speaks for m in self.deployments))

    # --- lifetime --------------------------------------------------------------

    async def aopen(self, nursery: trio.Nursery) -> None:
        """Start the active probe if ``probe_interval_ms`` is set (members open themselves)."""
        if self.config.probe_interval_ms > 0:
            await nursery.start(self._probe_loop)

    async def aclose(self) -> None:
        """Stop the probe (the members close themselves)."""
        if self._probes is not None:
            self._probes.cancel(reason="adapter closed")

    async def ready(self) -> bool:
        """Ready while some deployment or fallback may take a request."""
        now = trio.current_time()
        return any(self.health.available(m.name, now) for m in self.members)

    async def _probe_loop(self, *, task_status: trio.TaskStatus[None]) -> None:
        every = self.config.probe_interval_ms / 1000.0
        # Its own scope: aclose ends it, whoever owns the nursery it runs in.
        with trio.CancelScope() as self._probes:
            task_status.started()
            while True:
                await trio.sleep(every)
                async with trio.open_nursery() as probes:
                    for m in self.deployments:
                        probes.start_soon(self._probe, m)

    async def _probe(self, member: Member) -> None:
        ok = False
        bound = self.config.probe_timeout_ms / 1000.0
        with trio.move_on_after(bound) as timer:
            try:
                if self.config.probe == "models":
                    ok = await member.adapter.probe()
                else:
                    ok = await self._complete_two_tokens(member, trio.current_time() + bound)
            except Exception:  # a probe must never take the app down
                log.debug("probe of %s failed", member.name, exc_info=True)
        now = trio.current_time()
        state = self.health.probed(member.name, now, ok, timeout=timer.cancelled_caught)
        self._changed(member.name, state)

    async def _complete_two_tokens(self, member: Member, deadline: float) -> bool:
        """A two-token completion from ``member``, whole by ``deadline``: what a request
        needs of it, so a server that answers its listing but not its streams fails.

        Two, not one: a worker that sends its first token and then hangs would
        pass a one-token probe, its first token being its last.
        """
        ask = InferenceRequest(
            request_id=f"probe-{self.name}-{member.name}",
            model=self.models[0],
            messages=[Message(role="user", content="ping")],
            deadline=deadline,
            max_tokens=2,
        )
        sink = _ProbeSink()
        await member.adapter.attempt(
            await member.adapter.prepare(self._for(member, ask)), sink, Progress()
        )
        return sink.finished

    def _changed(self, name: str, state: State) -> None:
        if state is not State.HEALTHY:
            log.info("group %s: deployment %s is %s", self.name, name, state.name.lower())

    def states(self, now: float) -> Iterator[tuple[str, int]]:
        """(member, state) for the ``aiserve_upstream_deployment_state`` gauge."""
        for m in self.members:
            yield m.name, int(self.health.state(m.name, now))

    # --- one request -------------------------------------------------------------

    def plan(self, now: float) -> list[Member]:
        """The candidates of a request starting ``now``: balanced deployments, then fallbacks."""
        ready = [m for m in self.deployments if self.health.available(m.name, now)]
        self._turn += 1
        ranked = order(
            [
                Candidate(
                    m.name, m.weight, self.outstanding[m.name], self.health.expected_ttft(m.name)
                )
                for m in ready
            ],
            self.config.balance,
            self.rng,
            self._turn,
        )
        by_name = {m.name: m for m in ready}
        firsts = [by_name[n] for n in ranked]
        return firsts + [m for m in self.fallbacks if self.health.available(m.name, now)]

    @staticmethod
    def stamp(first: Delta, t: _Try) -> Delta:
        """The winner's first delta, saying who served and as which model (a nested
        group's leaf kept)."""
        inner = first.served
        served = ServedBy(
            deployment=inner.deployment if inner is not None else t.member.name,
            fallback=t.member.fallback,
            trimmed=inner.trimmed if inner is not None else t.trimmed,
        )
        return msgspec.structs.replace(first, served=served, model=first.model or t.model)

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        """Pick, try, fail over, hedge (see the module docstring).

        Raises:
            NoFallbackFits: tries failed and no candidate left fits the remaining budget.
            NoHealthyDeployment: no deployment or fallback could take the request.
            UpstreamError: the last try's error, when every candidate was tried.
            BadRequest: no candidate can take the request as it is (its context window).
        """
        race = _Race()
        pending = self.plan(trio.current_time())
        refused: list[BadRequest] = []
        async with trio.open_nursery() as nursery:
            while race.winner is None:
                # A fresh event before looking: a change from here on wakes the wait.
                race.changed = trio.Event()
                live = race.live()
                if not live:
                    started = await self._start(nursery, race, pending, request, send, refused)
                    if started is None:
                        break
                    live = [started]
                hedge_at = math.inf
                if self.config.hedge and not race.hedged and len(live) == 1:
                    t = live[0]
                    hedge_at = t.started + self.health.window(t.member.name).ttft_p95(t.started)
                with trio.move_on_at(hedge_at) as timer:
                    await race.changed.wait()
                if timer.cancelled_caught:
                    race.hedged = True
                    if race.winner is None and pending and pending[0].fallback == 0:
                        await self._start(
                            nursery, race, pending, request, send, refused, deployments_only=True
                        )
        if race.broken is not None:
            raise race.broken
        if race.winner is not None:
            return
        raise self._final_error(race, refused)

    def _expected(self, member: Member) -> float:
        return self.health.expected_ttft(member.name)

    async def _start(
        self,
        nursery: trio.Nursery,
        race: _Race,
        pending: list[Member],
        request: InferenceRequest,
        out: DeltaSink,
        refused: list[BadRequest],
        *,
        deployments_only: bool = False,
    ) -> _Try | None:
        """Start the next candidate that fits the remaining budget; None when none is left."""
        while pending:
            if deployments_only and pending[0].fallback > 0:
                return None
            member = pending.pop(0)
            now = trio.current_time()
            left = request.deadline - now
            expected = self._expected(member)
            if expected > left + _SLACK:
                # It could not send a token in time: never started (the budget only shrinks).
                race.skipped.append((member.name, expected, left))
                continue
            if not carries(member.adapter.capabilities, request):
                continue
            if request.native is not None and request.native_api not in member.adapter.speaks:
                continue  # a fallback that cannot take the client's own body
            try:
                mine = (
                    self._for(member, request)
                    if request.native is not None  # the client fits its own context
                    else await member.adapter.prepare(self._for(member, request))
                )
            except BadRequest as exc:  # e.g. its context window is too small
                refused.append(exc)
                continue
            cutoff = self._cutoff(member, pending, now, request.deadline)
            t = _Try(member, len(race.tries) + 1, now, cutoff, mine)
            race.tries.append(t)
            self.health.begin(member.name, now)
            nursery.start_soon(self._run, race, t, mine, out)
            return t
        return None

    def _cutoff(self, member: Member, pending: list[Member], now: float, deadline: float) -> float:
        """When a try of ``member`` starting ``now`` is too slow: it has had its own P95
        TTFT and waiting longer would leave the next candidate that fits now less
        than its usual whole reply (its TTFT alone would leave it a cut stream).

        If the next candidate's room runs out before ``member`` is even overdue,
        the try is not cut (inf): it is the better bet, and the request commits to it.
        """
        left = deadline - now
        for nxt in pending:
            if self._expected(nxt) <= left + _SLACK:
                room = max(self._expected(nxt), self.health.expected_reply(nxt.name))
                cut = deadline - min(room, left)
                overdue = now + self.health.window(member.name).ttft_p95(now)
                return cut if cut >= overdue else math.inf
        return math.inf

    @staticmethod
    def _for(member: Member, request: InferenceRequest) -> InferenceRequest:
        models = member.adapter.models
        if request.model in models or not models:
            return request
        # A fallback serving another model (a smaller one) is asked for its own.
        return msgspec.structs.replace(request, model=models[0])

    async def _run(self, race: _Race, t: _Try, request: InferenceRequest, out: DeltaSink) -> None:
        """One member's try: report it, record its health, wake the loop when it settles.

        Raises nothing but Cancelled: an error is kept on the try (or, after the
        first token, on the race), so the nursery never wraps it in a group.
        """
        name = t.member.name
        stall = self.config.stall_ms / 1000.0 if self.config.stall_ms else math.inf
        sink = _TrySink(race, t, out, stall)
        # A group inside a group reports its own deployments' tries.
        nested = isinstance(t.member.adapter, GroupAdapter)
        self.outstanding[name] += 1
        verdict = False
        try:
            with _NO_SPAN if nested else self.events.attempt(name, t.number):
                with t.scope:
                    await t.member.adapter.attempt(request, sink, Progress())
                    if not sink.finished:
                        raise UpstreamProtocolError(
                            f"{name}: the model backend ended the reply without finishing it"
                        )
                if t.scope.cancelled_caught and t.first_at is None and race.winner is None:
                    waited = trio.current_time() - t.started
                    raise UpstreamTimeout(
                        f"{name}: no first token after {waited * 1000:.0f} ms; "
                        "moved on while the next candidate still fit the budget"
                    )
                if t.scope.cancelled_caught and race.winner is t:
                    # The stall watch: a token, then stall_ms of the backend's silence.
                    silent = trio.current_time() - (t.quiet_since or t.started)
                    raise UpstreamTimeout(
                        f"{name}: stalled, no token for {silent * 1000:.0f} ms after the first"
                    )
            if not t.scope.cancelled_caught:
                self._record(t, ok=True)
                verdict = True
        except GatewayError as err:
            t.error = err
            if isinstance(err, UpstreamError):
                # Broken off once the budget had run out (it was sent the time left):
                # judged as the cancel at the deadline below would judge it.
                now = trio.current_time()
                late = now >= request.deadline
                if not late:
                    stalled = t.first_at is not None and isinstance(err, UpstreamTimeout)
                    self._record(
                        t, ok=False, timeout=isinstance(err, UpstreamTimeout), stalled=stalled
                    )
                    verdict = True
                else:
                    verdict = self._judge_cut(race, t, now, stall)
                self.events.failed(name, err)
            if t.first_at is not None:
                race.broken = err
        except trio.Cancelled:
            now = trio.current_time()
            if now >= request.deadline:  # not the client leaving, nor another try winning
                verdict = self._judge_cut(race, t, now, stall)
            raise
        finally:
            self.outstanding[name] -= 1
            if not verdict:
                self.health.abandon(name)
            if t.scope.cancelled_caught and race.winner is not t:
                self._bill_abandoned(t, request, sink.lost)
            t.done = True
            race.wake()

    @staticmethod
    def _bill_abandoned(t: _Try, request: InferenceRequest, lost: Delta | None) -> None:
        """A try the group cut that did not serve (a hedge that lost the race, or a try
        it moved on from): the provider read its prompt, so the request is billed for it
        -- its usage if it came, else its prompt counted locally and any token that came
        (``adapters/sidecalls.py``). A nested group's try is billed here once: the
        tries inside it end by this cancel, not by their own scopes."""
        adapter = t.member.adapter
        record(
            SideCall(
                model=t.model,
                request=request,
                tokenizer=tokenizer_of(adapter),
                usage=lost.usage if lost is not None else None,
                generated=lost.tokens if lost is not None else 0,
                generated_chars=chars_of(lost) if lost is not None else 0,
                text=lost.text if lost is not None else "",
            )
        )

    def _judge_cut(self, race: _Race, t: _Try, now: float, stall: float) -> bool:
        """Judge a try the deadline cut (or broke off as it passed); True if judged.

        Before its first token the whole budget went by: a timeout. After it, the
        serving try is a stall if its backend had been silent for ``min(stall,
        half the time since its first token)`` (at least :data:`_MIN_STALL`); a
        reply still flowing gets no verdict (the budget ended it), nor does a try
        that lost the race.
        """
        if t.first_at is None:
            self._record(t, ok=False, timeout=True)
            return True
        if race.winner is not t or t.quiet_since is None:
            return False
        limit = min(stall, max(_MIN_STALL, (now - t.first_at) / 2))
        if now - t.quiet_since < limit:
            return False
        self._record(t, ok=False, stalled=True)
        return True

    def _record(self, t: _Try, *, ok: bool, timeout: bool = False, stalled: bool = False) -> None:
        now = trio.current_time()
        ttft: float | None = (t.first_at if t.first_at is not None else now) - t.started
        if not ok and not timeout and t.first_at is None:
            ttft = None  # failed fast: says nothing of its TTFT
        state = self.health.record(
            t.member.name, now, ok, ttft, timeout=timeout, stalled=stalled, duration=now - t.started
        )
        self._changed(t.member.name, state)

    def _final_error(self, race: _Race, refused: list[BadRequest]) -> GatewayError:
        failed = [t for t in race.tries if t.error is not None]
        tried = "; ".join(f"{t.member.name}: {t.error.message}" for t in failed if t.error)
        if race.skipped:
            name, expected, left = race.skipped[0]
            why = (
                f"no fallback fits the remaining budget: {max(left, 0) * 1000:.0f} ms left, "
                f"{name} expects {expected * 1000:.0f} ms to its first token"
            )
            return NoFallbackFits(f"{self.name}: {why}" + (f" (tried {tried})" if tried else ""))
        if failed and failed[-1].error is not None:
            return failed[-1].error
        if refused:
            return refused[0]
        return NoHealthyDeployment(
            f"{self.name}: no deployment or fallback can take this request now "
            "(ejected after failures, or none carries what it asks for)"
        )
