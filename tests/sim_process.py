"""A real ``aiserve-sim`` process on a free loopback port, for adapter tests."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator

from .servers import BIN, ROOT, free_port, wait_http

#: Fast, deterministic timing so that real-network tests stay short.
FAST_ARGS = [
    "--prefill-overhead-ms",
    "2",
    "--prefill-per-token-ms",
    "0",
    "--itl-ms",
    "2",
    "--output-tokens-mean",
    "8",
    "--seed",
    "7",
]


@contextlib.contextmanager
def run_sim(args: list[str] | None = None) -> Iterator[str]:
    """Run ``aiserve-sim`` with ``args`` (default :data:`FAST_ARGS`); yield ``host:port``."""
    port = free_port()
    bind = f"127.0.0.1:{port}"
    cmd = [str(BIN / "aiserve-sim"), "--bind", bind, *(FAST_ARGS if args is None else args)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://{bind}/healthz", proc=proc)
        yield bind
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
