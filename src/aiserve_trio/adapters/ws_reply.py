"""Decoding a WebSocket model server's reply messages (sans-IO): messages in, deltas out.

The protocol is the one :mod:`aiserve_trio.sim` documents. A request's reply is
``reasoning`` messages (``text``), ``token`` messages (``text``), ``tool_call``
messages (``index``, on a call's first fragment ``call_id`` and ``name``, and
an ``arguments`` fragment), and one ``done`` (``finish_reason``, ``usage``), or
an ``error`` (``status``, ``message``, ``retry_after``) instead of the ``done``.
Every message may carry the request's ``id``; one for another request means
the connection is out of step.

:class:`WsReplyDecoder` takes one message at a time and tells the caller
whether the reply is over (:attr:`~WsReplyDecoder.ended`): after a ``done``
or an ``error`` the connection is in step and may carry the next request;
after anything else that went wrong it may not.
"""

from __future__ import annotations

import msgspec

from ..core.errors import UpstreamError, UpstreamProtocolError, UpstreamStatusError, UpstreamTimeout
from .base import Delta, ToolCallDelta, Usage, cache_counts

_NULL = msgspec.Raw(b"null")


class _WUsage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: msgspec.Raw = _NULL
    completion_tokens_details: msgspec.Raw = _NULL


class _Incoming(msgspec.Struct):
    type: str
    id: str | None = None
    text: str = ""
    finish_reason: str | None = None
    usage: _WUsage | None = None
    status: int = 0
    retry_after: float | None = None
    message: str = ""
    index: int = 0
    call_id: str | None = None
    name: str | None = None
    arguments: str = ""


_decoder = msgspec.json.Decoder(_Incoming)


def message_error(name: str, status: int, message: str, retry_after: float | None) -> UpstreamError:
    """The error for an ``error`` message from the server.

    408/504 are timeouts; anything else is a status error (a missing status
    counts as 500), retried before the first token when it is 429 or 5xx.
    """
    why = f"{name}: the model server answered {status}: {message[:300]}"
    if status in (408, 504):
        return UpstreamTimeout(why)
    return UpstreamStatusError(why, upstream_status=status or 500, retry_after=retry_after)


class WsReplyDecoder:
    """One request's reply on a connection.

    Attributes:
        ended: a ``done`` or an ``error`` arrived: the reply is over and the
            connection is in step (reusable).
        pieces: the non-empty ``token`` messages so far (the completion count
            when ``done`` carries no usage).
    """

    __slots__ = ("ended", "name", "pieces", "request_id")

    def __init__(self, name: str, request_id: str) -> None:
        """Start decoding the reply to ``request_id``.

        Args:
            name: the adapter's name, for error messages.
            request_id: the id the ``generate`` message carried.
        """
        self.name = name
        self.request_id = request_id
        self.ended = False
        self.pieces = 0

    def feed(self, message: str | bytes) -> list[Delta]:
        """The deltas one message gives: a token's text, or the final delta on ``done``.

        Raises:
            UpstreamError: the server answered ``error`` (a status or timeout
                error; :attr:`ended` is then True).
            UpstreamProtocolError: the message is malformed, of an unknown
                type, for another request, or came after the reply ended.
        """
        if self.ended:
            raise UpstreamProtocolError(f"{self.name}: a message arrived after the reply ended")
        try:
            msg = _decoder.decode(message)
        except (msgspec.DecodeError, UnicodeError) as exc:
            raise UpstreamProtocolError(
                f"{self.name}: the model server sent a malformed message"
            ) from exc
        if msg.id is not None and msg.id != self.request_id:
            raise UpstreamProtocolError(
                f"{self.name}: a message for request {msg.id!r} arrived during {self.request_id!r}"
            )
        if msg.type == "token":
            if not msg.text:
                return []
            self.pieces += 1
            return [Delta(text=msg.text)]
        if msg.type == "reasoning":
            if not msg.text:
                return []
            self.pieces += 1
            return [Delta(reasoning=msg.text)]
        if msg.type == "tool_call":
            self.pieces += 1
            first = msg.call_id is not None
            call = ToolCallDelta(
                index=msg.index,
                id=msg.call_id,
                type="function" if first else None,
                name=msg.name,
                arguments=msg.arguments,
            )
            return [Delta(tool_calls=[call])]
        if msg.type == "done":
            self.ended = True
            u = msg.usage
            details = (
                None if u is None or u.prompt_tokens_details == _NULL else u.prompt_tokens_details
            )
            read, write = cache_counts(details)
            usage = Usage(
                prompt_tokens=u.prompt_tokens if u else 0,
                completion_tokens=u.completion_tokens if u else self.pieces,
                prompt_details=details,
                cache_read_tokens=read,
                cache_write_tokens=write,
                completion_details=None if u is None or u.completion_tokens_details == _NULL
                else u.completion_tokens_details,
            )
            return [Delta(finish_reason=msg.finish_reason or "stop", usage=usage)]
        if msg.type == "error":
            self.ended = True
            raise message_error(self.name, msg.status, msg.message, msg.retry_after)
        raise UpstreamProtocolError(f"{self.name}: unknown message type {msg.type!r}")
