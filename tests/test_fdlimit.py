"""A worker holds what its memory allows: 1,000 streams on the default limits, open files raised."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest
import trio

from aiserve_trio.util import fdlimit

from .servers import ROOT, hypercorn_gateway


def test_two_descriptors_a_request_and_a_margin() -> None:
    assert fdlimit.needed(4096) == 2 * 4096 + fdlimit.MARGIN


@pytest.mark.parametrize(
    ("soft", "hard", "want", "new"),
    [
        (1024, 1_048_576, 8448, 8448),  # Debian's default soft limit, raised
        (1024, 4096, 8448, 4096),  # as far as the hard limit allows
        (65536, 1_048_576, 8448, 65536),  # never lowered
        (1024, resource.RLIM_INFINITY, 8448, 8448),
    ],
)
def test_the_soft_limit_goes_up_to_what_is_needed_within_the_hard_limit(soft, hard, want, new) -> None:
    assert fdlimit.plan(soft, hard, want) == new


STREAMS = 1000


async def _stream(port: int, results: list[tuple[int, bool]]) -> None:
    body = json.dumps({"model": "aiserve-mock", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n{body}"
    )
    async with await trio.open_tcp_stream("127.0.0.1", port) as s:
        await s.send_all(head.encode())
        got = b""
        while chunk := await s.receive_some(65536):
            got += chunk
    status = int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.1 ") else 0
    results.append((status, b"data: [DONE]" in got))


@pytest.mark.slow
def test_a_thousand_streams_at_once_are_all_served_on_the_default_limits(tmp_path: Path) -> None:
    # The embedded default, with the mock's first token 3 s away so that every stream is
    # held at once; the worker starts with Debian's default soft open-file limit.
    text = (ROOT / "configs" / "aiserve.toml").read_text().replace("ttft_ms = 60", "ttft_ms = 3000")
    config = tmp_path / "aiserve.toml"
    config.write_text(text)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, soft), hard))
    try:
        gateway = hypercorn_gateway(config)
        base, proc = gateway.__enter__()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * STREAMS)), hard))
    try:
        port = int(base.rsplit(":", 1)[1])
        results: list[tuple[int, bool]] = []

        async def main() -> None:
            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    for _ in range(STREAMS):
                        nursery.start_soon(_stream, port, results)

        trio.run(main)
        proc.terminate()
        log = proc.stdout.read().decode() if proc.stdout else ""
    finally:
        gateway.__exit__(None, None, None)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(results) == STREAMS
    assert sorted({status for status, _ in results}) == [200]
    assert all(done for _, done in results)
    assert "open files: soft limit 1024 -> 8448" in log
