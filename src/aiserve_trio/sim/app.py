"""The simulator's ASGI app: OpenAI HTTP (SSE and JSON) and the WebSocket protocol.

See the package docstring (:mod:`aiserve_trio.sim`) for the wire protocols,
the fault headers and ``/sim/stats``.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from ..adapters.tokens import encoding_name_for, get_encoding
from .model import Fault, FaultSpecError, Plan, SimSettings, choose_fault, plan_reply, token_text

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

WS_PATH = "/v1/ws"
#: Request keys remembered for ``X-Sim-Fault-Times`` attempt counting.
_MAX_KEYS = 4096
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
MALFORMED_CHUNK = b'data: {"id": "broken", "choices": [{"delta": \n\n'


class SimMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        c = self.content
        if c is None:
            return ""
        if isinstance(c, str):
            return c
        return "".join(str(p.get("text") or "") for p in c)


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class SimChatRequest(msgspec.Struct):
    messages: list[SimMessage]
    model: str = "sim-model"
    stream: bool = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream_options: StreamOptions | None = None


class WsGenerate(msgspec.Struct):
    """The client's request message on the WebSocket protocol."""

    id: str
    messages: list[SimMessage]
    type: str = "generate"
    model: str = "sim-model"
    max_tokens: int | None = None
    timeout_ms: int | None = None
    fault: str | None = None
    fault_times: int | None = None


_chat_decoder = msgspec.json.Decoder(SimChatRequest)
_ws_decoder = msgspec.json.Decoder(WsGenerate)
_enc = msgspec.json.Encoder()


@dataclass(slots=True)
class Stats:
    """Counters served at ``GET /sim/stats``."""

    requests: int = 0
    completed: int = 0
    #: The client went away (HTTP disconnect, WebSocket closed) mid-reply.
    cancelled: int = 0
    #: The upstream budget (``X-Request-Timeout-Ms`` / ``timeout_ms``) ran out.
    expired: int = 0
    open_streams: int = 0
    ws_connections: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    last_timeout_ms: int | None = None

    def as_dict(self, attempts: dict[str, int]) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "completed": self.completed,
            "cancelled": self.cancelled,
            "expired": self.expired,
            "open_streams": self.open_streams,
            "ws_connections": self.ws_connections,
            "faults": dict(self.faults),
            "last_timeout_ms": self.last_timeout_ms,
            "attempts": attempts,
        }


class _Disconnected(Exception):
    """The peer went away while a reply was being generated."""


def _error_body(message: str, code: str, type_: str = "server_error") -> bytes:
    return _enc.encode({"error": {"message": message, "type": type_, "param": None, "code": code}})


def _status_code(status: int) -> str:
    return "rate_limit_exceeded" if status == 429 else "simulated_server_error"


