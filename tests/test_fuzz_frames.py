"""A frame-level fuzzer against the real server (hypercorn binary + the gateway): random
sequences of valid and invalid HTTP/2 frames of every type, sent over and over for half a
second from their own loopback address, while a polite HTTP/1.1 client on 127.0.0.1 asks
for chat completions. The worker must stay up, keep the polite client answered, and keep
its scheduler lag (``trio_scheduler_lag_seconds``, sampled every 50 ms) bounded.

The server always runs with the seam: hypercorn as shipped (``AISERVE_HYPERCORN_PATCHES=off``)
has no edge guard, and random frames end its worker (``docs/hypercorn.md``)."""

from __future__ import annotations

import collections
import itertools
import socket
import struct
import time
from collections.abc import Iterator

import hpack
import pytest
from bench import hostile
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEAD = [(":method", "GET"), (":path", "/healthz"), (":scheme", "http"), (":authority", "x")]
#: RFC 9113 frame types, and a stand-in for every type it does not define.
TYPES = {
    "DATA": 0, "HEADERS": 1, "PRIORITY": 2, "RST_STREAM": 3, "SETTINGS": 4,
    "PUSH_PROMISE": 5, "PING": 6, "GOAWAY": 7, "WINDOW_UPDATE": 8, "CONTINUATION": 9,
    "unknown": -1,
}  # fmt: skip
#: Frame types sent over the whole run (the note's coverage figure).
SENT: collections.Counter[str] = collections.Counter()
#: How long each example's sequence is sent, over and over.
FLOOD_S = 0.5
#: The worst scheduler lag accepted during an example. The invariant is 20 ms of work
#: between checkpoints (held exactly by test_hostile's in-process tests); on a machine
#: shared with other test runs (load average 8 on 2 CPUs) the kernel preempting a busy
#: worker added up to ~300 ms; before the seam, a flood held the loop for seconds.
LAG_BOUND_S = 0.328


@st.composite
def frame(draw: st.DrawFn) -> tuple[str, int, int, int, bytes | None]:
    """(type name, type, flags, stream id, payload or None: a valid one made at send time)."""
    name = draw(st.sampled_from(sorted(TYPES)))
    kind = TYPES[name] if name != "unknown" else draw(st.integers(10, 255))
    flags = draw(st.sampled_from([0, 0, 1, 4, 5, 8, 0x20, 0xFF]))
    stream = draw(st.sampled_from([0, 1, 1, 3, 5, 7, 2, 2**31 - 1]))
    valid = draw(st.booleans())
    payload = None if valid else draw(st.binary(max_size=48))
    return name, kind, flags, stream, payload


def valid_payload(name: str, encoder: hpack.Encoder, i: int) -> tuple[int, bytes]:
    """(flags, payload) of a well-formed frame of ``name``."""
    if name in ("HEADERS", "CONTINUATION", "PUSH_PROMISE"):
        block = encoder.encode(HEAD)
        return 0x4 | 0x1, (struct.pack(">I", 2) + block if name == "PUSH_PROMISE" else block)
    if name == "DATA":
        return 0, b"x" * (i % 32)
    if name == "PRIORITY":
        return 0, struct.pack(">IB", i % 9, i % 256)
    if name in ("RST_STREAM", "WINDOW_UPDATE"):
        return 0, struct.pack(">I", 1 + i % 1000 if name == "WINDOW_UPDATE" else 8)
    if name == "SETTINGS":
        return 0, struct.pack(">HI", 3, 100 + i % 7)
    if name == "PING":
        return 0, i.to_bytes(8, "big")
    if name == "GOAWAY":
        return 0, struct.pack(">II", 0, 0)
    return 0, b"?" * (i % 16)


def encode(frames: list[tuple[str, int, int, int, bytes | None]]) -> bytes:
    """The client preface, and the frames in order (valid ones made with one HPACK encoder)."""
    encoder = hpack.Encoder()
    out = bytearray(PREFACE)
    out += b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # the client's own SETTINGS
    for i, (name, kind, flags, stream, payload) in enumerate(frames):
        if payload is None:
            valid_flags, payload = valid_payload(name, encoder, i)
            flags = (
                valid_flags if name in ("HEADERS", "CONTINUATION", "PUSH_PROMISE") else flags & 1
            )
            if name in ("SETTINGS", "PING", "GOAWAY", "WINDOW_UPDATE") and stream % 2 == 1:
                stream = 0 if name != "WINDOW_UPDATE" else stream
        out += len(payload).to_bytes(3, "big") + bytes([kind, flags]) + struct.pack(">I", stream)
        out += payload
        SENT[name] += 1
    return bytes(out)


_sources = itertools.cycle(f"127.0.0.{n}" for n in range(20, 250))


def flood(port: int, data: bytes, seconds: float) -> int:
    """Send ``data`` on fresh connections, over and over, for ``seconds``: connections made."""
    end = time.monotonic() + seconds
    connections = 0
    source = next(_sources)
    while time.monotonic() < end:
        try:
            sock = socket.create_connection(("127.0.0.1", port), 2, source_address=(source, 0))
        except OSError:
            time.sleep(0.01)
            continue
        connections += 1
        sock.settimeout(0.2)
        try:
            sock.sendall(data)
            again = data[len(PREFACE) + 9 :]  # the frames, without preface and SETTINGS
            while time.monotonic() < end:
                sock.sendall(again)
        except OSError:  # closed by the server (or its buffer full for 0.2 s): reconnect
            pass
        finally:
            sock.close()
    return connections


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[int, int]]:
    # The seam's fairness is what is fuzzed: on, whatever this run's switch says.
    with hostile.gateway(env={"AISERVE_HYPERCORN_PATCHES": "on"}) as (port, pid, _):
        yield port, pid


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(frames=st.lists(frame(), min_size=1, max_size=24))
# Every type at least once, valid and not, whatever the random draws are.
@example(frames=[(n, TYPES[n] if TYPES[n] >= 0 else 77, 0, 1, None) for n in sorted(TYPES)])
@example(frames=[(n, TYPES[n] if TYPES[n] >= 0 else 200, 0xFF, 3, b"\x00" * 5) for n in sorted(TYPES)])
def test_random_frames_leave_the_worker_up_fair_and_serving(
    gateway: tuple[int, int], frames: list[tuple[str, int, int, int, bytes | None]]
) -> None:
    port, pid = gateway
    data = encode(frames)
    before = hostile.lag_counts(port)
    polite = hostile.Polite(port)
    with polite.during():
        flood(port, data, FLOOD_S)
    after = hostile.lag_counts(port)
    assert hostile.alive(pid), "the worker died"
    assert polite.failures == 0, polite.summary()
    assert polite.latencies, polite.summary()
    assert polite.p99 < 0.5, polite.summary()
    assert before is not None
    assert after is not None
    worst = hostile.lag_summary(before, after)
    delta = {le: after[le] - before.get(le, 0.0) for le in after}
    total = delta[float("inf")]
    within = max(n for le, n in delta.items() if le <= LAG_BOUND_S + 1e-9)
    assert within == total, worst


def test_the_fuzzer_sent_every_frame_type() -> None:
    # Runs after the fuzzer (file order): every type of RFC 9113 and unknown ones.
    assert set(SENT) == set(TYPES), SENT
