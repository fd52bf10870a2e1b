"""hypercorn's socket reads and writes made at once when the socket can do them, and
a read loop that yields to the other connections every so often.

hypercorn 0.18 writes every chunk of bytes through ``TCPServer.protocol_send``: the
connection's send lock, a shielded cancel scope, and Trio's ``send_all`` (a conflict
check, the socket call, a trip through the scheduler) -- for a reply the kernel
takes whole in one ``send``, which on a connection with room in its buffer is
nearly always. It reads through ``TCPServer._read_data``: a cancel scope per read
(even with no read timeout set) and Trio's ``receive_some``, which tries the socket,
waits, reads, and then yields to the scheduler once more.

The seam's ``GatewayTCPServer`` (``tcp.py``) uses direct attempts instead on
plain TCP connections:

- :func:`write_now`: a write, when nothing else is writing on the connection (its
  send lock is free), goes to the socket with one non-blocking ``send`` on its
  descriptor; what the socket does not take, and every write it cannot try (TLS,
  another write in progress), goes hypercorn's own way, after the part already
  written;
- :func:`read_loop`: a read takes what the socket has at once, and otherwise waits
  until the socket is readable (within ``read_timeout`` when one is set) and reads
  then. The end of the stream, a reset, a timeout and a close end the loop as they
  end hypercorn's, with ``Closed`` handed to the protocol.

A loop that never waits never lets another task run: a client that keeps the
socket readable with bytes that need no answer would hold the worker. So the read
loop reaches a Trio checkpoint once it has handed on :data:`YIELD_BYTES` bytes or
made :data:`YIELD_READS` reads since it last waited or yielded (``docs/hypercorn.md``
has the measurement behind the numbers). No two writes interleave: the direct one
is synchronous and only runs while no other write holds the lock.

The read loop also notes when the bytes it hands on arrived (:class:`Arrivals`): the
request a read completes is stamped with it (``http.types.ARRIVED``), and its deadline
counts from there, not from when its app task first runs.
"""

from __future__ import annotations

import math
import os
from typing import Any

import trio

from .preread import TurnFirst, take_turn_first, waits_for_cycle, waits_for_turn

#: hypercorn's read size (``hypercorn.trio.tcp_server.MAX_RECV``).
MAX_RECV = 2**16
#: The read loop yields after handing on this many bytes without waiting (the HTTP/2
#: guard's slice, ``security.edge.FEED_SLICE``: about 4 ms of the costliest frames) ...
YIELD_BYTES = 2048
#: ... or after this many reads without waiting (small segments: a read costs ~0.5 µs).
YIELD_READS = 64


def write_now(stream: Any, data: bytes) -> int | None:
    """Write what the socket of ``stream`` takes of ``data`` at once.

    Returns:
        the bytes written (0: none, the socket is full); None: the connection is gone
        (reset, broken pipe, closed).
    """
    try:
        return os.write(stream.socket.fileno(), data)
    except BlockingIOError:
        return 0
    except OSError:
        return None


class Arrivals:
    """When the bytes a connection's protocol is handling arrived (``trio.current_time()``).

    ``read_at`` starts as the connection's accept: bytes the read loop finds at its first
    read, without waiting, were there before its handler ran -- sent with the connect, and
    waiting in the kernel while the worker started the connections accepted before. After
    that, each read's time: a read that waited is made when they came (one scheduler pass
    later at most), a read that did not wait, when the bytes are taken. A request's head is
    parsed in the read that completes it, so the time in force when the app is spawned is
    its arrival (a pipelined HTTP/1.1 request: the read its bytes came in).
    """

    __slots__ = ("read_at",)

    def __init__(self, accepted: float) -> None:
        self.read_at = accepted


async def read_loop(
    server: Any,
    sock: Any,
    closed: type,
    raw_data: type,
    arrivals: Arrivals | None = None,
    first: TurnFirst | None = None,
) -> None:
    """hypercorn's read loop, reading the socket directly (see the module docstring);
    each read's time noted in ``arrivals``; with ``first``, a request that would wait for
    its turn waits before it is read (``preread.py``)."""
    try:
        await _read_loop(server, sock, closed, raw_data, arrivals, first)
    finally:
        if first is not None:
            first.drop()


async def _read_loop(
    server: Any,
    sock: Any,
    closed: type,
    raw_data: type,
    arrivals: Arrivals | None,
    first: TurnFirst | None,
) -> None:
    timeout = server.config.read_timeout or math.inf
    protocol = server.protocol
    unyielded = reads = 0
    fresh = True  # no read made and no wait yet: bytes found now came with the connect
    while True:
        try:
            data = os.read(sock.fileno(), MAX_RECV)  # -1 once closed: an OSError
        except BlockingIOError:
            fresh = False
            try:
                if timeout == math.inf:
                    await trio.lowlevel.wait_readable(sock)
                else:
                    with trio.fail_after(timeout):
                        await trio.lowlevel.wait_readable(sock)
            except (trio.ClosedResourceError, trio.TooSlowError):
                break
            unyielded = reads = 0
            continue
        except OSError:  # reset, or closed under us
            break
        if fresh:
            fresh = False  # the accept's time stands
        elif arrivals is not None:
            arrivals.read_at = trio.current_time()
        if waits_for_cycle(first, data, protocol):
            assert first is not None
            await first.next_cycle()
        if waits_for_turn(first, data, protocol):
            assert first is not None
            await take_turn_first(first, server.idle_task)
            await protocol.handle(raw_data(data=data))
            first.settle(protocol)
        else:
            await protocol.handle(raw_data(data=data))
        if not data:
            break
        unyielded += len(data)
        reads += 1
        if unyielded >= YIELD_BYTES or reads >= YIELD_READS:
            await trio.lowlevel.checkpoint()
            unyielded = reads = 0
    await protocol.handle(closed())
