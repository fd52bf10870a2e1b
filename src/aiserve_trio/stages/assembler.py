"""The response assembler: deltas in, response bytes out (sans-IO).

One :class:`ResponseAssembler` per request owns everything about the reply
that is not I/O: the output filters (which may hold back a bounded tail), the
SSE framer, the text actually delivered, the tool calls, the finish reason,
the usage and the first-token time. The sse stage is a thin loop around it,
and the pipeline asks it for the final error event when a started stream fails.

Its states are a table, not a forest of ``if``\\ s::

    idle --feed--> open --feed--> open
    idle|open --finish--> done
    idle|open --fail--> failed

Everything the model produces reaches the client, each through the output
policies that apply to it: the content through every output filter of the
route; the reasoning, a refusal and the string values inside tool-call
arguments through the filters that are not about presentation (channel shaping
changes content only), each in a chain of its own -- tool-call arguments via a
:class:`~aiserve_trio.policies.jsonstream.JsonStringFilter`, so they stay
valid JSON. Logprobs travel as the backend sent them.

For a streamed reply, :meth:`feed` returns SSE events (the first led by the
assistant-role chunk) and :meth:`finish` the filters' held-back tails, the
finish event, the usage event if asked for, and ``[DONE]``. For a non-streamed
reply, :meth:`feed` returns nothing and :meth:`finish` the whole
``chat.completion`` JSON body. :meth:`fail` returns the error event and
``[DONE]`` once a stream has begun, or None when nothing has been sent and the
caller should answer with an HTTP error instead.

With ``record``, it also keeps what it released, piece by piece, as
:class:`~aiserve_trio.cache.entry.Replayed` deltas (:meth:`take_recorded`): the
reply as the client got it, which the response cache stores and replays
through an assembler without filters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from ..adapters.base import ToolCallDelta, Usage, prompt_details
from ..apis import chat
from ..apis.common import State  # one reply's states, framers and the assembler alike
from ..cache.entry import Replayed
from ..core.api import (
    ChatCompletion,
    Choice,
    ChunkDelta,
    FunctionCallOut,
    FunctionDelta,
    LogprobsOut,
    NativeEvents,
    ResponseMessage,
    ToolCallChunk,
    ToolCallOut,
)
from ..core.api import Usage as WireUsage
from ..core.errors import GatewayError, ReplyCapExceeded, UpstreamProtocolError
from ..core.messages import FunctionCall, ToolCall
from ..policies.base import apply_filters, finish_filters
from ..policies.jsonstream import JsonStringFilter

if TYPE_CHECKING:
    from ..adapters.base import Delta
    from ..apis import Codec, Framer
    from ..apis.common import NativeFramer
    from ..policies.base import OutputFilter

FilterFactory = Callable[[], "list[OutputFilter]"]


_NEXT: dict[tuple[State, str], State] = {
    (State.IDLE, "feed"): State.OPEN,
    (State.OPEN, "feed"): State.OPEN,
    (State.IDLE, "finish"): State.DONE,
    (State.OPEN, "finish"): State.DONE,
    (State.IDLE, "fail"): State.FAILED,
    (State.OPEN, "fail"): State.FAILED,
}


class AssemblerStateError(RuntimeError):
    """A call the assembler's state does not allow (a bug in the caller)."""


def _no_filters() -> list[OutputFilter]:
    return []


class _Chain:
    """One text stream (reasoning, refusal) through its own filters."""

    __slots__ = ("filters", "parts")

    def __init__(self, filters: list[OutputFilter]) -> None:
        self.filters = filters
        self.parts: list[str] = []

    def feed(self, text: str) -> str:
        out = apply_filters(self.filters, text) if self.filters else text
        if out:
            self.parts.append(out)
        return out

    def finish(self) -> str:
        out = finish_filters(self.filters) if self.filters else ""
        if out:
            self.parts.append(out)
        return out


class _Call:
    """One tool call being streamed: its identity, and its arguments through the filters."""

    __slots__ = ("args", "id", "name", "parts", "type")

    def __init__(self, args: JsonStringFilter | None) -> None:
        self.id = ""
        self.type = "function"
        self.name = ""
        self.args = args
        self.parts: list[str] = []

    def feed(self, fragment: str) -> str:
        out = self.args.feed(fragment) if self.args is not None else fragment
        if out:
            self.parts.append(out)
        return out

    def finish(self) -> str:
        out = self.args.finish() if self.args is not None else ""
        if out:
            self.parts.append(out)
        return out


