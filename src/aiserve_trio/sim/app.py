"""The simulator's ASGI app: OpenAI HTTP (SSE and JSON), embeddings, speech to text, the
debug endpoints.

The WebSocket protocol is served by :mod:`.ws`. See the package docstring
(:mod:`aiserve_trio.sim`) for the wire protocols, the fault headers,
``/sim/stats`` and ``/sim/requests``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import msgspec
import trio

from ..adapters.tokens import encoding_name_for, get_encoding
from ..util.vectors import DEFAULT_DIMENSIONS, embeddings_body, heavy
from .anthropic import AnthropicDialect
from .audio import hear, parse_form
from .azure import AzureDialect
from .bedrock import BedrockDialect
from .core import Done, Prepared, Receive, Scope, Send, SimCore, Stats, header_dict
from .dialect import Dialect, DialectError
from .gemini import GeminiDialect
from .model import Fault, FaultSpecError, Plan, choose_fault, prefill_delay
from .request import chat_decoder, embedding_inputs, embeddings_decoder
from .responses import ResponsesDialect
from .schema import SchemaError
from .wire import completion_body, reply_usage, sse_choices, sse_finish
from .ws import WS_PATH, serve_websocket

_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
MALFORMED_CHUNK = b'data: {"id": "broken", "choices": [{"delta": \n\n'
#: What a bad request is answered with 400 for (its body, a fault header, a schema).
_BAD_REQUEST = (msgspec.DecodeError, FaultSpecError, SchemaError, ValueError)
#: Every provider dialect the sim speaks, by the name ``--dialect`` takes.
ANTHROPIC = AnthropicDialect()
#: Anthropic's token counting endpoint (``anthropic`` dialect).
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
DIALECTS: dict[str, Dialect] = {
    "anthropic": ANTHROPIC,
    "azure": AzureDialect(),
    "gemini": GeminiDialect(),
    "bedrock": BedrockDialect(),
    "responses": ResponsesDialect(),
}
_enc = msgspec.json.Encoder()


def _error_body(message: str, code: str, type_: str = "server_error") -> bytes:
    return _enc.encode({"error": {"message": message, "type": type_, "param": None, "code": code}})


def _status_code(status: int) -> str:
    return "rate_limit_exceeded" if status == 429 else "simulated_server_error"


def _recorded(path: str) -> bool:
    """Whether ``GET /sim/requests`` shows requests to ``path`` (not its own, nor probes)."""
    return not path.startswith("/sim/") and path != "/healthz"


class SimApp(SimCore):
    """ASGI app simulating an OpenAI-compatible model server and its WebSocket twin."""

    # --- ASGI ------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "websocket":
            await serve_websocket(self, scope, receive, send)
        elif kind == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    # Load tokenizer tables before serving, not in the first request.
                    for model in self.settings.models:
                        get_encoding(encoding_name_for(model))
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        if path == "/sim/stats":
            await _reply(send, 200, _enc.encode(self.stats.as_dict(self.attempts())))
            return
        if path == "/sim/requests":
            await _reply(send, 200, _enc.encode(self.log.as_dict()))
            return
        if path == "/sim/reset" and method == "POST":
            self.reset()
            await _reply(send, 200, b'{"status":"reset"}')
            return
        if path == "/healthz":
            await _reply(send, 200, b'{"status":"ok"}')
            return
        body = await _read_body(receive)
        if body is None:
            return
        headers = header_dict(scope)
        if _recorded(path):
            query = scope.get("query_string", b"")
            shown = f"{path}?{query.decode('latin-1')}" if query else path
            self.log.add(shown, "http", headers, body)
        if path == "/v1/chat/completions" and method == "POST":
            await self._chat(headers, body, receive, send)
        elif path == "/v1/embeddings" and method == "POST":
            await self._embeddings(headers, body, receive, send)
        elif path == "/v1/audio/transcriptions" and method == "POST":
            await self._transcription(headers, body, receive, send)
        elif path == "/v1/models":
            data = [
                {"id": m, "object": "model", "owned_by": "aiserve-sim"}
                for m in self.settings.models
            ]
            await _reply(send, 200, _enc.encode({"object": "list", "data": data}))
        elif path == COUNT_TOKENS_PATH and "anthropic" in self.settings.dialects:
            await self._count_tokens(headers, body, send)
        elif (dialect := self._dialect_for(method, path)) is not None:
            query = scope.get("query_string", b"").decode("latin-1")
            await self._dialect(dialect, path, query, headers, body, receive, send)
        else:
            await _reply(send, 404, _error_body(f"no route {method} {path}", "unknown_url"))

    # --- shared by the model endpoints ----------------------------------------

    def _fault_and_budget(self, headers: dict[str, str]) -> tuple[Fault | None, float | None]:
        """The fault (``X-Sim-Fault*``) and budget (``X-Request-Timeout-Ms``) of one request.

        Raises:
            FaultSpecError, ValueError: a header the sim cannot read.
        """
        times_raw = headers.get("x-sim-fault-times")
        times = int(times_raw) if times_raw is not None else None
        attempt = self.attempt(headers.get("x-request-id"))
        fault = choose_fault(self.settings, headers.get("x-sim-fault"), times, attempt, self.rng)
        timeout = _timeout(headers.get("x-request-timeout-ms"))
        if timeout is not None:
            self.stats.last_timeout_ms = round(timeout * 1000)
        return fault, timeout

    async def _status_fault(
        self, send: Send, fault: Fault | None, error: Callable[[int], bytes] | None = None
    ) -> bool:
        """Count ``fault``; answer it if it is a status fault (then return True).

        Args:
            error: the error body for a status (a dialect's); default OpenAI's.
        """
        if fault is None:
            return False
        self.stats.count_fault(fault)
        if fault.kind != "status":
            return False
        extra = []
        if fault.retry_after is not None:
            extra.append((b"retry-after", _secs(fault.retry_after)))
        if error is not None:
            body = error(fault.status)
        else:
            body = _error_body(f"simulated {fault.status}", _status_code(fault.status))
        await _reply(send, fault.status, body, extra)
        return True

    async def _serve(
        self,
        receive: Receive,
        budget: float | None,
        reply: Callable[[Done], Awaitable[None]],
    ) -> None:
        """Run ``reply`` bounded by ``budget`` seconds, cancelled if the client disconnects."""
        done = Done()
        self.stats.open_streams += 1
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    _watch_disconnect, receive, nursery.cancel_scope, self.stats, done
                )
                with trio.move_on_after(budget if budget is not None else float("inf")) as ts:
                    await reply(done)
                if ts.cancelled_caught and not done.cancelled:
                    done.flag = True  # one outcome per reply: the watcher must not count it
                    self.stats.expired += 1
                nursery.cancel_scope.cancel(reason="reply finished")
        finally:
            self.stats.open_streams -= 1

    # --- chat completions --------------------------------------------------------

    async def _chat(
        self, headers: dict[str, str], body: bytes, receive: Receive, send: Send
    ) -> None:
        self.stats.requests += 1
        try:
            req = chat_decoder.decode(body)
            fault, timeout = self._fault_and_budget(headers)
            decided = self.decide_for(req)
        except _BAD_REQUEST as exc:
            await _reply(
                send, 400, _error_body(str(exc), "invalid_request", "invalid_request_error")
            )
            return
        if await self._status_fault(send, fault):
            return
        # Timing is drawn after the fault (and not for a status fault), as it always
        # was, so a seeded run with fault rates replays the same.
        ready = self.prepare(decided, req.max_completion_tokens or req.max_tokens)
        top = (req.top_logprobs or 0) if req.logprobs else None
        cid = f"chatcmpl-sim-{ready.serial}"
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage

            async def reply(done: Done) -> None:
                w = _SSEWriter(send, cid, req.model, done)
                await self._stream_sse(w, ready, fault, top, usage)

        else:

            async def reply(done: Done) -> None:
                await self._json(send, cid, req.model, ready, fault, top, done)

        await self._serve(receive, timeout, reply)

    async def _stream_sse(
        self, w: _SSEWriter, ready: Prepared, fault: Fault | None, top: int | None, usage: bool
    ) -> None:
        plan, script = ready.plan, ready.script
        await w.start()

        def piece(k: int) -> bytes:
            return b"".join(w.event(c) for c in sse_choices(script, k, top))

        if not await _paced(plan, fault, piece, w.raw):
            return  # leaving mid-body makes hypercorn close the connection
        # Counted before the last write: the client may hang up as soon as it has it.
        self.stats.completed += 1
        out = w.event(sse_finish(script, plan))
        if usage:
            out += w.event(None, usage=reply_usage(plan, ready.prompt_tokens, ready.cache_read))
        await w.finish(out + b"data: [DONE]\n\n")

    async def _json(
        self,
        send: Send,
        cid: str,
        model: str,
        ready: Prepared,
        fault: Fault | None,
        top: int | None,
        done: Done,
    ) -> None:
        await trio.sleep(ready.plan.total)
        if not await _body_fault(send, fault):
            return
        body = completion_body(
            cid, model, ready.script, ready.plan, ready.prompt_tokens, top, ready.cache_read
        )
        done.flag = True
        self.stats.completed += 1
        await _reply(send, 200, _enc.encode(body))

    # --- provider dialects ------------------------------------------------------

    def _dialect_for(self, method: str, path: str) -> Dialect | None:
        for name in self.settings.dialects:
            dialect = DIALECTS.get(name)
            if dialect is not None and dialect.matches(method, path):
                return dialect
        return None

    async def _dialect(
        self,
        d: Dialect,
        path: str,
        query: str,
        headers: dict[str, str],
        body: bytes,
        receive: Receive,
        send: Send,
    ) -> None:
        """A provider's request, answered in its format (``dialect.py``): the same
        decisions, timing and faults as ``/v1/chat/completions``."""
        self.stats.requests += 1
        refused = d.auth_error(headers)
        if refused is not None:
            await _reply(send, refused[0], refused[1])
            return
        try:
            ask = d.read(path, query, body)
            d = ask.render or d
            fault, timeout = self._fault_and_budget(headers)
            decided = self.decide_for(ask)
        except (*_BAD_REQUEST, DialectError) as exc:
            status = exc.status if isinstance(exc, DialectError) else 400
            await _reply(send, status, d.error(status, str(exc)))
            return
        if await self._status_fault(send, fault, lambda status: d.error(status, "simulated")):
            return
        # A provider's max_tokens is a cap (Anthropic requires one on every request):
        # the length is drawn as without it, and cut to it only when longer.
        ready = self.prepare(decided, None)
        cap = ask.max_tokens
        if cap is not None and ready.plan.tokens - ready.plan.reasoning > cap:
            ready = self.prepare(decided, cap)

        async def streamed(done: Done) -> None:
            plan = ready.plan
            head = [(b"content-type", d.stream_type), (b"cache-control", b"no-cache")]
            await send({"type": "http.response.start", "status": 200, "headers": head})
            await _more(send, d.opening(ready, ask.model))
            if not await _paced(plan, fault, partial(d.token, ready), partial(_more, send)):
                return
            self.stats.completed += 1
            done.flag = True
            last = d.closing(ready, ask.model)
            await send({"type": "http.response.body", "body": last, "more_body": False})

        async def whole(done: Done) -> None:
            await trio.sleep(ready.plan.total)
            if not await _body_fault(send, fault):
                return
            done.flag = True
            self.stats.completed += 1
            await _reply(send, 200, d.whole(ready, ask.model))

        await self._serve(receive, timeout, streamed if ask.stream else whole)

    async def _count_tokens(self, headers: dict[str, str], body: bytes, send: Send) -> None:
        """Anthropic's ``POST /v1/messages/count_tokens`` (any method: the API's 405 is not
        worth simulating): ``{"input_tokens": N}``, N
        counted as a message request's ``usage.input_tokens`` is (not a model request:
        no serial, no fault, no stats)."""
        d = ANTHROPIC
        refused = d.auth_error(headers)
        if refused is not None:
            await _reply(send, refused[0], refused[1])
            return
        try:
            ask = d.read_count(body)
        except (*_BAD_REQUEST, DialectError) as exc:
            status = exc.status if isinstance(exc, DialectError) else 400
            await _reply(send, status, d.error(status, str(exc)))
            return
        n = self.prompt_tokens(ask.model, ask.messages)
        await _reply(send, 200, _enc.encode({"input_tokens": n}))

    # --- embeddings ------------------------------------------------------------

    async def _embeddings(
        self, headers: dict[str, str], body: bytes, receive: Receive, send: Send
    ) -> None:
        self.stats.requests += 1
        try:
            req = embeddings_decoder.decode(body)
            inputs = embedding_inputs(req.input)
            dims = DEFAULT_DIMENSIONS if req.dimensions is None else req.dimensions
            if dims < 1:
                raise ValueError("`dimensions` must be at least 1")
            if req.encoding_format not in ("float", "base64"):
                raise ValueError("`encoding_format` must be 'float' or 'base64'")
            fault, timeout = self._fault_and_budget(headers)
        except _BAD_REQUEST as exc:
            await _reply(
                send, 400, _error_body(str(exc), "invalid_request", "invalid_request_error")
            )
            return
        if await self._status_fault(send, fault):
            return
        counts = [len(x) if isinstance(x, list) else self.text_tokens(req.model, x) for x in inputs]
        delay = prefill_delay(self.settings.timing, sum(counts), self.rng)

        async def reply(done: Done) -> None:
            await trio.sleep(delay)
            if not await _body_fault(send, fault):
                return
            make = partial(embeddings_body, req.model, inputs, counts, dims, req.encoding_format)
            out = await trio.to_thread.run_sync(make) if heavy(inputs) else make()
            done.flag = True
            self.stats.completed += 1
            await _reply(send, 200, _enc.encode(out))

        await self._serve(receive, timeout, reply)

    # --- speech to text ---------------------------------------------------------

    async def _transcription(
        self, headers: dict[str, str], body: bytes, receive: Receive, send: Send
    ) -> None:
        """``{"text": ...}`` (or the bare text) after the prefill time of its tokens."""
        self.stats.requests += 1
        try:
            form = parse_form(headers.get("content-type"), body)
            text = hear(form)
            fault, timeout = self._fault_and_budget(headers)
        except _BAD_REQUEST as exc:
            await _reply(
                send, 400, _error_body(str(exc), "invalid_request", "invalid_request_error")
            )
            return
        if await self._status_fault(send, fault):
            return
        # The transcript's words stand for its tokens: the model may have no tokenizer table.
        delay = prefill_delay(self.settings.timing, len(text.split()), self.rng)

        async def reply(done: Done) -> None:
            await trio.sleep(delay)
            if not await _body_fault(send, fault):
                return
            done.flag = True
            self.stats.completed += 1
            if form.response_format == "text":
                await _reply(send, 200, text.encode(), content_type=b"text/plain; charset=utf-8")
            else:
                await _reply(send, 200, _enc.encode({"text": text}))

        await self._serve(receive, timeout, reply)


class _SSEWriter:
    """Frames OpenAI ``chat.completion.chunk`` events the way vLLM does."""

    def __init__(self, send: Send, cid: str, model: str, done: Done) -> None:
        self._send = send
        self._done = done
        self._head = {"id": cid, "object": "chat.completion.chunk", "created": 0, "model": model}

    async def start(self) -> None:
        await self._send({"type": "http.response.start", "status": 200, "headers": _SSE})

    async def raw(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    def event(self, choice: dict[str, Any] | None, **extra: Any) -> bytes:
        """One ``data:`` event with ``choice`` (``None``: ``choices: []``, as usage chunks have)."""
        choices = [choice] if choice is not None else []
        return b"data: " + _enc.encode({**self._head, "choices": choices, **extra}) + b"\n\n"

    async def finish(self, data: bytes) -> None:
        self._done.flag = True
        await self._send({"type": "http.response.body", "body": data, "more_body": False})


async def _more(send: Send, data: bytes) -> None:
    if data:  # a dialect may have nothing to send for a token (Gemini: a call comes whole)
        await send({"type": "http.response.body", "body": data, "more_body": True})


async def _paced(
    plan: Plan,
    fault: Fault | None,
    piece: Callable[[int], bytes],
    write: Callable[[bytes], Awaitable[None]],
) -> bool:
    """Write each output token's bytes when the plan says it is due, acting out a stall,
    drop or malformed fault at its token. Returns False when the reply was dropped."""
    await trio.sleep(plan.ttft)
    for k in range(plan.tokens):
        if k:
            await trio.sleep(plan.gaps[k - 1])
        if fault is not None and k == fault.after:
            if fault.kind == "stall":
                await trio.sleep_forever()
            if fault.kind == "drop":
                return False
            if fault.kind == "malformed":
                await write(MALFORMED_CHUNK)
        await write(piece(k))
    return True


async def _body_fault(send: Send, fault: Fault | None) -> bool:
    """Act out a stall / drop / malformed fault of a JSON reply; False: nothing more to send."""
    if fault is None:
        return True
    if fault.kind == "stall":
        await trio.sleep_forever()
    if fault.kind == "drop":
        return False  # no response at all: hypercorn answers 500 or closes
    if fault.kind == "malformed":
        await _reply(send, 200, MALFORMED_CHUNK)
        return False
    return True


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body, or ``None`` when the client went away first."""
    body = bytearray()
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        body += msg.get("body", b"")
        if not msg.get("more_body", False):
            return bytes(body)


async def _watch_disconnect(
    receive: Receive, scope: trio.CancelScope, stats: Stats, done: Done
) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            if not done.flag:
                done.cancelled = True
                stats.cancelled += 1
                scope.cancel(reason="client disconnected")
            return


async def _reply(
    send: Send,
    status: int,
    body: bytes,
    extra: list[tuple[bytes, bytes]] | None = None,
    *,
    content_type: bytes = b"application/json",
) -> None:
    headers = [
        (b"content-type", content_type),
        (b"content-length", str(len(body)).encode()),
        *(extra or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _timeout(raw: str | None) -> float | None:
    if raw is None:
        return None
    ms = int(raw.strip())
    if ms <= 0:
        raise ValueError("X-Request-Timeout-Ms must be positive")
    return ms / 1000.0


def _secs(value: float) -> bytes:
    return (str(int(value)) if value == int(value) else f"{value:g}").encode()


__all__ = ["MALFORMED_CHUNK", "WS_PATH", "SimApp"]
