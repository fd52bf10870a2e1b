"""Real processes for tests: the gateway under the hypercorn binary, on a free loopback port."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float = 15.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll ``url`` until it answers (any status), or fail after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise RuntimeError(f"server exited with {proc.returncode}:\n{out[-4000:]}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


@contextlib.contextmanager
def hypercorn_gateway(
    config_path: str | Path | None = None,
    *,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    scheme: str = "http",
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Run ``hypercorn --config configs/hypercorn.toml aiserve_trio:app`` on a free port.

    Yields the base URL and the process; stops it (SIGTERM, then kill) afterwards.
    """
    port = free_port()
    penv = {**os.environ, **(env or {})}
    if config_path is not None:
        penv["AISERVE_CONFIG"] = str(config_path)
    else:
        penv.pop("AISERVE_CONFIG", None)
    args = [
        str(BIN / "hypercorn"),
        "--config",
        str(ROOT / "configs" / "hypercorn.toml"),
        "--bind",
        f"127.0.0.1:{port}",
        *(extra_args or []),
        "aiserve_trio:app",
    ]
    proc = subprocess.Popen(
        args, cwd=ROOT, env=penv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    base = f"{scheme}://127.0.0.1:{port}"
    try:
        if scheme == "http":
            wait_http(base + "/healthz", proc=proc)
        else:
            _wait_port(port, proc)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} did not open")
