"""A real PostgreSQL for tests: ``initdb`` and ``pg_ctl`` in a temporary directory, on a
free loopback port, run as a non-root user (PostgreSQL refuses to run as root).

Debian's ``postgresql`` package (``scripts/test`` installs it) puts the programs in
``/usr/lib/postgresql/<version>/bin`` and creates the ``postgres`` system user, which
the server runs as when the tests run as root.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .servers import free_port

#: The system user the server runs as when the tests run as root.
PG_USER = "postgres"


def _bin(name: str) -> str:
    found = shutil.which(name)
    if found is not None:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not candidates:
        raise RuntimeError(f"{name} is not installed (apt-get install -y postgresql)")
    return candidates[-1]


class PostgresServer:
    """One PostgreSQL cluster (trust auth, loopback only) that can be killed and restarted."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="aiserve-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self._as: list[str] = []
        if os.geteuid() == 0:
            pw = pwd.getpwnam(PG_USER)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            self._as = ["runuser", "-u", PG_USER, "--"]

    @property
    def dsn(self) -> str:
        return f"postgresql://aiserve@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        out = subprocess.run(
            [*self._as, *args], capture_output=True, text=True, timeout=120, check=False
        )
        if out.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(f"{args[0]} failed: {out.stdout}{out.stderr}{log}")

    def init(self) -> None:
        self._run(_bin("initdb"), "-D", str(self.data), "-U", "aiserve", "--auth=trust",
                  "--no-sync", "-E", "UTF8")  # fmt: skip

    def start(self) -> None:
        opts = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.dir} "
            "-c fsync=off -c full_page_writes=off"
        )
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", opts,
                  "-w", "-t", "60", "start")  # fmt: skip

    def kill(self) -> None:
        """Stop at once, like a crash: no goodbye to clients."""
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run(_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    server = PostgresServer()
    server.init()
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.dir, ignore_errors=True)


@pytest.fixture
def postgres_up(postgres_server: PostgresServer) -> PostgresServer:
    """The session's PostgreSQL, started again if an earlier test killed it."""
    if not (postgres_server.data / "postmaster.pid").exists():
        postgres_server.start()
    return postgres_server
