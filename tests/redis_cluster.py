"""Real Redis Cluster and Sentinel set-ups for tests, from ``redis-server`` processes on loopback.

- :class:`Cluster`: three masters and a replica each (six processes), made a
  cluster with ``redis-cli --cluster create``; :meth:`Cluster.failover` runs
  ``CLUSTER FAILOVER`` on a replica (the coordinated switch an operator makes);
  its URL is ``redis+cluster://h:p,h:p,h:p``.
- :class:`Sentinels`: one primary, one replica and three sentinels;
  :meth:`Sentinels.kill_primary` SIGKILLs the primary and waits until the
  sentinels have promoted the replica; its URL is ``redis+sentinel://.../service``.

Both are session-scoped fixtures (``redis_cluster``, ``redis_sentinel``) registered
in ``conftest.py``: anything that keeps state in Redis -- sessions, the rate
limiter, and the response cache when it lands -- can take one and run its
scenario on a cluster and through a failover. Use a fresh key prefix per test:
the set-ups are shared, and a failover test leaves them with new primaries,
which is fine (the URLs name every node, not a primary).

Ports: the cluster bus is the client port + 10000, so every port here is below
55536 and is checked free together with its bus port.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

#: Where the ports are drawn from: clear of the usual ephemeral range's top, and
#: with room for the +10000 cluster bus.
_PORTS = (20000, 45000)


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_ports(n: int, rng: random.Random | None = None) -> list[int]:
    """``n`` free loopback ports below 55536 whose cluster bus port (+10000) is free too."""
    rng = rng or random.Random()
    ports: list[int] = []
    while len(ports) < n:
        p = rng.randrange(*_PORTS)
        if p not in ports and p + 10000 not in ports and _free(p) and _free(p + 10000):
            ports.append(p)
    return ports


def cli(port: int, *args: str, timeout: float = 10.0) -> str:
    """``redis-cli -p port args...``: its output ("" when it fails)."""
    out = subprocess.run(
        ["redis-cli", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return out.stdout.strip()


def _wait(check: object, what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise TimeoutError(f"{what} within {timeout} s")


class _Processes:
    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None or shutil.which("redis-cli") is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
        self.exe = exe
        self.dir = Path(tempfile.mkdtemp(prefix="aiserve-redis-ha-"))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def spawn(self, port: int, *args: str, conf: str | None = None) -> None:
        work = self.dir / str(port)
        work.mkdir(exist_ok=True)
        cmd = [self.exe]
        if conf is not None:
            path = work / "node.conf"
            path.write_text(conf)
            cmd.append(str(path))
        cmd += ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(work),
                "--save", "", "--appendonly", "no", "--protected-mode", "no", *args]  # fmt: skip
        self.procs[port] = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        _wait(lambda: cli(port, "PING") == "PONG", f"redis on {port} did not answer PING")

    def kill(self, port: int) -> None:
        proc = self.procs.pop(port, None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def stop_all(self) -> None:
        for port in list(self.procs):
            self.kill(port)
        shutil.rmtree(self.dir, ignore_errors=True)


class Cluster(_Processes):
    """Three masters with a replica each, on loopback."""

    def __init__(self) -> None:
        super().__init__()
        self.ports = cluster_ports(6)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports[:3])

    def start(self) -> None:
        for p in self.ports:
            self.spawn(p, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                       "--cluster-node-timeout", "2000")  # fmt: skip
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        out = subprocess.run(
            ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "1",
             "--cluster-yes"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{out.stdout}{out.stderr}")
        self.wait_ok()

    def wait_ok(self) -> None:
        """Until every node reports ``cluster_state:ok`` and three masters cover every slot."""

        def ok() -> bool:
            return all("cluster_state:ok" in cli(p, "CLUSTER", "INFO") for p in self.ports) and (
                len(self.masters()) == 3
            )

        _wait(ok, "the cluster was not ok")

    def masters(self) -> list[int]:
        """Ports of the current masters (from the first node that answers)."""
        for p in self.ports:
            nodes = cli(p, "CLUSTER", "NODES")
            if nodes:
                return [
                    int(line.split()[1].split("@")[0].rsplit(":", 1)[1])
                    for line in nodes.splitlines()
                    if "master" in line.split()[2] and "fail" not in line.split()[2]
                ]
        return []

    def master_of(self, key: str) -> int:
        """The port of the master serving ``key``'s slot."""
        slot = int(cli(self.ports[0], "CLUSTER", "KEYSLOT", key))
        for line in cli(self.masters()[0], "CLUSTER", "NODES").splitlines():
            cols = line.split()
            if "master" not in cols[2] or "fail" in cols[2]:
                continue
            for ranged in cols[8:]:
                lo, _, hi = ranged.partition("-")
                if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                    return int(cols[1].split("@")[0].rsplit(":", 1)[1])
        raise LookupError(f"no master serves slot {slot}")

    def replica_of(self, master: int) -> int:
        """The port of ``master``'s replica."""
        nodes = cli(master, "CLUSTER", "NODES")
        my_id = next(ln.split()[0] for ln in nodes.splitlines() if "myself" in ln.split()[2])
        for line in nodes.splitlines():
            cols = line.split()
            if "slave" in cols[2] and cols[3] == my_id:
                return int(cols[1].split("@")[0].rsplit(":", 1)[1])
        raise LookupError(f"{master} has no replica")

    def failover(self, key: str) -> tuple[int, int]:
        """``CLUSTER FAILOVER`` on the replica of ``key``'s master; (old, new) master ports."""
        old = self.master_of(key)
        new = self.replica_of(old)
        assert cli(new, "CLUSTER", "FAILOVER") == "OK"
        _wait(lambda: "role:master" in cli(new, "INFO", "replication"), "the failover did not end")
        self.wait_ok()
        return old, new