class ResponseAssembler:
    """Builds one reply's bytes; see the module docstring."""

    __slots__ = (
        "_bytes",
        "_calls",
        "_chars",
        "_codec",
        "_collected",
        "_delivered",
        "_filters",
        "_framer",
        "_logprobs",
        "_max_bytes",
        "_max_tokens",
        "_model_recorded",
        "_native",
        "_native_calls",
        "_price",
        "_reasoning",
        "_recorded",
        "_refusal",
        "_side",
        "_state",
        "_thought",
        "_tokens",
        "_view",
        "capped",
        "cost",
        "created",
        "finish_reason",
        "first_token_at",
        "model",
        "request_id",
        "usage",
    )

    def __init__(
        self,
        request_id: str,
        model: str,
        created: int,
        *,
        stream: bool,
        include_usage: bool = False,
        filters: list[OutputFilter] | None = None,
        side_filters: FilterFactory | None = None,
        max_tokens: int | None = None,
        max_bytes: int | None = None,
        record: bool = False,
        price: Callable[[Usage | None], float] | None = None,
        codec: Codec = chat.CODEC,
        view: object = None,
        native: bool = False,
    ) -> None:
        """Args:
        filters: the content's output filters, in policy order.
        side_filters: makes a fresh chain of the filters that apply to
            reasoning, refusals and tool-call arguments (one chain per text).
        max_tokens: the reply ends (``finish_reason: "length"``, :attr:`capped`)
            before a delta would take it past this many upstream tokens (counted
            either way: :attr:`generated`).
        max_bytes: :meth:`feed` raises once more bytes than this were released.
        record: keep the released pieces (see :meth:`take_recorded`).
        price: the reply's cost from its usage; with it, the usage the client
            gets carries ``cost`` (kept in :attr:`cost`).
        include_usage: the client asked for the usage in the stream (Chat
            Completions' ``stream_options``); the codec's framer is told.
        codec: the client API's codec (``apis/``; Chat Completions' by default):
            its framer makes the stream's events, its ``body`` the whole reply;
            ``view`` is the request as that client sent it.
        native: the backend speaks the codec's API (``codec.native``): deltas
            carry the provider's events, which go out as sent where the output
            policies left their text as it was; a reply the client did not stream
            is the events added up (``collect``).
        """
        self._max_tokens = max_tokens
        self._max_bytes = max_bytes
        self._tokens = 0
        self._chars = 0
        self._bytes = 0
        #: The cap that ended the reply early, if one did (``max_tokens``).
        self.capped: str | None = None
        self.request_id = request_id
        self.model = model
        self.created = created
        self._codec = codec
        self._view = view
        self._framer: Framer | None = None
        #: A native route's framer (the same object as ``_framer`` when streaming).
        self._native: NativeFramer | None = None
        #: A native reply the client did not stream: its events, added up at the end.
        self._collected: list[bytes] | None = None
        #: A native reply's tool calls whose block has not ended.
        self._native_calls: set[int] = set()
        spec = codec.native if native else None
        if spec is not None:
            self._native = spec.framer(request_id, model, created, view)
            if stream:
                self._framer = self._native
            else:
                self._collected = []
        elif stream:
            self._framer = codec.framer(request_id, model, created, view, include_usage)
        self._model_recorded = False
        self._filters = filters or []
        self._side = side_filters or _no_filters
        self._state = State.IDLE
        self._delivered: list[str] = []
        self._reasoning: _Chain | None = None
        #: Every reasoning text released (chains end when the answer begins).
        self._thought: list[str] = []
        self._refusal: _Chain | None = None
        self._calls: dict[int, _Call] = {}
        self._logprobs: list[msgspec.Raw] = []
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        #: Clock time at which the first text of the reply was released.
        self.first_token_at: float | None = None
        self._recorded: list[Replayed] | None = [] if record else None
        self._price = price
        #: What the reply cost, once :meth:`finish` priced it.
        self.cost: float | None = None

    # --- what it knows --------------------------------------------------------

    @property
    def state(self) -> State:
        return self._state

    @property
    def stream(self) -> bool:
        return self._framer is not None

    @property
    def answered(self) -> bool:
        """Whether the backend answered: something was released, or the reply finished."""
        return self.first_token_at is not None or self.finish_reason is not None

    @property
    def delivered(self) -> str:
        """The content released to the client so far (after the output filters)."""
        return "".join(self._delivered)

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The tool calls released so far, arguments as the client got them."""
        return [
            ToolCall(
                id=c.id,
                type=c.type,
                function=FunctionCall(name=c.name, arguments="".join(c.parts)),
            )
            for _, c in sorted(self._calls.items())
        ]

    def take_recorded(self) -> list[Replayed]:
        """The pieces released since the last call (with ``record``; else none).

        Each is one release of :meth:`feed` or :meth:`finish`: the content,
        reasoning, refusal and tool-call fragments after the filters, and the
        backend's logprobs; after :meth:`finish`, the last one carries the
        finish reason and usage.
        """
        out = self._recorded
        if not out:
            return []
        self._recorded = []
        return out

    def _record(
        self,
        content: str,
        reasoning: str,
        refusal: str,
        calls: list[ToolCallChunk] | None,
        logprobs: msgspec.Raw | None = None,
    ) -> None:
        assert self._recorded is not None
        fragments = [ToolCallDelta.of(c) for c in calls] if calls else None
        model_recorded, self._model_recorded = self._model_recorded, True
        self._recorded.append(
            Replayed(
                text=content,
                reasoning=reasoning,
                refusal=refusal,
                tool_calls=fragments,
                logprobs=logprobs,
                # The first piece says which model answered, for whoever replays it.
                model=None if model_recorded else self.model,
            )
        )

    # --- transitions ----------------------------------------------------------

    def _go(self, event: str) -> State:
        before = self._state
        try:
            self._state = _NEXT[before, event]
        except KeyError:
            raise AssemblerStateError(f"{event} in state {before.value}") from None
        return before

    def feed(self, delta: Delta, now: float) -> bytes:
        """Take one delta; return the bytes to send now (b"" when nothing is due).

        Raises:
            ReplyCapExceeded: more than ``max_bytes`` have been released.
        """
        if self._native is not None:
            out = self._feed_native(delta, now)
            if self._collected is not None:
                self._collected.append(out)
                return b""
            return out
        before = self._go("feed")
        framer = self._framer
        if before is State.IDLE and delta.model:
            # The first delta names the model that answered: every chunk says it.
            self.model = delta.model
            if framer is not None:
                framer.model = delta.model
        produced = delta.text or delta.reasoning or delta.refusal or delta.tool_calls
        if produced:
            if self._max_tokens is not None and self._tokens + delta.tokens > self._max_tokens:
                # The backend did not stop at the limit it was sent: stop here (billed
                # for what it generated: the sse stage settles the usage).
                self.capped = "max_tokens"
                self.finish_reason = "length"
                return framer.role() if framer is not None and before is State.IDLE else b""
            self._generated(delta)
        out = framer.role() if framer is not None and before is State.IDLE else b""
        content, reasoning, refusal = self._released(delta)
        calls = self._feed_calls(delta.tool_calls) if delta.tool_calls else None
        if reasoning:
            self._thought.append(reasoning)
        if self._max_bytes is not None:
            self._count_bytes(content, reasoning, refusal, calls)
        if (content or reasoning or refusal or calls) and self.first_token_at is None:
            self.first_token_at = now
        if delta.logprobs is not None and framer is None:
            self._keep_logprobs(delta.logprobs)
        if self._recorded is not None and (
            content or reasoning or refusal or calls or delta.logprobs
        ):
            self._record(content, reasoning, refusal, calls, delta.logprobs)
        if framer is not None and (content or reasoning or refusal or calls or delta.logprobs):
            out += framer.delta(
                ChunkDelta(
                    content=content or None,
                    reasoning_content=reasoning or None,
                    refusal=refusal or None,
                    tool_calls=calls,
                ),
                logprobs=delta.logprobs,
            )
        if delta.finish_reason is not None and self.capped is None:
            self.finish_reason = delta.finish_reason
            self.usage = delta.usage or self.usage
        return out

    def _released(self, delta: Delta) -> tuple[str, str, str]:
        """What the filters release of ``delta``'s answer, reasoning and refusal."""
        content = reasoning = refusal = ""
        if delta.reasoning:
            # Fed before the chain can end below: one upstream read may carry the
            # last of the reasoning and the first of the answer, and the reasoning's
            # held-back tail must meet the rest of its text in the filters (a phone
            # number split there would otherwise go out whole, issue 51).
            if self._reasoning is None:
                self._reasoning = _Chain(self._side())
            reasoning = self._reasoning.feed(delta.reasoning)
        if self._reasoning is not None and (delta.text or delta.refusal or delta.tool_calls):
            # The answer has begun, so the reasoning is over: what its filters
            # held back goes out now, before the answer, not with the last event.
            reasoning += self._reasoning.finish()
            self._reasoning = None
        if delta.text:
            text = apply_filters(self._filters, delta.text) if self._filters else delta.text
            if text:
                self._delivered.append(text)
                content = text
        if delta.refusal:
            if self._refusal is None:
                self._refusal = _Chain(self._side())
            refusal = self._refusal.feed(delta.refusal)
        return content, reasoning, refusal

    def _count_bytes(
        self, content: str, reasoning: str, refusal: str, calls: list[ToolCallChunk] | None
    ) -> None:
        """Count what is released against ``max_bytes``.

        Raises:
            ReplyCapExceeded: more than ``max_bytes`` have been released.
        """
        assert self._max_bytes is not None
        self._bytes += len(content.encode()) + len(reasoning.encode()) + len(refusal.encode())
        for c in calls or ():
            if c.function is not None and c.function.arguments:
                self._bytes += len(c.function.arguments.encode())
        if self._bytes > self._max_bytes:
            raise ReplyCapExceeded(
                f"the reply passed the route's limit of {self._max_bytes} bytes",
                param="max_reply_bytes",
                code="max_reply_bytes",
            )

    def _feed_native(self, delta: Delta, now: float) -> bytes:
        """:meth:`feed` on a native route: the provider's events pass as they came when
        the output policies release their text unchanged; else what they release is
        written in the events' block; at a boundary (a block's end...) the held-back
        text goes out first."""
        before = self._go("feed")
        framer = self._native
        assert framer is not None
        if before is State.IDLE and delta.model:
            self.model = delta.model
            framer.model = delta.model
        out = framer.role() if before is State.IDLE else b""
        events = delta.native
        produced = delta.text or delta.reasoning or delta.refusal or delta.tool_calls
        if produced:
            if self._max_tokens is not None and self._tokens + delta.tokens > self._max_tokens:
                self.capped = "max_tokens"
                self.finish_reason = "length"
                return out
            self._generated(delta)
        if events is not None and events.boundary:
            out += self._flush_native(events.index, now)
            out += framer.native(events, None, same=True)
        elif produced:
            content = reasoning = refusal = ""
            if delta.text:
                content = apply_filters(self._filters, delta.text) if self._filters else delta.text
                if content:
                    self._delivered.append(content)
            if delta.reasoning:
                if self._reasoning is None:
                    self._reasoning = _Chain(self._side())
                reasoning = self._reasoning.feed(delta.reasoning)
                if reasoning:
                    self._thought.append(reasoning)
            if delta.refusal:
                if self._refusal is None:
                    self._refusal = _Chain(self._side())
                refusal = self._refusal.feed(delta.refusal)
            calls = None
            if delta.tool_calls:
                calls = self._feed_calls(delta.tool_calls)
                self._native_calls.update(f.index for f in delta.tool_calls)
            released = ChunkDelta(
                content=content or None,
                reasoning_content=reasoning or None,
                refusal=refusal or None,
                tool_calls=calls,
            )
            self._count_released(released, now)
            if events is None:
                out += framer.delta(released) if content or reasoning or refusal or calls else b""
            else:
                same = (
                    content == delta.text
                    and reasoning == delta.reasoning
                    and refusal == delta.refusal
                    and _arguments(calls) == "".join(f.arguments for f in delta.tool_calls or ())
                )
                out += framer.native(events, released, same=same)
        elif events is not None:
            out += framer.native(events, None, same=True)
        if delta.finish_reason is not None and self.capped is None:
            self.finish_reason = delta.finish_reason
            self.usage = delta.usage or self.usage
        return out

    def _generated(self, delta: Delta) -> None:
        """Count what the backend generated: its upstream tokens and their characters
        (what the request is billed for when no usage of the provider's comes, and the
        bound a reported count must keep to: ``stages/metering.py``)."""
        self._tokens += delta.tokens
        chars = len(delta.text) + len(delta.reasoning) + len(delta.refusal)
        if delta.tool_calls:
            for f in delta.tool_calls:
                chars += len(f.arguments) + len(f.name or "")
        self._chars += chars

    @property
    def generated(self) -> tuple[int, int]:
        """(upstream tokens, their characters) the backend generated so far."""
        return self._tokens, self._chars

    def bill(self, usage: Usage) -> None:
        """The usage the reply is billed for (settled by the sse stage before
        :meth:`finish`): the one the client's usage and cost show."""
        self.usage = usage

    def _flush_native(self, index: int, now: float) -> bytes:
        """What the output policies hold back, released before a native boundary."""
        assert self._native is not None
        tail = finish_filters(self._filters) if self._filters else ""
        if tail:
            self._delivered.append(tail)
        reasoning = refusal = ""
        if self._reasoning is not None:
            reasoning = self._reasoning.finish()
            self._reasoning = None
            if reasoning:
                self._thought.append(reasoning)
        if self._refusal is not None:
            refusal = self._refusal.finish()
            # The chain's parts stay: the whole refusal is the message's.
        calls = [
            ToolCallChunk(index=i, function=FunctionDelta(arguments=rest))
            for i in sorted(self._native_calls)
            if (rest := self._calls[i].finish())
        ]
        self._native_calls.clear()
        if not (tail or reasoning or refusal or calls):
            return b""
        released = ChunkDelta(
            content=tail or None,
            reasoning_content=reasoning or None,
            refusal=refusal or None,
            tool_calls=calls or None,
        )
        self._count_released(released, now)
        events = NativeEvents(raw=b"", kind="content_block_delta", index=index)
        return self._native.native(events, released, same=False)

    def _count_released(self, released: ChunkDelta, now: float) -> None:
        """The reply cap and the first-token time, for what a native reply released.

        Raises:
            ReplyCapExceeded: more than ``max_bytes`` have been released.
        """
        size = 0
        for text in (released.content, released.reasoning_content, released.refusal):
            if text:
                size += len(text.encode())
        size += len(_arguments(released.tool_calls).encode())
        if not size and not released.tool_calls:
            return
        if self.first_token_at is None:
            self.first_token_at = now
        if self._max_bytes is not None:
            self._bytes += size
            if self._bytes > self._max_bytes:
                raise ReplyCapExceeded(
                    f"the reply passed the route's limit of {self._max_bytes} bytes",
                    param="max_reply_bytes",
                    code="max_reply_bytes",
                )

    def _side_text(self, text: str) -> str:
        """``text`` through a fresh chain of the side filters, whole."""
        chain = self._side()
        return apply_filters(chain, text) + finish_filters(chain) if chain else text

    def _feed_calls(self, fragments: list[ToolCallDelta]) -> list[ToolCallChunk] | None:
        chunks: list[ToolCallChunk] = []
        for frag in fragments:
            call = self._calls.get(frag.index)
            first = call is None
            if call is None:
                side = self._side()
                # Without a filter the arguments pass as they come (and stay the
                # backend's bytes, even when they are not valid JSON).
                args = JsonStringFilter(self._side) if side else None
                call = self._calls[frag.index] = _Call(args)
            # The name and id are model output too: each fragment redacted whole.
            ident = self._side_text(frag.id) if frag.id else frag.id
            name = self._side_text(frag.name) if frag.name else frag.name
            if ident:
                call.id = ident
            if frag.type:
                call.type = frag.type
            if name:
                call.name += name
            released = call.feed(frag.arguments) if frag.arguments else ""
            if first or ident or name or released:
                chunks.append(
                    ToolCallChunk(
                        index=frag.index,
                        id=ident,
                        type=frag.type,
                        function=FunctionDelta(
                            name=name, arguments=released if (released or first) else None
                        ),
                    )
                )
        return chunks or None

    def _keep_logprobs(self, raw: msgspec.Raw) -> None:
        # Logprobs the client cannot use are not worth failing the reply.
        with contextlib.suppress(msgspec.DecodeError):
            self._logprobs.extend(_logprobs_content.decode(raw).content)

    def finish(self, now: float) -> bytes:
        """The end of the reply: the last events and ``[DONE]``, or the JSON body.

        Raises:
            UpstreamProtocolError: no delta carried a finish reason; or the
                codec cannot end the reply in its API's shape (a Messages tool
                input that is not an object), whole or streamed -- streamed, the
                assembler is left open for :meth:`fail`.
        """
        if self.finish_reason is None:
            raise UpstreamProtocolError("the model backend ended the reply without finishing it")
        self._go("finish")
        tail = finish_filters(self._filters) if self._filters else ""
        if tail:
            self._delivered.append(tail)
        reasoning = self._reasoning.finish() if self._reasoning is not None else ""
        if reasoning:
            self._thought.append(reasoning)
        refusal = self._refusal.finish() if self._refusal is not None else ""
        calls = [
            ToolCallChunk(index=i, function=FunctionDelta(arguments=rest))
            for i, c in sorted(self._calls.items())
            if (rest := c.finish())
        ]
        if self.first_token_at is None and (tail or reasoning or refusal or calls):
            self.first_token_at = now
        if self._recorded is not None:
            if tail or reasoning or refusal or calls:
                self._record(tail, reasoning, refusal, calls)
            model = None if self._model_recorded else self.model
            self._model_recorded = True
            self._recorded.append(
                Replayed(finish_reason=self.finish_reason, usage=self.usage, model=model)
            )
        usage = self._wire_usage()
        if self._collected is not None:
            assert self._native is not None
            assert self._codec.native is not None
            released = ChunkDelta(
                content=tail or None,
                reasoning_content=reasoning or None,
                refusal=refusal or None,
                tool_calls=calls or None,
            )
            if tail or reasoning or refusal or calls:
                self._collected.append(self._native.delta(released))
            self._collected.append(self._native.close(self.finish_reason, usage))
            if self.first_token_at is None:
                self.first_token_at = now
            return self._codec.native.collect(b"".join(self._collected))
        if self._framer is None:
            if self.first_token_at is None:
                self.first_token_at = now
            return self._codec.body(self._completion(usage), self._view)
        out = b""
        if tail or reasoning or refusal or calls:
            out = self._framer.delta(
                ChunkDelta(
                    content=tail or None,
                    reasoning_content=reasoning or None,
                    refusal=refusal or None,
                    tool_calls=calls or None,
                )
            )
        try:
            return out + self._framer.close(self.finish_reason, usage)
        except GatewayError:
            # The framer refused to close (a Messages tool input that is not an
            # object): the reply did not finish after all, so it may still fail,
            # and :meth:`fail` gives the API's error event, not a clean end.
            self._state = State.OPEN
            raise

    def _completion(self, usage: WireUsage) -> ChatCompletion:
        assert self.finish_reason is not None
        calls = self.tool_calls
        message = ResponseMessage(
            role="assistant",
            content=self.delivered if self._delivered or not calls else None,
        )
        if self._thought:
            message.reasoning_content = "".join(self._thought)
        if self._refusal is not None:
            message.refusal = "".join(self._refusal.parts)
        if calls:
            message.tool_calls = [
                ToolCallOut(
                    id=c.id,
                    type=c.type,
                    function=FunctionCallOut(name=c.function.name, arguments=c.function.arguments),
                )
                for c in calls
            ]
        choice = Choice(index=0, message=message, finish_reason=self.finish_reason)
        if self._logprobs:
            choice.logprobs = LogprobsOut(content=self._logprobs)
        return ChatCompletion(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=usage,
        )

    def fail(self, err: GatewayError) -> bytes | None:
        """The error event and ``[DONE]``, or None if no stream has begun."""
        before = self._go("fail")
        if self._framer is None or before is State.IDLE:
            return None
        return self._framer.fail(err)

    def _wire_usage(self) -> WireUsage:
        u = self.usage
        prompt = u.prompt_tokens if u else 0
        completion = u.completion_tokens if u else 0
        wire = WireUsage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )
        if u is not None and u.prompt_details is not None:
            wire.prompt_tokens_details = u.prompt_details
        elif u is not None and (u.cache_read_tokens or u.cache_write_tokens):
            # A backend that counts its prompt cache its own way (Anthropic, Gemini,
            # Bedrock): OpenAI's cached_tokens, and the writes as OpenRouter reports them.
            wire.prompt_tokens_details = prompt_details(u)
        if u is not None and u.completion_details is not None:
            wire.completion_tokens_details = u.completion_details
        if self._price is not None:
            wire.cost = self.cost = self._price(u)
        return wire


def _arguments(calls: list[ToolCallChunk] | None) -> str:
    """The argument fragments of released tool-call chunks, joined."""
    return "".join(c.function.arguments or "" for c in calls or () if c.function is not None)


class _LogprobsContent(msgspec.Struct):
    content: list[msgspec.Raw] = msgspec.field(default_factory=list)


_logprobs_content = msgspec.json.Decoder(_LogprobsContent)
