"""The response assembler: deltas in, response bytes out (sans-IO).

One :class:`ResponseAssembler` per request owns everything about the reply
that is not I/O: the output filters (which may hold back a bounded tail), the
SSE framer, the text actually delivered, the finish reason, the usage and the
first-token time. The sse stage is a thin loop around it, and the pipeline
asks it for the final error event when a started stream fails.

Its states are a table, not a forest of ``if``\\ s::

    idle --feed--> open --feed--> open
    idle|open --finish--> done
    idle|open --fail--> failed

For a streamed reply, :meth:`feed` returns SSE events (the first ones led by
the assistant-role chunk) and :meth:`finish` the filters' held-back tail, the
finish event, the usage event if asked for, and ``[DONE]``. For a non-streamed
reply, :meth:`feed` returns nothing and :meth:`finish` the whole
``chat.completion`` JSON body. :meth:`fail` returns the error event and
``[DONE]`` once a stream has begun, or None when nothing has been sent and the
caller should answer with an HTTP error instead.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from ..api import ChatCompletion, Choice, ResponseMessage, encoder
from ..api import Usage as WireUsage
from ..errors import UpstreamProtocolError
from ..http.sse import DONE, ChatFramer

if TYPE_CHECKING:
    from ..adapters.base import Delta, Usage
    from ..errors import GatewayError
    from ..policies.base import OutputFilter


class State(enum.Enum):
    IDLE = "idle"
    OPEN = "open"
    DONE = "done"
    FAILED = "failed"


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


def apply_filters(filters: list[OutputFilter], text: str) -> str:
    """``text`` through each output filter in order."""
    for f in filters:
        if not text:
            break
        text = f.feed(text)
    return text


def finish_filters(filters: list[OutputFilter]) -> str:
    """Flush the held-back tails in order, each through the filters after it."""
    out = ""
    for f in filters:
        out = (f.feed(out) if out else "") + f.finish()
    return out


class ResponseAssembler:
    """Builds one reply's bytes; see the module docstring."""

    __slots__ = (
        "_delivered",
        "_filters",
        "_framer",
        "_include_usage",
        "_state",
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
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.created = created
        self._framer = ChatFramer(request_id, model, created) if stream else None
        self._include_usage = include_usage
        self._filters = filters or []
        self._state = State.IDLE
        self._delivered: list[str] = []
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        #: Clock time at which the first delivered text was produced.
        self.first_token_at: float | None = None

    # --- what it knows --------------------------------------------------------

    @property
    def state(self) -> State:
        return self._state

    @property
    def stream(self) -> bool:
        return self._framer is not None

    @property
    def delivered(self) -> str:
        """The reply text released to the client so far (after the output filters)."""
        return "".join(self._delivered)

    # --- transitions ----------------------------------------------------------

    def _go(self, event: str) -> State:
        before = self._state
        try:
            self._state = _NEXT[before, event]
        except KeyError:
            raise AssemblerStateError(f"{event} in state {before.value}") from None
        return before

    def feed(self, delta: Delta, now: float) -> bytes:
        """Take one delta; return the bytes to send now (b"" when nothing is due)."""
        before = self._go("feed")
        out = b""
        if self._framer is not None and before is State.IDLE:
            out = self._framer.role()
        if delta.text:
            text = apply_filters(self._filters, delta.text) if self._filters else delta.text
            if text:
                self._release(text, now)
                if self._framer is not None:
                    out += self._framer.content(text)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.usage = delta.usage or self.usage
        return out

    def finish(self, now: float) -> bytes:
        """The end of the reply: the last events and ``[DONE]``, or the JSON body.

        Raises:
            UpstreamProtocolError: no delta carried a finish reason.
        """
        if self.finish_reason is None:
            raise UpstreamProtocolError("the model backend ended the reply without finishing it")
        self._go("finish")
        tail = finish_filters(self._filters) if self._filters else ""
        if tail:
            self._release(tail, now)
        usage = self._wire_usage()
        if self._framer is None:
            if self.first_token_at is None:
                self.first_token_at = now
            body = ChatCompletion(
                id=self.request_id,
                created=self.created,
                model=self.model,
                choices=[
                    Choice(
                        index=0,
                        message=ResponseMessage(role="assistant", content=self.delivered),
                        finish_reason=self.finish_reason,
                    )
                ],
                usage=usage,
            )
            return encoder.encode(body)
        out = self._framer.content(tail) if tail else b""
        out += self._framer.finish(self.finish_reason)
        if self._include_usage:
            out += self._framer.usage(usage)
        return out + DONE

    def fail(self, err: GatewayError) -> bytes | None:
        """The error event and ``[DONE]``, or None if no stream has begun."""
        before = self._go("fail")
        if self._framer is None or before is State.IDLE:
            return None
        return self._framer.error(err) + DONE

    def _release(self, text: str, now: float) -> None:
        self._delivered.append(text)
        if self.first_token_at is None:
            self.first_token_at = now

    def _wire_usage(self) -> WireUsage:
        u = self.usage
        prompt = u.prompt_tokens if u else 0
        completion = u.completion_tokens if u else 0
        return WireUsage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )
