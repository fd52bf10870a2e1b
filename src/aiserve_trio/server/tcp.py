"""The seam's server class for hypercorn's Trio worker, and what it builds per connection.

:class:`GatewayTCPServer` is what hypercorn's worker builds for each accepted connection
once the seam is installed (``seam.py``), bound to the worker's :class:`~.worker.Worker`;
everything the gateway changes in hypercorn hangs off it:

- :class:`GatewayTCPServer` (hypercorn's ``TCPServer``): direct socket reads and writes
  with a fairness checkpoint (``directio.py``), the keep-alive timer as one task
  (``idle.py``), one connection's exception contained to it and addresses in the
  worker's penalty box refused at accept, the config seen through the worker's
  :class:`~.worker.DatedConfig` (the ``Date`` header formatted once a second);
- :class:`GatewayTaskGroup` (hypercorn's ``TaskGroup``): starts the app with a
  :class:`~.disconnect.ServerCall` and the worker's strike count in the scope's
  ``extensions``, and HTTP/1.1 writes coalesced (``coalesce.py``);
- :class:`GatewayProtocols` (hypercorn's ``ProtocolWrapper``): picks :class:`GatewayH11`
  or :class:`~.h2.GatewayH2`;
- :class:`GatewayH11` (hypercorn's ``H11Protocol``): holds the writes one ASGI message
  makes, and names the status in the status line (``200 OK``: some clients read it).
"""

from __future__ import annotations

import contextlib
import http
import logging
import socket
import struct
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Final

import h11
import trio
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.events import Body, EndBody, Response
from hypercorn.protocol.h11 import H2CProtocolRequiredError, H2ProtocolAssumedError, H11Protocol
from hypercorn.trio.task_group import TaskGroup, _handle
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.utils import parse_socket_addr

from ..http.turns import Turn
from ..http.types import ARRIVED, STRIKE, TURN, TURNS
from ..security.edge import PenaltyBox, peer_key
from . import directio
from .coalesce import HeldWrites, send_coalesced
from .disconnect import EXTENSION, ServerCall
from .h2 import GatewayH2
from .idle import IdleTimer
from .preread import TurnFirst
from .worker import Worker

log = logging.getLogger("aiserve_trio.seam")


# --- the server -----------------------------------------------------------------------


class GatewayTCPServer(TCPServer):
    """hypercorn's connection handler, as the gateway runs it (module docstring).

    hypercorn's worker builds it with its own five arguments; ``worker`` is bound by
    :func:`~.seam.install`.
    """

    def __init__(
        self, app: Any, config: Config, context: Any, state: Any, stream: Any, *, worker: Worker
    ) -> None:
        super().__init__(app, worker.dated(config), context, state, stream)
        self.worker = worker
        # Built in the step its connection is accepted (serve_listeners' start_soon).
        self.arrivals = directio.Arrivals(trio.current_time())
        #: The turn taken for the next request before it is read (``preread.py``).
        self.first = TurnFirst(worker.turns)
        self.idle_task = IdleTimer()  # type: ignore[assignment]

    async def run(self) -> None:
        try:
            if await refused(self.stream, self.worker.box):
                return
            await self._serve()
        except Exception:
            # One connection's failure must not end the worker and, through
            # hypercorn's parent, every other worker.
            log.exception("a connection handler failed; the connection was closed")
        except BaseExceptionGroup as group:
            errors, rest = group.split(Exception)
            if errors is not None:
                log.error("a connection handler failed", exc_info=errors)
            if rest is not None:
                raise rest from None

    async def _serve(self) -> None:
        # hypercorn's TCPServer.run, with the seam's task group and protocols.
        try:
            try:
                with trio.fail_after(self.config.ssl_handshake_timeout):
                    await self.stream.do_handshake()
            except (trio.BrokenResourceError, trio.TooSlowError):
                return  # Handshake failed
            alpn_protocol = self.stream.selected_alpn_protocol()
            sock = self.stream.transport_stream.socket
            ssl = True
        except AttributeError:  # Not SSL
            alpn_protocol = "http/1.1"
            sock = self.stream.socket
            ssl = False
        try:
            client = parse_socket_addr(sock.family, sock.getpeername())
            server = parse_socket_addr(sock.family, sock.getsockname())
            async with GatewayTaskGroup(self.worker, self.arrivals, self.first) as task_group:
                self._task_group = task_group
                self.protocol = GatewayProtocols(
                    self.app,
                    self.config,
                    self.context,
                    task_group,
                    self.state,
                    ssl,
                    client,
                    server,
                    self.protocol_send,
                    alpn_protocol,
                    worker=self.worker,
                )
                await self.protocol.initiate()
                await self.idle_task.restart(self._task_group, self._idle_timeout)
                await self._read_data()
        except OSError:
            pass
        finally:
            await self._close()

    async def protocol_send(self, event: Event) -> None:
        stream: Any = self.stream  # hypercorn types it as TLS; plain TCP is the common case
        if (
            type(event) is RawData
            and type(stream) is trio.SocketStream
            and not self.send_lock.locked()
        ):
            data = event.data
            sent = directio.write_now(stream, data)
            if sent is None:  # the client is gone
                await self.protocol.handle(Closed())
                return
            if sent == len(data):
                return
            if sent:
                event = RawData(data=data[sent:])
        elif type(event) is not RawData:
            # Updated(idle=True): the exchange ended; Closed: the connection did. A read
            # that waits for either (preread.py) goes on.
            self.first.cycled()
        await super().protocol_send(event)

    async def _read_data(self) -> None:
        try:
            stream: Any = self.stream
            if type(stream) is not trio.SocketStream:  # TLS: hypercorn's loop (it yields per read)
                await super()._read_data()
                return
            await directio.read_loop(
                self, stream.socket, Closed, RawData, self.arrivals, self.first
            )
        finally:
            timer: Any = self.idle_task
            timer.reading_ended()


async def refused(stream: Any, box: PenaltyBox | None) -> bool:
    """Close ``stream`` at once if its peer is in ``box``; whether it was.

    Before TLS and before h2: a refusal must cost less than what it saves.
    """
    transport = getattr(stream, "transport_stream", stream)  # TLS: the TCP below
    sock = transport.socket
    if box is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    try:
        host = sock.getpeername()[0]
    except OSError:
        return False  # already gone: hypercorn's own code deals with it
    if not box.refuses(peer_key(host), trio.current_time()):
        return False
    with contextlib.suppress(OSError):
        # A reset, not a FIN: no TIME_WAIT kept here for it, and the client's
        # next write fails at once.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await transport.aclose()
    return True


# --- the task group that starts the app -------------------------------------------------


class GatewayTaskGroup(TaskGroup):
    """Starts each app with the disconnect call, the worker's strike count and when its
    request arrived in its scope, HTTP/1.1 writes coalesced."""

    def __init__(
        self, worker: Worker, arrivals: directio.Arrivals, first: TurnFirst | None = None
    ) -> None:
        super().__init__()
        self._strike = worker.strike
        self._turns = worker.turns
        self._first = first
        #: The connection's read times (``directio.Arrivals``); TLS: stamped in
        #: ``GatewayProtocols.handle``, hypercorn's own read loop knowing nothing of them.
        self.arrivals = arrivals

    async def spawn_app(
        self,
        app: Any,
        config: Config,
        scope: Any,
        send: Callable[[Any], Awaitable[None]],
    ) -> Callable[[Any], Awaitable[None]]:
        app_send_channel, app_receive_channel = trio.open_memory_channel[Any](
            config.max_app_queue_size
        )
        put: Callable[[Any], Awaitable[None]] = app_send_channel.send
        if scope["type"] == "http":
            call = ServerCall()
            extensions = scope["extensions"]
            extensions[EXTENSION] = call
            extensions[STRIKE] = self._strike
            # The read that completed this request's head: its deadline counts from there.
            extensions[ARRIVED] = self.arrivals.read_at
            extensions[TURNS] = self._turns
            turn = self._first.handed() if self._first is not None else None
            if turn is not None:  # taken before the request was read (preread.py)
                extensions[TURN] = turn
                app = partial(_giving_back, turn, app)
            put = partial(_put, call, put)
            # send is the HTTPStream's app_send; its send, the protocol's stream_send.
            protocol = getattr(
                getattr(getattr(send, "__self__", None), "send", None), "__self__", None
            )
            if isinstance(protocol, GatewayH11):
                send = partial(send_coalesced, protocol.writes, send, protocol.write_held)
        assert self._nursery is not None
        self._nursery.start_soon(
            _handle,
            app,
            config,
            scope,
            app_receive_channel.receive,
            send,
            trio.to_thread.run_sync,
            trio.from_thread.run,
        )
        return put


async def _giving_back(turn: Turn, app: Any, *args: Any) -> None:
    """``app`` called; the request's turn given back when it ends, if the app has not."""
    try:
        await app(*args)
    finally:
        turn.release()


async def _put(call: ServerCall, put: Callable[[Any], Awaitable[None]], message: Any) -> None:
    """hypercorn queues a message for the app; a disconnect is also called."""
    if message["type"] == "http.disconnect":
        call.closed()
    await put(message)


# --- the protocols ------------------------------------------------------------------------


class GatewayProtocols(ProtocolWrapper):
    """hypercorn's protocol wrapper, picking the seam's HTTP/1.1 and HTTP/2 protocols."""

    def __init__(
        self,
        app: Any,
        config: Config,
        context: Any,
        task_group: Any,
        state: Any,
        ssl: bool,
        client: tuple[str, int] | None,
        server: tuple[str, int] | None,
        send: Callable[[Event], Awaitable[None]],
        alpn_protocol: str | None = None,
        *,
        worker: Worker,
    ) -> None:
        self.app = app
        self.config = config
        self.context = context
        self.task_group = task_group
        self.ssl = ssl
        self.client = client
        self.server = server
        self.send = send
        self.state = state
        self.worker = worker
        self.arrivals: directio.Arrivals = task_group.arrivals
        kind = GatewayH2 if alpn_protocol == "h2" else GatewayH11
        self.protocol = self._make(kind)

    def _make(self, kind: type[GatewayH11 | GatewayH2]) -> Any:
        args = (
            self.app,
            self.config,
            self.context,
            self.task_group,
            self.state,
            self.ssl,
            self.client,
            self.server,
            self.send,
        )
        if kind is GatewayH2:
            return GatewayH2(*args, worker=self.worker)  # its meters and penalty box
        return GatewayH11(*args)

    async def handle(self, event: Event) -> None:
        if self.ssl and type(event) is RawData:  # hypercorn's read loop: stamp its reads
            self.arrivals.read_at = trio.current_time()
        try:
            return await self.protocol.handle(event)
        except H2ProtocolAssumedError as error:
            self.protocol = self._make(GatewayH2)
            await self.protocol.initiate()
            if error.data != b"":
                return await self.protocol.handle(RawData(data=error.data))
        except H2CProtocolRequiredError as error:
            h2_protocol: GatewayH2 = self._make(GatewayH2)
            self.protocol = h2_protocol
            await h2_protocol.initiate(error.headers, error.settings)
            if error.data != b"":
                return await self.protocol.handle(RawData(data=error.data))


#: ``HTTP/1.1 200 \r\n`` -> ``HTTP/1.1 200 OK\r\n``, for every status Python names.
_STATUS_LINES: Final = {
    s.value: (b"HTTP/1.1 %d \r\n" % s.value, b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()))
    for s in http.HTTPStatus
}


def status_line_named(head: bytes, status: int) -> bytes:
    """``head`` (a response head as h11 wrote it) with the status's reason phrase.

    h11 writes the empty reason phrase hypercorn gives it (``HTTP/1.1 200 \r\n``): valid
    HTTP/1.1, but clients that read the status from the phrase -- ``h2load --h1`` among
    them, which then counts every answer as failed -- do better with ``200 OK``.
    """
    lines = _STATUS_LINES.get(status)
    if lines is None or not head.startswith(lines[0]):
        return head
    return lines[1] + head[len(lines[0]) :]


class GatewayH11(H11Protocol):
    """hypercorn's HTTP/1.1 protocol, writing what one ASGI message makes at once, with
    the status named in the status line (:func:`status_line_named`)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.writes = HeldWrites()

    async def write_held(self, data: bytes) -> None:
        await self.send(RawData(data=data))

    async def _send_h11_event(self, event: Any) -> None:
        try:
            data = self.connection.send(event)
        except h11.LocalProtocolError:
            if self.connection.their_state != h11.ERROR:
                raise
            return
        if type(event) is h11.Response and not event.reason:
            data = status_line_named(data, event.status_code)
        if not self.writes.hold(data):
            await self.send(RawData(data=data))

    async def stream_send(self, event: Any) -> None:
        if self.writes.held is not None and not isinstance(event, Response | Body | EndBody):
            data = (
                self.writes.take()
            )  # the stream's close, websocket data: what was held goes first
            if data:
                await self.write_held(data)
        await super().stream_send(event)