class SimApp:
    """ASGI app simulating an OpenAI-compatible model server and its WebSocket twin."""

    def __init__(self, settings: SimSettings | None = None) -> None:
        self.settings = settings or SimSettings()
        self.rng = random.Random(self.settings.seed)
        self.stats = Stats()
        self._attempts: OrderedDict[str, int] = OrderedDict()
        self._serial = 0

    # --- shared ----------------------------------------------------------------

    def _attempt(self, key: str | None) -> int:
        """Count an attempt of request ``key`` (1-based); unkeyed requests are always 1."""
        if not key:
            return 1
        n = self._attempts.pop(key, 0) + 1
        self._attempts[key] = n
        while len(self._attempts) > _MAX_KEYS:
            self._attempts.popitem(last=False)
        return n

    def _prompt_tokens(self, model: str, messages: list[SimMessage]) -> int:
        enc = get_encoding(encoding_name_for(model))
        return sum(3 + len(enc.encode_ordinary(m.text())) for m in messages) + 3

    def _plan(self, model: str, messages: list[SimMessage], max_tokens: int | None) -> Plan:
        return plan_reply(
            self.settings.timing, self._prompt_tokens(model, messages), max_tokens, self.rng
        )

    def reset(self) -> None:
        self.stats = Stats()
        self._attempts.clear()

    # --- ASGI ------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "websocket":
            await self._websocket(scope, receive, send)
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
        if path == "/v1/chat/completions" and method == "POST":
            await self._chat(scope, receive, send)
        elif path == "/sim/stats":
            await _reply(send, 200, _enc.encode(self.stats.as_dict(dict(self._attempts))))
        elif path == "/sim/reset" and method == "POST":
            self.reset()
            await _reply(send, 200, b'{"status":"reset"}')
        elif path == "/v1/models":
            data = [
                {"id": m, "object": "model", "owned_by": "aiserve-sim"}
                for m in self.settings.models
            ]
            await _reply(send, 200, _enc.encode({"object": "list", "data": data}))
        elif path == "/healthz":
            await _reply(send, 200, b'{"status":"ok"}')
        else:
            await _reply(send, 404, _error_body(f"no route {method} {path}", "unknown_url"))

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        body = bytearray()
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            if not msg.get("more_body", False):
                break
        self.stats.requests += 1
        self._serial += 1
        try:
            req = _chat_decoder.decode(body)
            times_raw = headers.get("x-sim-fault-times")
            times = int(times_raw) if times_raw is not None else None
            attempt = self._attempt(headers.get("x-request-id"))
            fault = choose_fault(
                self.settings, headers.get("x-sim-fault"), times, attempt, self.rng
            )
            timeout = _timeout(headers.get("x-request-timeout-ms"))
        except (msgspec.DecodeError, FaultSpecError, ValueError) as exc:
            await _reply(
                send, 400, _error_body(str(exc), "invalid_request", "invalid_request_error")
            )
            return
        if timeout is not None:
            self.stats.last_timeout_ms = round(timeout * 1000)
        if fault is not None:
            self.stats.faults[fault.kind if fault.kind != "status" else str(fault.status)] += 1
            if fault.kind == "status":
                extra = []
                if fault.retry_after is not None:
                    extra.append((b"retry-after", _secs(fault.retry_after)))
                msg_ = f"simulated {fault.status}"
                await _reply(
                    send, fault.status, _error_body(msg_, _status_code(fault.status)), extra
                )
                return
        max_tokens = req.max_completion_tokens or req.max_tokens
        plan = self._plan(req.model, req.messages, max_tokens)
        prompt = self._prompt_tokens(req.model, req.messages)
        cid = f"chatcmpl-sim-{self._serial}"
        done = _Done()
        writer = _SSEWriter(send, cid, req.model, done) if req.stream else None
        self.stats.open_streams += 1
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    _watch_disconnect, receive, nursery.cancel_scope, self.stats, done
                )
                with trio.move_on_after(timeout if timeout is not None else float("inf")) as ts:
                    if writer is not None:
                        usage = req.stream_options is not None and req.stream_options.include_usage
                        await self._stream_sse(writer, plan, fault, prompt, usage)
                    else:
                        await self._json(send, cid, req.model, plan, fault, prompt, done)
                if ts.cancelled_caught and not done.cancelled:
                    done.flag = True  # one outcome per reply: the watcher must not count it
                    self.stats.expired += 1
                nursery.cancel_scope.cancel(reason="reply finished")
        finally:
            self.stats.open_streams -= 1

    async def _stream_sse(
        self, w: _SSEWriter, plan: Plan, fault: Fault | None, prompt: int, usage: bool
    ) -> None:
        await w.start()
        await trio.sleep(plan.ttft)
        for i in range(plan.tokens):
            if i:
                await trio.sleep(plan.gaps[i - 1])
            if fault is not None and i == fault.after:
                if fault.kind == "stall":
                    await trio.sleep_forever()
                if fault.kind == "drop":
                    return  # leaving mid-body makes hypercorn close the connection
                if fault.kind == "malformed":
                    await w.raw(MALFORMED_CHUNK)
            await w.token(i)
        # Counted before the last write: the client may hang up as soon as it has it.
        self.stats.completed += 1
        await w.finish(plan.finish_reason, prompt, plan.tokens if usage else None)

    async def _json(
        self,
        send: Send,
        cid: str,
        model: str,
        plan: Plan,
        fault: Fault | None,
        prompt: int,
        done: _Done,
    ) -> None:
        await trio.sleep(plan.total)
        if fault is not None and fault.kind == "stall":
            await trio.sleep_forever()
        if fault is not None and fault.kind == "drop":
            return
        if fault is not None and fault.kind == "malformed":
            await _reply(send, 200, MALFORMED_CHUNK)
            return
        text = "".join(token_text(i) for i in range(plan.tokens))
        body = {
            "id": cid,
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": plan.finish_reason,
                }
            ],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": plan.tokens,
                "total_tokens": prompt + plan.tokens,
            },
        }
        done.flag = True
        self.stats.completed += 1
        await _reply(send, 200, _enc.encode(body))

    # --- WebSocket ---------------------------------------------------------------

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        msg = await receive()  # websocket.connect
        if msg["type"] != "websocket.connect":
            return
        if scope["path"] != WS_PATH:
            await send({"type": "websocket.close", "code": 1008, "reason": "unknown path"})
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        await send({"type": "websocket.accept"})
        self.stats.ws_connections += 1
        conn = _WsConn(send, receive)
        try:
            while True:
                text = await conn.next_text()
                if text is None:
                    return
                if not await self._ws_request(conn, text, headers):
                    return
        except _Disconnected:
            return

    async def _ws_request(self, conn: _WsConn, text: str, headers: dict[str, str]) -> bool:
        """Serve one ``generate`` message; return whether the connection stays open."""
        try:
            req = _ws_decoder.decode(text)
            if req.type != "generate":
                raise ValueError(f"unknown message type {req.type!r}")
            spec = req.fault if req.fault is not None else headers.get("x-sim-fault")
            times_raw = headers.get("x-sim-fault-times")
            times = (
                req.fault_times
                if req.fault_times is not None
                else (int(times_raw) if times_raw is not None else None)
            )
            fault = choose_fault(self.settings, spec, times, self._attempt(req.id), self.rng)
        except (msgspec.DecodeError, FaultSpecError, ValueError) as exc:
            # Not our protocol: policy violation, and the connection is closed.
            await conn.send({"type": "error", "id": None, "status": 400, "message": str(exc)})
            await conn.close(1008, "bad request message")
            return False
        self.stats.requests += 1
        if req.timeout_ms is not None:
            self.stats.last_timeout_ms = req.timeout_ms
        if fault is not None:
            self.stats.faults[fault.kind if fault.kind != "status" else str(fault.status)] += 1
            if fault.kind == "status":
                await conn.send(
                    {
                        "type": "error",
                        "id": req.id,
                        "status": fault.status,
                        "retry_after": fault.retry_after,
                        "message": f"simulated {fault.status}",
                    }
                )
                return True
        plan = self._plan(req.model, req.messages, req.max_tokens)
        prompt = self._prompt_tokens(req.model, req.messages)
        timeout = req.timeout_ms / 1000 if req.timeout_ms is not None else float("inf")
        self.stats.open_streams += 1
        try:
            async with trio.open_nursery() as nursery:
                # The client may close mid-reply; a reader notices it while we sleep.
                done = _Done()
                nursery.start_soon(conn.watch_close, nursery.cancel_scope, self.stats, done)
                with trio.move_on_after(timeout) as ts:
                    keep = await self._ws_tokens(conn, req.id, plan, fault, prompt, done)
                if ts.cancelled_caught and not done.cancelled:
                    done.flag = True
                    self.stats.expired += 1
                    await conn.send(
                        {
                            "type": "error",
                            "id": req.id,
                            "status": 504,
                            "message": "the request's timeout_ms ran out",
                        }
                    )
                    keep = True
                nursery.cancel_scope.cancel(reason="reply finished")
        finally:
            self.stats.open_streams -= 1
        if conn.closed:
            raise _Disconnected
        return keep

    async def _ws_tokens(
        self, conn: _WsConn, rid: str, plan: Plan, fault: Fault | None, prompt: int, done: _Done
    ) -> bool:
        await trio.sleep(plan.ttft)
        for i in range(plan.tokens):
            if i:
                await trio.sleep(plan.gaps[i - 1])
            if fault is not None and i == fault.after:
                if fault.kind == "stall":
                    await trio.sleep_forever()
                if fault.kind == "drop":
                    await conn.close(1011, "simulated drop")
                    return False
                if fault.kind == "malformed":
                    await conn.send_raw('{"type": "token", "id": ')
            await conn.send({"type": "token", "id": rid, "index": i, "text": token_text(i)})
        usage = {"prompt_tokens": prompt, "completion_tokens": plan.tokens}
        done.flag = True
        self.stats.completed += 1
        await conn.send(
            {"type": "done", "id": rid, "finish_reason": plan.finish_reason, "usage": usage}
        )
        return True