class Sentinels(_Processes):
    """One primary, one replica, three sentinels (quorum 2), on loopback."""

    SERVICE = "aiserve"

    def __init__(self) -> None:
        super().__init__()
        self.primary, self.replica, *self.sentinels = cluster_ports(5)

    @property
    def url(self) -> str:
        nodes = ",".join(f"127.0.0.1:{p}" for p in self.sentinels)
        return f"redis+sentinel://{nodes}/{self.SERVICE}"

    def start(self) -> None:
        self.spawn(self.primary)
        self.spawn(self.replica, "--replicaof", "127.0.0.1", str(self.primary))
        _wait(
            lambda: "master_link_status:up" in cli(self.replica, "INFO", "replication"),
            "the replica did not sync",
        )
        conf = (
            f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.primary} 2\n"
            f"sentinel down-after-milliseconds {self.SERVICE} 1000\n"
            f"sentinel failover-timeout {self.SERVICE} 5000\n"
            f"sentinel parallel-syncs {self.SERVICE} 1\n"
        )
        for p in self.sentinels:
            self.spawn(p, "--sentinel", conf=conf)

        def known() -> bool:
            return all(
                "num-other-sentinels" in cli(p, "SENTINEL", "MASTER", self.SERVICE)
                and self._others(p) == 2
                for p in self.sentinels
            )

        _wait(known, "the sentinels did not find each other")

    def _others(self, port: int) -> int:
        lines = cli(port, "SENTINEL", "MASTER", self.SERVICE).splitlines()
        with contextlib.suppress(ValueError, IndexError):
            return int(lines[lines.index("num-other-sentinels") + 1])
        return 0

    def current_primary(self) -> int | None:
        out = cli(self.sentinels[0], "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.SERVICE)
        lines = out.splitlines()
        return int(lines[1]) if len(lines) == 2 else None

    def kill_primary(self) -> tuple[int, int]:
        """SIGKILL the primary; wait until the replica is promoted. (old, new) ports."""
        old = self.current_primary()
        assert old is not None
        new = self.replica if old == self.primary else self.primary
        self.kill(old)
        _wait(lambda: self.current_primary() == new, "the sentinels did not fail over", 30.0)
        _wait(lambda: "role:master" in cli(new, "INFO", "replication"), "no new primary")
        return old, new


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[Cluster]:
    """A three-master Redis Cluster with a replica per master (shared by the session)."""
    cluster = Cluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop_all()


@pytest.fixture(scope="session")
def redis_sentinel() -> Iterator[Sentinels]:
    """A Sentinel-managed primary and replica, three sentinels (shared by the session)."""
    sentinels = Sentinels()
    try:
        sentinels.start()
        yield sentinels
    finally:
        sentinels.stop_all()
