"""A real ``redis-server`` for tests, on a free loopback port; it can be stopped,
frozen and restarted for fault tests. No fakes: the Redis backend's tests talk
to the Debian ``redis-server`` binary (``.ci/run`` installs it)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

from .servers import free_port


class RedisServer:
    """One ``redis-server`` process (no persistence) on 127.0.0.1."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
        self.exe = exe
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="aiserve-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self.dir, "--protected-mode", "no"]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 10
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            if self.command("PING") == b"+PONG":
                return
            time.sleep(0.02)
        raise TimeoutError("redis-server did not answer PING")

    def stop(self) -> None:
        """Kill it (SIGKILL: like a crash, no goodbye to clients)."""
        if self.proc is not None:
            self.resume()
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def freeze(self) -> None:
        """SIGSTOP: connections stay open but nothing answers (a slow Redis)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def command(self, *args: str) -> bytes | None:
        """Send one inline command; the first reply line, or None if unreachable."""
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", self.port), timeout=1) as s,
        ):
            s.sendall(" ".join(args).encode() + b"\r\n")
            return s.recv(65536).split(b"\r\n")[0]
        return None


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A redis-server for the whole test session (restarted by fault tests if they stop it)."""
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.dir, ignore_errors=True)


@pytest.fixture
def redis_up(redis_server: RedisServer) -> RedisServer:
    """The session's redis-server, started again if an earlier test left it down."""
    if redis_server.proc is None or redis_server.command("PING") != b"+PONG":
        redis_server.restart()
    return redis_server