class _WsConn:
    """One accepted WebSocket: sends JSON, and has one reader at a time."""

    def __init__(self, send: Send, receive: Receive) -> None:
        self._send = send
        self._receive = receive
        self.closed = False
        self._inbox: list[str] = []

    async def next_text(self) -> str | None:
        if self._inbox:
            return self._inbox.pop(0)
        while True:
            msg = await self._receive()
            if msg["type"] == "websocket.disconnect":
                self.closed = True
                return None
            if msg["type"] == "websocket.receive":
                return str(msg.get("text") or (msg.get("bytes") or b"").decode("utf-8", "replace"))

    async def watch_close(self, scope: trio.CancelScope, stats: Stats, done: _Done) -> None:
        """While a reply is generated: queue messages, and cancel it if the peer goes."""
        while True:
            msg = await self._receive()
            if msg["type"] == "websocket.disconnect":
                self.closed = True
                if not done.flag:
                    done.cancelled = True
                    stats.cancelled += 1
                    scope.cancel(reason="client closed the WebSocket")
                return
            if msg["type"] == "websocket.receive":
                text = msg.get("text")
                if text is not None:
                    self._inbox.append(text)

    async def send(self, obj: dict[str, Any]) -> None:
        await self.send_raw(_enc.encode(obj).decode())

    async def send_raw(self, text: str) -> None:
        if not self.closed:
            await self._send({"type": "websocket.send", "text": text})

    async def close(self, code: int, reason: str) -> None:
        if not self.closed:
            self.closed = True
            await self._send({"type": "websocket.close", "code": code, "reason": reason})


