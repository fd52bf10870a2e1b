"""The sim's WebSocket protocol (the ``vllm_ws`` adapter's): one ``generate`` at a time per socket.

See the package docstring (:mod:`aiserve_trio.sim`) for the messages.
"""

from __future__ import annotations

from typing import Any

import msgspec
import trio

from .core import Disconnected, Done, Prepared, Receive, Scope, Send, SimCore, Stats, header_dict
from .model import Fault, FaultSpecError, choose_fault
from .request import ws_decoder
from .schema import SchemaError
from .wire import ws_done, ws_messages

WS_PATH = "/v1/ws"
_enc = msgspec.json.Encoder()


async def serve_websocket(sim: SimCore, scope: Scope, receive: Receive, send: Send) -> None:
    """Serve one WebSocket connection until the client closes it (or breaks the protocol)."""
    msg = await receive()  # websocket.connect
    if msg["type"] != "websocket.connect":
        return
    if scope["path"] != WS_PATH:
        await send({"type": "websocket.close", "code": 1008, "reason": "unknown path"})
        return
    headers = header_dict(scope)
    await send({"type": "websocket.accept"})
    sim.stats.ws_connections += 1
    conn = WsConn(send, receive)
    try:
        while True:
            text = await conn.next_text()
            if text is None:
                return
            sim.log.add(scope["path"], "ws", headers, text)
            if not await _request(sim, conn, text, headers):
                return
    except Disconnected:
        return


async def _request(sim: SimCore, conn: WsConn, text: str, headers: dict[str, str]) -> bool:
    """Serve one ``generate`` message; return whether the connection stays open."""
    try:
        req = ws_decoder.decode(text)
        if req.type != "generate":
            raise ValueError(f"unknown message type {req.type!r}")
        spec = req.fault if req.fault is not None else headers.get("x-sim-fault")
        times_raw = headers.get("x-sim-fault-times")
        times = (
            req.fault_times
            if req.fault_times is not None
            else (int(times_raw) if times_raw is not None else None)
        )
        fault = choose_fault(sim.settings, spec, times, sim.attempt(req.id), sim.rng)
    except (msgspec.DecodeError, FaultSpecError, ValueError) as exc:
        # Not our protocol: policy violation, and the connection is closed.
        await conn.send({"type": "error", "id": None, "status": 400, "message": str(exc)})
        await conn.close(1008, "bad request message")
        return False
    sim.stats.requests += 1
    try:
        decided = sim.decide_for(req)
    except SchemaError as exc:
        # A well-formed message asking for the impossible: an error reply, as HTTP's 400.
        await conn.send({"type": "error", "id": req.id, "status": 400, "message": str(exc)})
        return True
    if req.timeout_ms is not None:
        sim.stats.last_timeout_ms = req.timeout_ms
    if fault is not None:
        sim.stats.count_fault(fault)
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
    ready = sim.prepare(decided, req.max_tokens)
    timeout = req.timeout_ms / 1000 if req.timeout_ms is not None else float("inf")
    sim.stats.open_streams += 1
    try:
        async with trio.open_nursery() as nursery:
            # The client may close mid-reply; a reader notices it while we sleep.
            done = Done()
            nursery.start_soon(conn.watch_close, nursery.cancel_scope, sim.stats, done)
            with trio.move_on_after(timeout) as ts:
                keep = await _tokens(sim, conn, req.id, ready, fault, done)
            if ts.cancelled_caught and not done.cancelled:
                done.flag = True
                sim.stats.expired += 1
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
        sim.stats.open_streams -= 1
    if conn.closed:
        raise Disconnected
    return keep


async def _tokens(
    sim: SimCore, conn: WsConn, rid: str, ready: Prepared, fault: Fault | None, done: Done
) -> bool:
    plan, script = ready.plan, ready.script
    await trio.sleep(plan.ttft)
    for k in range(plan.tokens):
        if k:
            await trio.sleep(plan.gaps[k - 1])
        if fault is not None and k == fault.after:
            if fault.kind == "stall":
                await trio.sleep_forever()
            if fault.kind == "drop":
                await conn.close(1011, "simulated drop")
                return False
            if fault.kind == "malformed":
                await conn.send_raw('{"type": "token", "id": ')
        for m in ws_messages(rid, script, k):
            await conn.send(m)
    done.flag = True
    sim.stats.completed += 1
    await conn.send(ws_done(rid, script, plan, ready.prompt_tokens))
    return True


class WsConn:
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

    async def watch_close(self, scope: trio.CancelScope, stats: Stats, done: Done) -> None:
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
