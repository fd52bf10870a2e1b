"""Hostile clients against the real server (hypercorn binary + the gateway), loopback only.

Every attack is bounded in frames and seconds (bench/hostile.py); during each, a polite
HTTP/1.1 client keeps being served; afterwards the worker is alive and its RSS bounded.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from bench import hostile

from aiserve_trio.security.edge import FloodMeter, control_frames

pytestmark = pytest.mark.slow


def test_flood_meter_allows_bursts_then_refuses_floods() -> None:
    m = FloodMeter(now=0.0, burst=100, rate=10.0)
    assert m.spend(0.0, 100)
    assert not m.spend(0.0, 1)
    assert m.spend(1.0, 5)  # refilled 10, was at -1


def test_control_frames_counts_only_remote_control_frames() -> None:
    import h2.events as ev

    reset = ev.StreamReset(stream_id=1, error_code=0, remote_reset=True)
    local = ev.StreamReset(stream_id=3, error_code=0, remote_reset=False)
    ping = ev.PingReceived(ping_data=b"12345678")
    data = ev.DataReceived(stream_id=1, data=b"x", flow_controlled_length=1)
    assert control_frames([reset, local, ping, data]) == 2


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[int, int, Path]]:
    with hostile.gateway() as g:
        yield g


CLOSES = ("connection closed", "GOAWAY", "connection reset")


@pytest.mark.parametrize(
    ("attack", "expect"),
    [
        ("h2 rapid reset (HEADERS + RST_STREAM)", CLOSES),
        ("h2 SETTINGS flood", CLOSES),
        ("h2 PING flood", CLOSES),
        ("h2 PRIORITY flood, 1,500 idle streams", ("GOAWAY ENHANCE_YOUR_CALM",)),
        ("h2 CONTINUATION flood", CLOSES),
        ("h2 oversized header block", ("GOAWAY", "status 431", "RST_STREAM", "connection closed")),
        ("h2 1-byte flow-control window reader", ("bytes taken",)),
        ("h1 slowloris headers", ("closed after",)),
        ("h1 slowloris body", ("answers ['408']",)),
        ("h1 pipelined garbage", ("answers ['200']",)),
        ("h1 smuggling CL + TE", ("answers ['400']",)),
        ("h1 smuggling TE + TE", ("answers ['501']", "answers ['400']")),
    ],
)
def test_attack_is_contained(
    gateway: tuple[int, int, Path], attack: str, expect: tuple[str, ...]
) -> None:
    port, pid, _ = gateway
    row, polite = hostile.run_attack(attack, port, pid)
    print(row)
    assert row.up, f"the worker died during {attack}"
    assert any(e in row.outcome for e in expect), row.outcome
    # The polite client kept being served during the attack.
    assert polite.failures == 0, row.polite
    assert len(polite.latencies) >= 5, row.polite
    assert max(polite.latencies) < 2.0, row.polite
    assert row.rss_after - row.rss_before < 50, row
    # A smuggled second request was never answered.
    if "smuggling" in attack:
        assert row.outcome.count("'") <= 2, row.outcome