class _SSEWriter:
    """Frames OpenAI ``chat.completion.chunk`` events the way vLLM does."""

    def __init__(self, send: Send, cid: str, model: str, done: _Done) -> None:
        self._send = send
        self._done = done
        self._head = {"id": cid, "object": "chat.completion.chunk", "created": 0, "model": model}

    async def start(self) -> None:
        await self._send({"type": "http.response.start", "status": 200, "headers": _SSE})

    async def raw(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return b"data: " + _enc.encode({**self._head, "choices": choices, **extra}) + b"\n\n"

    async def token(self, i: int) -> None:
        delta: dict[str, Any] = {"content": token_text(i)}
        if i == 0:
            delta["role"] = "assistant"
        await self.raw(self._event([{"index": 0, "delta": delta, "finish_reason": None}]))

    async def finish(self, reason: str, prompt: int, completion: int | None) -> None:
        out = self._event([{"index": 0, "delta": {}, "finish_reason": reason}])
        if completion is not None:
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
            out += self._event([], usage=usage)
        out += b"data: [DONE]\n\n"
        self._done.flag = True
        await self._send({"type": "http.response.body", "body": out, "more_body": False})


class _Done:
    """Set just before the last byte of a reply is sent (a disconnect after it is normal)."""

    __slots__ = ("cancelled", "flag")

    def __init__(self) -> None:
        self.flag = False
        self.cancelled = False


async def _watch_disconnect(
    receive: Receive, scope: trio.CancelScope, stats: Stats, done: _Done
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
    send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    headers = [*_JSON, (b"content-length", str(len(body)).encode()), *(extra or [])]
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
