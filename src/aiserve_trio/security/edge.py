"""The edge guard's rules: meters and a penalty box, pure counters with a clock argument.

hypercorn 0.18 has failure modes we measured (see docs/architecture.md):

- an exception in one connection's handler (``priority.TooManyStreamsError``
  from a PRIORITY or HEADERS flood) escapes ``trio.serve_listeners`` and ends
  the worker, and hypercorn's parent then stops every worker: one hostile
  client takes the whole server down;
- HTTP/2 floods (rapid reset, SETTINGS, PING, PRIORITY, and frames that need no
  answer at all: WINDOW_UPDATE, unknown types, empty DATA, CONTINUATION) cost the
  server work per frame with no limit, starving well-behaved clients.

The gateway's seam (``server/``) applies these rules to every connection: its server
contains any exception to its connection and refuses addresses in the
:class:`PenaltyBox` at accept; its HTTP/2 protocol meters control frames
(:func:`control_frames`) and frames that cost work but get no answer
(:func:`idle_frames`, counted with :class:`FrameCounter`) per connection with token
buckets (:class:`FloodMeter`), and counts the streams its client resets before they
are answered (:class:`ResetMeter`, the rapid-reset rule of Envoy). A client over
any of them gets ``GOAWAY(ENHANCE_YOUR_CALM)`` and is disconnected, as Envoy and
nginx do, and its address goes into the worker's penalty box. Settings are keys of
hypercorn's TOML (:class:`EdgeSettings`). Nothing here does I/O, keeps state outside
the objects it makes, or touches hypercorn: the worker's settings and penalty box are
``server/worker.py``'s ``Worker``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import h2.events as ev

#: Control frames a connection may send in a burst, and per second after it.
FLOOD_BURST = 1_000
FLOOD_RATE = 200.0
#: A connection that opened more than this many streams is closed once more than
#: RESET_MAX_RATIO of them were reset by its client before the server answered
#: (Envoy: 500 streams, 50 %; fewer here, as each stream that gets that far costs
#: a Python task, and an attacker is caught after one or two reads).
RESET_MIN_STREAMS = 100
RESET_MAX_RATIO = 0.5
#: Frames that cost work but get no answer a connection may send in a burst, and per
#: second after it (a client reading a large download sends a WINDOW_UPDATE every
#: few frames it receives: far below this).
IDLE_BURST = 4_000
IDLE_RATE = 2_000.0
#: Bytes of one read handed to h2 at a time, the meters judging and the other
#: connections getting the loop between slices: the worst frame type (HEADERS +
#: RST_STREAM) costs about 4 ms a slice, a checkpoint 3 µs (docs/benchmarks.md, fairness).
FEED_SLICE = 2048
#: The HTTP/2 client connection preface (RFC 9113, 3.4).
PREFACE_LENGTH = 24
#: Failed authentications one address may make in a burst, and per second after it,
#: before it goes into the penalty box (a client with a typo in its key retries a few
#: times; a flood of guessed keys does not stop)...
STRIKE_BURST = 20
STRIKE_RATE = 0.5
#: ...unless the worker as a whole sees more than this burst and rate of them: a flood
#: from many addresses. Then every address is boxed at its first failure.
WORKER_STRIKE_BURST = 200
WORKER_STRIKE_RATE = 50.0
#: A failed-authentication offence counts as this many (its penalty starts 4x longer).
STRIKE_WEIGHT = 3


class FloodMeter:
    """A per-connection token bucket over control frames (sans-IO)."""

    __slots__ = ("_at", "_level", "burst", "rate")

    def __init__(self, now: float, burst: int = FLOOD_BURST, rate: float = FLOOD_RATE) -> None:
        self.burst = burst
        self.rate = rate
        self._level = float(burst)
        self._at = now

    def spend(self, now: float, frames: int) -> bool:
        """Charge ``frames`` control frames; False once the connection is over budget."""
        self._level = min(float(self.burst), self._level + (now - self._at) * self.rate)
        self._at = now
        self._level -= frames
        return self._level >= 0


class ResetMeter:
    """Streams one connection opened, and how many its client reset early (sans-IO).

    Rapid reset (CVE-2023-44487) opens streams and resets them at once: each costs
    the server a stream and an app task, the client nothing, and the resets keep
    it under any limit on concurrent streams. A client reset before the server
    answered is *premature*; a connection whose streams are mostly that is closed.
    """

    __slots__ = ("max_ratio", "min_streams", "premature", "streams")

    def __init__(
        self, min_streams: int = RESET_MIN_STREAMS, max_ratio: float = RESET_MAX_RATIO
    ) -> None:
        self.min_streams = min_streams
        self.max_ratio = max_ratio
        self.streams = 0
        self.premature = 0

    def count(self, opened: int, premature: int) -> bool:
        """Add ``opened`` streams and ``premature`` resets; False once the connection is
        over the rule (more than ``min_streams`` streams, more than ``max_ratio`` reset early)."""
        self.streams += opened
        self.premature += premature
        return not (
            self.streams > self.min_streams and self.premature > self.max_ratio * self.streams
        )


def early_resets(events: list[Any], unanswered: Callable[[int], bool]) -> tuple[int, int, set[int]]:
    """Streams ``events`` open, resets by the client before an answer, streams both opened
    and reset in ``events``.

    Args:
        events: what h2 made of one read.
        unanswered: whether an already open stream has not been answered yet.
    Returns:
        (streams opened, premature resets, the ids of streams opened and reset in
        ``events``: the client cancelled them before the server even saw them).
    """
    opened: set[int] = set()
    cancelled: set[int] = set()
    premature = 0
    for e in events:
        if isinstance(e, ev.RequestReceived):
            opened.add(e.stream_id)
        elif isinstance(e, ev.StreamReset) and e.remote_reset:
            if e.stream_id in opened:
                cancelled.add(e.stream_id)
                premature += 1
            elif unanswered(e.stream_id):
                premature += 1
    return len(opened), premature, cancelled


class PenaltyBox:
    """Peer addresses that misbehaved lately, refused at accept for a growing time (sans-IO).

    An attacker whose connection was closed reconnects at once, and each new
    connection costs the server its set-up and TLS handshake and h2 preface, then
    the frames the meters let through before their verdict. Refused at accept, a
    reconnect costs the server an accept and a close; the attacker loses what it
    sent. The first penalty lasts ``first`` seconds, each next offence doubles it
    up to ``longest``; an address that kept out of trouble for ``longest`` after
    its last penalty ended starts over. At most ``capacity`` addresses are kept,
    the one punished least recently going first, so memory stays bounded when
    many addresses misbehave (they then get shorter memories, not more memory).
    """

    __slots__ = ("_all", "_peers", "_strikes", "capacity", "first", "longest", "refused")

    def __init__(self, first: float, longest: float, capacity: int) -> None:
        self.first = first
        self.longest = longest
        self.capacity = capacity
        #: peer -> (offences, refused until): least recently punished first.
        self._peers: OrderedDict[str, tuple[int, float]] = OrderedDict()
        #: peer -> its lesser offences (failed authentications), least recent first.
        self._strikes: OrderedDict[str, FloodMeter] = OrderedDict()
        #: Every address's, together.
        self._all: FloodMeter | None = None
        #: Connections refused so far (for the log).
        self.refused = 0

    def __len__(self) -> int:
        return len(self._peers)

    def punish(self, peer: str, now: float, weight: int = 1) -> float:
        """Record an offence by ``peer`` (``weight``: counted as that many); returns how
        long it is refused from ``now``."""
        offences, until = self._peers.pop(peer, (0, now))
        if now - until > self.longest:
            offences = 0  # forgiven
        offences = min(offences + weight, 64)  # 2**63 times any penalty is past ``longest``
        penalty = min(self.longest, self.first * 2.0 ** (offences - 1))
        self._peers[peer] = (offences, now + penalty)
        while len(self._peers) > self.capacity:
            self._peers.popitem(last=False)
        return penalty

    def strike(self, peer: str, now: float) -> float:
        """Record a lesser offence by ``peer`` (a failed authentication). One beyond a
        burst of :data:`STRIKE_BURST` and :data:`STRIKE_RATE` per second is an offence
        (:meth:`punish`), and so is any while the worker's failures together are beyond
        :data:`WORKER_STRIKE_BURST` and :data:`WORKER_STRIKE_RATE`. Returns how long
        ``peer`` is refused from ``now`` (0: not)."""
        meter = self._strikes.pop(peer, None)
        if meter is None:
            meter = FloodMeter(now, STRIKE_BURST, STRIKE_RATE)
        self._strikes[peer] = meter
        while len(self._strikes) > self.capacity:
            self._strikes.popitem(last=False)
        if self._all is None:
            self._all = FloodMeter(now, WORKER_STRIKE_BURST, WORKER_STRIKE_RATE)
        flood = not self._all.spend(now, 1)
        if meter.spend(now, 1) and not flood:
            return 0.0
        # Guessing keys does not stop by itself: the first penalty is already the third's.
        return self.punish(peer, now, STRIKE_WEIGHT)

    def refuses(self, peer: str, now: float) -> bool:
        """Whether a connection from ``peer`` is refused at ``now`` (counted if so)."""
        entry = self._peers.get(peer)
        if entry is None or now >= entry[1]:
            return False
        self.refused += 1
        return True


def peer_key(host: str) -> str:
    """The address a penalty applies to: the IPv4 address, or the IPv6 /64.

    One IPv6 host usually holds a whole /64 and could take a new address for each
    connection; an IPv4 address mapped into IPv6 is the IPv4 address.
    """
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))
    return str(ip)


@dataclasses.dataclass(frozen=True)
class EdgeSettings:
    """The guard's settings, keys of hypercorn's TOML (``aiserve_`` + the field name).

    hypercorn keeps keys it does not know as attributes of its config, which the
    guard reads in the worker (see configs/hypercorn.toml).
    """

    #: The first penalty of a misbehaving address, in seconds; 0 turns the box off
    #: (behind a proxy every client has the proxy's address).
    penalty_first_s: float = 1.0
    #: The longest penalty: each offence doubles the last one up to this.
    penalty_max_s: float = 60.0
    #: Addresses remembered at most (a few hundred bytes each).
    penalty_peers: int = 4096
    #: :class:`ResetMeter`'s rule.
    h2_reset_min_streams: int = RESET_MIN_STREAMS
    h2_reset_max_ratio: float = RESET_MAX_RATIO


def edge_settings(config: object) -> tuple[EdgeSettings, list[str]]:
    """:class:`EdgeSettings` from hypercorn's ``config``, and what was wrong in it.

    A value of the wrong type or out of range is named in the problems and left at
    its default (the defaults are the protective ones).
    """
    checks: dict[str, tuple[type, Callable[[Any], bool], str]] = {
        "penalty_first_s": (float, lambda v: v >= 0, "a number of seconds >= 0"),
        "penalty_max_s": (float, lambda v: v > 0, "a number of seconds > 0"),
        "penalty_peers": (int, lambda v: v >= 1, "an integer >= 1"),
        "h2_reset_min_streams": (int, lambda v: v >= 1, "an integer >= 1"),
        "h2_reset_max_ratio": (float, lambda v: 0 < v <= 1, "a fraction in (0, 1]"),
    }
    values: dict[str, Any] = {}
    problems = []
    for name, (kind, ok, want) in checks.items():
        key = f"aiserve_{name}"
        if not hasattr(config, key):
            continue
        value = getattr(config, key)
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if kind is int and not isinstance(value, int):
            numeric = False
        if numeric and ok(value):
            values[name] = kind(value)
        else:
            problems.append(f"{key} = {value!r}: must be {want}; using the default")
    settings = EdgeSettings(**values)
    if settings.penalty_max_s < settings.penalty_first_s:
        problems.append(
            f"aiserve_penalty_max_s = {settings.penalty_max_s} is below aiserve_penalty_first_s"
            f" = {settings.penalty_first_s}; using {settings.penalty_first_s}"
        )
        settings = dataclasses.replace(settings, penalty_max_s=settings.penalty_first_s)
    return settings, problems


def control_frames(events: list[Any]) -> int:
    """How many of h2's ``events`` are control frames a flood is made of."""
    n = 0
    for e in events:
        if isinstance(e, ev.StreamReset):
            n += 1 if e.remote_reset else 0
        elif isinstance(e, (ev.PingReceived, ev.RemoteSettingsChanged, ev.PriorityUpdated)):
            n += 1
    return n


