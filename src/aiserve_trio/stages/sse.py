"""The sse stage: a thin loop around the response assembler and the responder.

It reads deltas from the inference stage and writes what the
:class:`~.assembler.ResponseAssembler` makes of them: an event stream (the
head goes out with the first delta, so that failures before it are still
proper HTTP statuses) or, when the client did not ask to stream, one
``chat.completion`` JSON body. While a stream is open, it sends ``: ping`` when
it has been idle ``heartbeat_s`` and gives up on a client that has taken no byte
for ``write_timeout_ms`` -- in its own task, on the deadlines of one cancel scope
(:class:`_Clock`), not in a keep-alive task beside it.

Deltas the response cache replays (:class:`~aiserve_trio.cache.entry.Replayed`:
a stored reply, or one shared with identical requests) have already been
through the route's output policies: they are framed by an assembler without
filters, into the same chunk shapes, usage and ``[DONE]``.
"""

from __future__ import annotations

import math
from functools import partial
from types import TracebackType

import trio

from ..adapters.base import Delta, InferenceRequest, ServedBy, Usage
from ..cache.entry import Replayed
from ..core.errors import ReplyCapExceeded, StageDeadlineExceeded, WriteTimeout
from ..http.responder import Responder
from ..http.types import JSON_HEADERS, SSE_HEADERS, Headers
from ..security.settings import LimitsConfig
from ..spend.prices import decimal, free
from .assembler import ResponseAssembler
from .billing import local_prompt
from .channel import Inbox
from .metering import needs_prompt_count, settle
from .report import SSEReport
from .types import Prepared, RequestInfo, response_headers

#: The events one write takes from deltas that queued up (bytes; a delta's own may
#: pass it): about one upstream read's worth (``adapters/h1.py``'s READ_SIZE), so
#: that a stream whose client reads nothing holds a bounded piece of the reply.
WRITE_BYTES = 16384


