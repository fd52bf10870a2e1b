"""The ``vllm_ws`` adapter: a local model server reached over WebSocket (trio-websocket).

The wire protocol is the one :mod:`aiserve_trio.sim` documents: one JSON
``generate`` message per request on a connection, answered by ``token``
messages and a final ``done`` (or an ``error`` with a status). A connection
carries one request at a time; finished connections go back to a small pool
(``pool_size`` idle connections) so a request does not pay a handshake.

trio-websocket runs a reader task per connection in a nursery that must outlive
each request: :meth:`aopen` starts a task in the app's lifetime nursery that
holds the adapter's own nursery for them (so a reader's crash is logged, not
fatal to the app) until :meth:`aclose`.

A request that is cancelled (client gone, budget spent) or fails mid-reply
closes its connection in a shielded ``finally`` -- the server sees the close
and stops generating -- and the connection is never reused.

Close codes and error messages become our errors: ``error`` with 429/5xx ->
:class:`UpstreamStatusError` (retried before the first token, honouring
``retry_after``), 504 -> :class:`UpstreamTimeout`; close 1013 (try again later)
-> status 503; 1011 (server error) -> status 500; 1002/1003/1007/1008/1009 and
undecodable messages -> :class:`UpstreamProtocolError`; any other close, a
refused handshake or a socket error -> :class:`UpstreamConnectError` (or
:class:`UpstreamStatusError` with the handshake's HTTP status).
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Iterator
from typing import Any

import msgspec
import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    HandshakeError,
    WebSocketConnection,
    connect_websocket_url,
)

from ..core.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
)
from ..observability.events import NULL_HOOK, UpstreamHook
from .base import Adapter, Capabilities, DeltaSink, InferenceRequest, budget_ms
from .compat import close_ws_stream
from .retry import Progress, RetryPolicy
from .settings import VllmWsAdapterConfig
from .tokens import fit_request
from .ws_reply import WsReplyDecoder

log = logging.getLogger("aiserve_trio.adapters.vllm_ws")
_CLOSE_GRACE = 1.0
_PROTOCOL_CLOSES = frozenset({1002, 1003, 1007, 1008, 1009})


#: Request fields the WebSocket protocol carries (besides the core), relayed as sent.
WS_FIELDS = frozenset(
    {
        "tools",
        "tool_choice",
        "response_format",
        "reasoning_effort",
        "stop",
        "temperature",
        "top_p",
        "seed",
    }
)


_encoder = msgspec.json.Encoder()


def close_error(name: str, code: int | None, reason: str | None) -> UpstreamError:
    """The error for a connection the server closed with ``code`` while a request ran."""
    why = f"{name}: the model server closed the WebSocket ({code} {reason or ''})".rstrip()
    if code == 1013:
        return UpstreamStatusError(why, upstream_status=503)
    if code == 1011:
        return UpstreamStatusError(why, upstream_status=500)
    if code in _PROTOCOL_CLOSES:
        return UpstreamProtocolError(why)
    return UpstreamConnectError(why)


@contextlib.contextmanager
def translate_errors(name: str) -> Iterator[None]:
    """Turn trio-websocket and socket exceptions into ``UpstreamError``."""
    try:
        yield
    except UpstreamError:
        raise
    except ConnectionRejected as exc:
        raise UpstreamStatusError(
            f"{name}: the model server refused the WebSocket handshake ({exc.status_code})",
            upstream_status=exc.status_code,
        ) from exc
    except HandshakeError as exc:
        raise UpstreamConnectError(f"{name}: the WebSocket handshake failed") from exc
    except ConnectionClosed as exc:
        r = exc.reason
        raise close_error(name, r.code if r else None, r.reason if r else None) from exc
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        raise UpstreamConnectError(f"{name}: cannot reach the model server") from exc


class VllmWsAdapter(Adapter):
    """Streams replies from a WebSocket model server over a small connection pool."""

    capabilities = Capabilities(fields=WS_FIELDS, parts=frozenset({"text"}))

    def __init__(
        self,
        name: str,
        config: VllmWsAdapterConfig,
        *,
        hook: UpstreamHook = NULL_HOOK,
        rng: random.Random | None = None,
    ) -> None:
        """Build the adapter (the pool's task starts in :meth:`aopen`).

        Args:
            name: the ``[adapters.NAME]`` key.
            config: its settings.
            hook: told of each upstream try, retry and final error.
            rng: jitter source (tests seed it).
        """
        super().__init__(
            name, config.models, policy=RetryPolicy.from_config(config), hook=hook, rng=rng
        )
        self.config = config
        self._headers = [(k.encode(), v.encode()) for k, v in config.headers.items()]
        self._idle: list[WebSocketConnection] = []
        self._nursery: trio.Nursery | None = None
        self._opened = False
        self._stop = trio.Event()
        self._stopped = trio.Event()
        #: Handshakes made (a pool that works keeps this near the concurrency).
        self.handshakes = 0

    async def aopen(self, nursery: trio.Nursery) -> None:
        """Start the task holding the connections' reader tasks in ``nursery``."""
        await nursery.start(self._hold_nursery)
        self._opened = True

    async def _hold_nursery(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Own the nursery the connections' reader tasks run in, until :meth:`aclose`."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await self._stop.wait()
                nursery.cancel_scope.cancel(reason="adapter closed")
        except Exception:  # a crash here would end the app's nursery: log it instead
            log.exception("adapter %s: connection reader failed", self.name)
        finally:
            self._nursery = None
            self._stopped.set()

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            idle, self._idle = self._idle, []
            with trio.move_on_after(_CLOSE_GRACE):
                for ws in idle:
                    if self._nursery is None:
                        break  # no readers (the app's nursery ended first): no handshake
                    await ws.aclose()
            for ws in idle:
                if ws.closed is None:  # out of time, or no readers: just drop the socket
                    await trio.aclose_forcefully(ws)
            self._stop.set()
            if self._opened:
                await self._stopped.wait()

    async def ready(self) -> bool:
        return self._nursery is not None

    async def prepare(self, request: InferenceRequest) -> InferenceRequest:
        """``request`` fitted to ``context_window`` (the oldest history dropped; ``tokens.py``).

        Raises:
            BadRequest: ``context_length_exceeded``, the prompt cannot fit.
        """
        return await fit_request(request, self.config.context_window, self.config.tokenizer)

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        """One ``generate`` on a pooled or new connection (see :meth:`Adapter.attempt`)."""
        generate: dict[str, Any] = {
            "type": "generate",
            "id": request.request_id,
            "model": self.config.upstream_model or request.model,
            "messages": [m.to_raw() for m in request.messages],
        }
        if request.max_tokens is not None:
            generate["max_tokens"] = request.max_tokens
        generate["timeout_ms"] = budget_ms(request.deadline)
        generate.update((k, v) for k, v in request.extra.items() if k in WS_FIELDS)
        payload = _encoder.encode(generate)
        ws: WebSocketConnection | None = None
        reply = WsReplyDecoder(self.name, request.request_id)
        try:
            with translate_errors(self.name):
                ws = await self._start(payload, request.deadline)
                while not reply.ended:
                    for delta in reply.feed(await ws.get_message()):
                        await send.send(delta)
        finally:
            if ws is not None:
                # Reused only when the reply ended in step (``done`` or an
                # ``error`` message); cancelled or broken, the server must see the close.
                if reply.ended and len(self._idle) < self.config.pool_size:
                    self._idle.append(ws)
                else:
                    await _discard(ws)

    async def _connect(self, deadline: float) -> WebSocketConnection:
        nursery = self._nursery
        if nursery is None:
            raise UpstreamConnectError(f"adapter {self.name} is not open")
        limit = min(deadline, trio.current_time() + self.config.connect_timeout_ms / 1000.0)
        with trio.move_on_at(limit) as scope:
            ws = await connect_websocket_url(nursery, self.config.url, extra_headers=self._headers)
            self.handshakes += 1
            return ws
        assert scope.cancelled_caught
        raise UpstreamTimeout(f"{self.name}: the WebSocket handshake timed out")

    async def _start(self, payload: bytes, deadline: float) -> WebSocketConnection:
        """A connection with the request sent: an idle one if it still works, else a new one."""
        while self._idle:
            ws = self._idle.pop()
            if ws.closed is not None:
                continue
            try:
                await ws.send_message(payload.decode())
                return ws
            except ConnectionClosed:
                continue  # the server closed it while idle: not this request's failure
        ws = await self._connect(deadline)
        try:
            await ws.send_message(payload.decode())
        except BaseException:
            await _discard(ws)
            raise
        return ws


async def _discard(ws: WebSocketConnection) -> None:
    """Close a connection that will not be reused; shielded, so cancellation still closes it."""
    with trio.CancelScope(shield=True):
        with trio.move_on_after(_CLOSE_GRACE):
            await ws.aclose()
        await close_ws_stream(ws)