def idle_frames(events: list[Any], frames: int) -> int:
    """How many of the ``frames`` that made h2's ``events`` cost work without an answer.

    WINDOW_UPDATE, PING acks, SETTINGS acks, unknown frame types and empty DATA frames
    make an event and nothing else; a frame that made no event at all (a CONTINUATION,
    a frame for a stream already gone) is counted as the frames left over.
    """
    n = 0
    for e in events:
        if isinstance(
            e,
            ev.WindowUpdated
            | ev.UnknownFrameReceived
            | ev.PingAckReceived
            | ev.SettingsAcknowledged
            | ev.AlternativeServiceAvailable,
        ) or (isinstance(e, ev.DataReceived) and not e.flow_controlled_length):
            n += 1
    return n + max(0, frames - len(events))


class FrameCounter:
    """Counts the HTTP/2 frames in a client's bytes as they arrive (sans-IO).

    The bytes start with the client preface; each frame is a 9-byte header whose
    first three bytes are its payload's length. A frame is counted when its header
    is complete.
    """

    __slots__ = ("_header", "_skip")

    def __init__(self) -> None:
        self._skip = PREFACE_LENGTH
        self._header = b""

    def feed(self, data: bytes) -> int:
        """The frames whose headers end in ``data``."""
        frames = 0
        at, end = 0, len(data)
        while at < end:
            if self._skip:
                step = min(self._skip, end - at)
                self._skip -= step
                at += step
                continue
            need = 9 - len(self._header)
            self._header += data[at : at + need]
            at += need
            if len(self._header) == 9:
                frames += 1
                self._skip = int.from_bytes(self._header[:3], "big")
                self._header = b""
        return frames
