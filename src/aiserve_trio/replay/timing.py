"""Measuring one replayed request from the bytes it gets back (sans-IO).

:class:`StreamTimer` is fed the response as it arrives -- the status, then each
chunk of the body with the time it came -- and gives a :class:`Result`:

- TTFT: the scheduled start to the first chunk carrying a token (content,
  reasoning, a refusal or a tool call); none for a non-streamed reply, whose
  first byte comes with its last (it would put whole answers among first tokens);
- the gaps between successive chunks that carry tokens (several events read
  together arrived together: one chunk, no gap);
- the total: the scheduled start to the end of the body;
- the error: a status other than 200 (``http_503``), an error event in the
  stream (its code), a stream that ends without ``[DONE]`` (``truncated``), or
  what the caller reports (``timeout``, the transport's exception).

A replayed MCP tool call (``rpc=True``) is one JSON-RPC answer: a JSON-RPC error is
an error (``rpc_-32003``), and so is a result the tool marked ``isError``
(``tool_error``); it has a total and no first token.

Times are the caller's clock; measuring from the *scheduled* start counts the
time a request waited to be sent (no coordinated omission).
"""

from __future__ import annotations

import msgspec


class Result(msgspec.Struct, kw_only=True):
    """One replayed request, measured (seconds)."""

    #: Its number in the replay and the record it sent.
    n: int
    record: int
    scheduled: float
    status: int = 0
    ttft: float | None = None
    total: float | None = None
    gaps: list[float] = msgspec.field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None
    tool_calls: list[msgspec.Raw] | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None


class _ErrorBody(msgspec.Struct):
    code: str | None = None
    type: str | None = None


class _Event(msgspec.Struct):
    choices: list[_Choice] = []
    error: _ErrorBody | None = None


_event = msgspec.json.Decoder(_Event)


class _RpcError(msgspec.Struct):
    code: int = 0


class _RpcResult(msgspec.Struct):
    isError: bool = False


class _RpcAnswer(msgspec.Struct):
    result: _RpcResult | None = None
    error: _RpcError | None = None


_rpc = msgspec.json.Decoder(_RpcAnswer)


def rpc_error(body: bytes) -> str | None:
    """The error of a JSON-RPC answer to ``tools/call`` (None: the tool answered)."""
    try:
        answer = _rpc.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return "malformed_body"
    if answer.error is not None:
        return f"rpc_{answer.error.code}"
    if answer.result is None:
        return "malformed_body"
    if answer.result.isError:
        return "tool_error"
    return None


def _token(event: _Event) -> bool:
    for choice in event.choices:
        d = choice.delta
        if d is not None and (d.content or d.reasoning_content or d.refusal or d.tool_calls):
            return True
    return False


class StreamTimer:
    """Measures one response (see the module docstring)."""

    def __init__(
        self, n: int, record: int, scheduled: float, *, stream: bool, rpc: bool = False
    ) -> None:
        self.result = Result(n=n, record=record, scheduled=scheduled)
        self.stream = stream and not rpc
        self.rpc = rpc
        self._buffer = b""
        self._last: float | None = None
        self._done = False
        self._body = bytearray()  # a non-streamed reply or an error response, whole
        self._finished = False

    def head(self, status: int) -> None:
        self.result.status = status

    def feed(self, data: bytes, now: float) -> None:
        """A chunk of the body arrived at ``now``."""
        if not data or self._finished:
            return
        r = self.result
        if not self.stream or r.status != 200:
            self._body += data
            return
        self._buffer += data
        token = False
        while True:
            end, size = _event_end(self._buffer)
            if end < 0:
                break
            block, self._buffer = self._buffer[:end], self._buffer[end + size :]
            token = self._event(block) or token
        if token:
            if r.ttft is None:
                r.ttft = now - r.scheduled
            elif self._last is not None:
                r.gaps.append(now - self._last)
            self._last = now

    def _event(self, block: bytes) -> bool:
        data = b"\n".join(
            line[5:].lstrip(b" ") for line in block.splitlines() if line.startswith(b"data:")
        )
        if not data:
            return False  # a comment (heartbeat) or an id-only block
        if data == b"[DONE]":
            self._done = True
            return False
        try:
            event = _event.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._error("malformed_event")
            return False
        if event.error is not None:
            self._error(event.error.code or event.error.type or "error_event")
            return False
        return _token(event)

    def _error(self, code: str) -> None:
        if self.result.error is None:
            self.result.error = code

    def fail(self, error: str, now: float) -> Result:
        """The request ended at ``now`` without a whole response (timeout, transport error)."""
        self._error(error)
        return self.finish(now)

    def finish(self, now: float) -> Result:
        """The body ended at ``now``."""
        r = self.result
        if self._finished:
            return r
        self._finished = True
        r.total = now - r.scheduled
        if r.status != 200:
            self._error(f"http_{r.status}" if r.status else "no_response")
        elif self.rpc:
            error = rpc_error(bytes(self._body))
            if error is not None:
                self._error(error)
        elif not self.stream:
            try:
                body = _event.decode(bytes(self._body))
            except (msgspec.DecodeError, msgspec.ValidationError):
                self._error("malformed_body")
            else:
                if body.error is not None:
                    self._error(body.error.code or "error_body")
        elif not self._done:
            self._error("truncated")
        return r


def _event_end(buffer: bytes) -> tuple[int, int]:
    """Where the first complete SSE event of ``buffer`` ends, and its separator's size."""
    best, size = -1, 0
    for sep in (b"\n\n", b"\r\n\r\n"):
        i = buffer.find(sep)
        if i >= 0 and (best < 0 or i < best):
            best, size = i, len(sep)
    return best, size
