"""The sse stage: a thin loop around the response assembler and the responder.

It reads deltas from the inference stage and writes what the
:class:`~.assembler.ResponseAssembler` makes of them: an event stream (the
head goes out with the first delta, so that failures before it are still
proper HTTP statuses) or, when the client did not ask to stream, one
``chat.completion`` JSON body. While a stream is open, a keep-alive task sends
``: ping`` when it has been idle ``heartbeat_s`` and gives up on a client that
has taken no byte for ``write_timeout_ms``.

Deltas the response cache replays (:class:`~aiserve_trio.cache.entry.Replayed`:
a stored reply, or one shared with identical requests) have already been
through the route's output policies: they are framed by an assembler without
filters, into the same chunk shapes, usage and ``[DONE]``.
"""

from __future__ import annotations

import math
from functools import partial

import trio

from ..adapters.base import Delta, InferenceRequest, ServedBy, Usage
from ..cache.entry import Replayed
from ..core.errors import GatewayError, ReplyCapExceeded, StageDeadlineExceeded, WriteTimeout
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
        batch = self._queued(first)
        if batch[-1].finish_reason is not None:
            # The whole reply is in hand (a short one from a fast backend): one write,
            # bounded by the write deadline; no keep-alive task, nothing to keep alive.
            await self.responder.start(200, [*SSE_HEADERS, *headers], body_follows=True)
            with trio.move_on_after(self.limits.write_timeout_ms / 1000.0) as stalled:
                await self._stream(asm, batch)
            if stalled.cancelled_caught:
                self.responder.finished = True  # nothing more can usefully be sent
                raise WriteTimeout("the client stopped reading the response")
            return
        error: GatewayError | None = None
        async with trio.open_nursery() as nursery:
            # The first events are in hand: the head may go out with them.
            await self.responder.start(200, [*SSE_HEADERS, *headers], body_follows=True)
            nursery.start_soon(self._keepalive, nursery.cancel_scope)
            try:
                await self._stream(asm, batch)
            except GatewayError as exc:
                error = exc
            nursery.cancel_scope.cancel(reason="stream written")
        if self._stalled:
            raise WriteTimeout("the client stopped reading the response")
        if error is not None:
            raise error

    def _queued(self, first: Delta) -> list[Delta]:
        """``first`` and the deltas queued behind it."""
        batch = [first]
        while True:
            try:
                batch.append(self.inbox.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                return batch

    async def _stream(self, asm: ResponseAssembler, batch: list[Delta]) -> None:
        deltas = self.inbox
        out = b""
        # The head was promised a body at once (it may be held until one is written):
        # the first write goes now, even empty (a filter may hold back all of it).
        owed = True
        while True:
            now = trio.current_time()
            for delta in batch:
                out += asm.feed(delta, now)
            # Deltas that queued up while the last write was in flight go out
            # in one write: fewer sends under load, no added wait when idle. Up to
            # WRITE_BYTES: what is left waits in the channel, whose sender (the
            # upstream's reader) then waits too -- a client that stops reading
            # holds one write of events here, not all that was queued.
            while len(out) < WRITE_BYTES and asm.finish_reason is None and asm.capped is None:
                try:
                    delta = deltas.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                out += asm.feed(delta, now)
            # With the finish in hand, what is left goes out with the final
            # events, in one write.
            if (out or owed) and asm.finish_reason is None:
                await self.responder.body(out)
                out = b""
            owed = False
            if asm.capped is not None or asm.finish_reason is not None:
                break  # the reply is over (nothing follows a finish; a cap ends it)
            try:
                batch = [await deltas.receive()]
            except trio.EndOfChannel:
                break
        if asm.finish_reason is None:
            return  # the inference stage failed and says why
        await self._settle(asm)
        await self.responder.body(out + asm.finish(trio.current_time()), more=False)

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

    async def _keepalive(self, stream_scope: trio.CancelScope) -> None:
        """Heartbeats and the write deadline of the stream, in one task.

        One watchdog per stream costs less than a cancel scope per write.
        """
        responder = self.responder
        every = self.limits.heartbeat_s or math.inf
        ping = self.info.route.codec.ping
        stall = self.limits.write_timeout_ms / 1000.0
        while not responder.finished:
            now = trio.current_time()
            since = responder.writing_since
            # Compare with the very sum slept until: `now - last >= every` can
            # miss by a rounding error and spin at the same instant.
            if since is None and now >= responder.last_write + every:
                with trio.move_on_after(stall):
                    await responder.ping(ping)
                since = responder.writing_since  # still set: the ping did not go out
                now = trio.current_time()
            if since is not None and now >= since + stall:
                responder.finished = True  # nothing more can usefully be sent
                self._stalled = True
                stream_scope.cancel(reason="write deadline")
                return
            wake = now + stall if since is None else since + stall
            await trio.sleep_until(min(wake, responder.last_write + every))

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
