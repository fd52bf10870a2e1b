"""A real ``aiserve-sim`` process on a free loopback port, for adapter tests."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
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


def wait_tcp(port: int, proc: subprocess.Popen[bytes], within: float = 15.0) -> None:
    """Wait until something listens on ``127.0.0.1:port`` (a TLS server, whose health URL
    needs a certificate to be trusted first)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        if proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise RuntimeError(f"server exited with {proc.returncode}:\n{out[-4000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listened on {port} within {within} s")


@contextlib.contextmanager
def run_sim(args: list[str] | None = None) -> Iterator[str]:
    """Run ``aiserve-sim`` with ``args`` (default :data:`FAST_ARGS`); yield ``host:port``."""
    port = free_port()
    bind = f"127.0.0.1:{port}"
    args = FAST_ARGS if args is None else args
    cmd = [str(BIN / "aiserve-sim"), "--bind", bind, *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        if "--certfile" in args:
            wait_tcp(port, proc)
        else:
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