class SSEStage:
    name = "sse"

    def __init__(
        self,
        info: RequestInfo,
        inbox: Inbox[Delta],
        plan: Inbox[Prepared],
        responder: Responder,
        limits: LimitsConfig,
    ) -> None:
        self.info = info
        self.inbox = inbox
        self.plan = plan
        self.responder = responder
        self.limits = limits
        self.owned = (inbox, plan)
        #: Set once the reply has a shape (the pipeline asks it for the final error event).
        self.assembler: ResponseAssembler | None = None
        #: What the response cache did (``X-Aiserve-Cache``), once the reply has begun.
        self.cache_result: str | None = None
        self._stalled = False
        #: Who answered (from the first delta), once the reply has begun.
        self.served: ServedBy | None = None
        #: The request the backend was sent (its prompt is counted when no usage comes).
        self._request: InferenceRequest | None = None
        #: Where the usage billed came from, and why the provider's was not believed,
        #: once the reply finished (``stages/metering.py``).
        self.usage_source: str | None = None
        self.distrusted: str | None = None

    async def run(self, first: Delta) -> bool:
        """Write the reply; True when it ended before the upstream did (a cap).

        Raises:
            WriteTimeout: the client stopped reading.
            ReplyCapExceeded: the reply passed ``max_reply_bytes`` or ``max_stream_s``.
            UpstreamProtocolError: the upstream's reply did not finish.
        """
        # The context stage sent this before the inference stage had its input.
        prepared = self.plan.receive_nowait()
        parsed = prepared.parsed
        self._request = prepared.inference
        route = self.info.route.config
        replayed = isinstance(first, Replayed)
        self.served = first.served
        similarity = None
        if isinstance(first, Replayed):
            self.cache_result = first.cache
            similarity = first.similarity
        elif prepared.cache is not None:
            self.cache_result = prepared.cache.result
        pricing = self.info.route.pricing
        price = None
        if pricing is not None:
            model = first.model or parsed.model  # the model that answered
            # An answer from the cache cost nothing (the saving is counted at the end).
            price = _free if free(self.cache_result) else partial(pricing.cost, model)
        asm = self.assembler = ResponseAssembler(
            self.info.request_id,
            parsed.model,
            self.info.created,
            stream=parsed.stream,
            include_usage=parsed.include_usage,
            # Replayed pieces went through the filters and the token cap already.
            filters=None if replayed else prepared.filters,
            side_filters=None if replayed else prepared.side_filters,
            max_tokens=None if replayed else prepared.inference.max_tokens,
            max_bytes=route.max_reply_bytes,
            price=price,
            codec=self.info.route.codec,
            view=parsed.api if prepared.view is None else prepared.view,
            native=parsed.native is not None,
        )
        headers = response_headers(
            self.info,
            prepared,
            first.served,
            cache=self.cache_result,
            steps=first.steps,
            similarity=similarity,
        )
        if route.max_stream_s is None:  # no cap: no cancel scope either
            await self._write(asm, first, headers)
            return asm.capped is not None
        with trio.move_on_at(trio.current_time() + route.max_stream_s) as capped:
            await self._write(asm, first, headers)
        if capped.cancelled_caught:
            raise ReplyCapExceeded(
                f"the reply passed the route's limit of {route.max_stream_s} s",
                param="max_stream_s",
                code="max_stream_s",
            )
        return asm.capped is not None

    async def _write(self, asm: ResponseAssembler, first: Delta, headers: Headers) -> None:
        if not asm.stream:
            await self._whole(asm, first, headers)
        else:
            await self._streamed(asm, first, headers)

    async def _whole(self, asm: ResponseAssembler, first: Delta, headers: Headers) -> None:
        asm.feed(first, trio.current_time())
        # Until the finish (nothing may follow it) or a cap; a queued delta is taken
        # without a trip through the scheduler.
        while asm.capped is None and asm.finish_reason is None:
            try:
                delta = self.inbox.receive_nowait()
            except trio.WouldBlock:
                try:
                    delta = await self.inbox.receive()
                except trio.EndOfChannel:
                    break
            except trio.EndOfChannel:
                break
            asm.feed(delta, trio.current_time())
        if asm.finish_reason is None:
            return  # the inference stage failed and says why
        await self._settle(asm)
        body = asm.finish(trio.current_time())
        if asm.cost is not None:
            headers = [*headers, (b"x-aiserve-cost", decimal(asm.cost).encode())]
        await self.responder.complete(200, [*JSON_HEADERS, *headers], body)

    async def _streamed(self, asm: ResponseAssembler, first: Delta, headers: Headers) -> None:
        # The first events are in hand: the head may go out with them. A short reply
        # whose every delta is in hand goes out in one write.
        batch = self._queued(first)
        await self.responder.start(200, [*SSE_HEADERS, *headers], body_follows=True)
        await self._stream(asm, batch)

    def _queued(self, first: Delta) -> list[Delta]:
        """``first`` and the deltas queued behind it."""
        batch = [first]
        while True:
            try:
                batch.append(self.inbox.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                return batch

    async def _stream(self, asm: ResponseAssembler, batch: list[Delta]) -> None:
        """Write the events of ``batch`` and of every delta after it, with heartbeats
        and the write deadline (see :class:`_Clock`)."""
        deltas = self.inbox
        responder = self.responder
        clock = _Clock(self.limits, responder)
        out = b""
        # The head was promised a body at once (it may be held until one is written):
        # the first write goes now, even empty (a filter may hold back all of it).
        owed = True
        pending: list[Delta] = batch
        while True:
            with clock:
                while True:
                    now = trio.current_time()
                    for delta in pending:
                        out += asm.feed(delta, now)
                    pending = []
                    # Deltas that queued up while the last write was in flight go out
                    # in one write: fewer sends under load, no added wait when idle. Up to
                    # WRITE_BYTES: what is left waits in the channel, whose sender (the
                    # upstream's reader) then waits too -- a client that stops reading
                    # holds one write of events here, not all that was queued.
                    while (
                        len(out) < WRITE_BYTES and asm.finish_reason is None and asm.capped is None
                    ):
                        try:
                            delta = deltas.receive_nowait()
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                        out += asm.feed(delta, now)
                    # With the finish in hand, what is left goes out with the final
                    # events, in one write.
                    if (out or owed) and asm.finish_reason is None:
                        await clock.write(out)
                        out = b""
                    owed = False
                    if asm.capped is not None or asm.finish_reason is not None:
                        break  # the reply is over (nothing follows a finish; a cap ends it)
                    try:
                        pending = [await clock.idle(deltas)]
                    except trio.EndOfChannel:
                        break
                if asm.finish_reason is not None:
                    clock.pause()  # the count below has its own bound (it is shielded)
                    await self._settle(asm)
                    await clock.write(out + asm.finish(trio.current_time()), more=False)
            if not clock.rang:
                return  # written, or the inference stage failed and says why
            # Idle for heartbeat_s: a comment keeps the connection (and its proxies) open.
            with clock:
                await clock.write(self.info.route.codec.ping)

    async def _settle(self, asm: ResponseAssembler) -> None:
        """The usage the finished reply is billed for, before its usage and cost go out:
        the provider's when it can be believed, else counted here (``stages/metering.py``)."""
        usage = asm.usage
        prompt = None
        if needs_prompt_count(usage):
            assert self._request is not None
            prompt = await local_prompt(self._request, self.info.route)
        tokens, chars = asm.generated
        settled = settle(usage, generated=tokens, generated_chars=chars, prompt=prompt)
        asm.bill(settled.usage)
        self.usage_source = settled.source
        self.distrusted = settled.distrusted

    async def expired(self, first: Delta) -> None:
        raise StageDeadlineExceeded("sse")

    def report(self) -> SSEReport:
        """The reply as the client got it (the stage's shell asks when it ends)."""
        asm = self.assembler
        if asm is None:
            return SSEReport(served=self.served)
        tokens, chars = asm.generated
        return SSEReport(
            # The backend answered when it generated anything, even what the output
            # filters still hold back (it is billed for it).
            served_model=asm.model if asm.answered or tokens else "",
            served=self.served,
            first_token_at=asm.first_token_at,
            usage=asm.usage,
            finish_reason=asm.finish_reason,
            delivered=asm.delivered,
            tool_calls=asm.tool_calls,
            capped=asm.capped,
            fail=asm.fail,
            generated=tokens,
            generated_chars=chars,
            usage_source=self.usage_source,
            distrusted=self.distrusted,
        )


def _free(usage: Usage | None) -> float:
    return 0.0


class _Clock:
    """A stream's heartbeats and write deadline, on one cancel scope at a time.

    No task of its own: while the stage waits for a delta the scope's deadline is the
    next heartbeat (``heartbeat_s`` after the last write), while it writes it is the
    write deadline (``write_timeout_ms`` after the write began). Trio's own deadline
    queue, shared by every stream of the worker, wakes the stage when either comes.
    A heartbeat due ends the scope (:attr:`rang`); the stage writes the ping and
    enters a new one. A write past its deadline ends the stream with
    :class:`WriteTimeout`. A held stream so costs no keep-alive task, no nursery and
    no sleeping coroutines (docs/performance.md, where a held stream's memory goes).
    """

    __slots__ = ("every", "rang", "responder", "scope", "stall", "writing")

    def __init__(self, limits: LimitsConfig, responder: Responder) -> None:
        self.every = limits.heartbeat_s or math.inf
        self.stall = limits.write_timeout_ms / 1000.0
        self.responder = responder
        self.scope = trio.CancelScope()
        #: The last scope ended because a heartbeat was due.
        self.rang = False
        self.writing = False

    def __enter__(self) -> None:
        self.scope = trio.CancelScope()
        self.rang = self.writing = False
        self.scope.__enter__()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        handled = self.scope.__exit__(exc_type, exc, tb)
        if self.scope.cancelled_caught:
            if self.writing:
                self.responder.finished = True  # nothing more can usefully be sent
                raise WriteTimeout("the client stopped reading the response")
            self.rang = True
        return handled

    def pause(self) -> None:
        """No heartbeat and no deadline until the next wait or write."""
        self.scope.deadline = math.inf

    async def idle(self, deltas: Inbox[Delta]) -> Delta:
        """The next delta; the scope ends first when a heartbeat is due."""
        self.scope.deadline = self.responder.last_write + self.every
        return await deltas.receive()

    async def write(self, data: bytes, *, more: bool = True) -> None:
        """Write ``data``; the scope ends with :class:`WriteTimeout` when the client
        takes nothing for ``write_timeout_ms``."""
        self.scope.deadline = trio.current_time() + self.stall
        self.writing = True
        await self.responder.body(data, more=more)
        self.writing = False
