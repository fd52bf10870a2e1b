"""The processes a bench run starts: the simulator, the systems under test, Redis.

Every process runs on 127.0.0.1 on a free port, optionally pinned to one CPU with
``taskset``, logs to ``bench/work/logs/<name>.log``, and is stopped (SIGTERM,
then SIGKILL) when its context exits. Each command line is recorded so the
report can print exactly what ran.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / "work"
LOGS = WORK / "logs"
BIN = Path(sys.executable).parent
LITELLM_VENV = WORK / "litellm-venv"
LITELLM_KEY = "sk-bench-master-key"
#: CPU for the system under test; the load generator, the simulator and Redis get the other.
SYSTEM_CPU = "0"
LOAD_CPU = "1"


@dataclass(frozen=True)
class UpstreamPKI:
    """A private CA and a certificate it signed for 127.0.0.1 (the upstream's, over TLS)."""

    ca: Path
    cert: Path
    key: Path


def upstream_pki() -> UpstreamPKI:
    """A CA and a server certificate for 127.0.0.1 / localhost in ``bench/work/tls``
    (trustme, from the test extra), written once and kept. Each system is told of the
    CA (``ca_file``, ``NODE_EXTRA_CA_CERTS``, ``SSL_CERT_FILE``); for a gateway revision
    that has no ``ca_file``, add ``ca.pem`` to the system store (``--upstream-ca system``)."""
    import trustme

    d = WORK / "tls"
    files = UpstreamPKI(d / "ca.pem", d / "upstream.pem", d / "upstream.key")
    if all(p.exists() for p in (files.ca, files.cert, files.key)):
        return files  # the same CA every run: it may have been added to the system store
    d.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    leaf.private_key_and_cert_chain_pem.write_to_path(str(d / "upstream.pem"))
    key = d / "upstream.key"
    key.write_bytes(leaf.private_key_pem.bytes())
    key.chmod(0o600)
    return UpstreamPKI(d / "ca.pem", d / "upstream.pem", key)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pinned(cmd: list[str], cpu: str | None) -> list[str]:
    """``cmd`` under ``taskset -c cpu`` when pinning is asked for and possible."""
    if cpu is None or shutil.which("taskset") is None or (os.cpu_count() or 1) < 2:
        return cmd
    return ["taskset", "-c", cpu, *cmd]


@dataclass
class Running:
    """A started process and how to reach it."""

    name: str
    cmd: list[str]
    proc: subprocess.Popen[bytes]
    base: str
    env: dict[str, str] = field(default_factory=dict)

    def pids(self) -> list[int]:
        """The process and its descendants (hypercorn runs its worker as a child)."""
        out: list[int] = []
        todo = [self.proc.pid]
        while todo:
            pid = todo.pop(0)
            out.append(pid)
            try:
                kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                continue
            todo.extend(int(k) for k in kids)
        return out

    def rss_mb(self) -> float:
        """Resident memory of the process tree in MiB."""
        total = 0
        for pid in self.pids():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
            except OSError:
                continue
        return total / 1024.0

    def worker_rss_mb(self) -> float:
        """Resident memory of the serving process alone, in MiB."""
        try:
            for line in Path(f"/proc/{self.worker_pid()}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
        except OSError:
            pass
        return 0.0

    def worker_pid(self) -> int:
        """The pid that serves requests (the deepest child; the process itself if none)."""
        return self.pids()[-1]

    def cpu_seconds(self) -> float:
        """User + system CPU time used so far by the process tree (each process's own)."""
        return cpu_seconds(self.pids())


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of ``pids`` (each its own, not its children's)."""
    total = 0.0
    for pid in pids:
        try:
            total += stat_seconds(Path(f"/proc/{pid}/stat").read_text())
        except OSError:
            continue
    return total


def stat_seconds(stat: str) -> float:
    """User + system CPU seconds in a ``/proc/PID/stat`` (or ``task/TID/stat``) text."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or "" where there is none."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return ""


def host() -> str:
    """The CPU, the CPU count and the interpreter the workers run on: a run's figures are
    comparable with another's on the same host and interpreter only."""
    cpu = cpu_model() or platform.machine()
    return (f"{cpu}, {os.cpu_count()} CPUs; Python {platform.python_version()} "
            f"({os.path.realpath(sys.executable)})")


def cpu_ticks(proc_stat: str) -> tuple[int, int]:
    """(stolen, total) CPU ticks of all CPUs in a ``/proc/stat`` text: the hypervisor's
    share of the machine (``steal``, the 8th number of the ``cpu`` line)."""
    for line in proc_stat.splitlines():
        if line.startswith("cpu "):
            ticks = [int(v) for v in line.split()[1:]]
            # guest and guest_nice are already counted in user and nice.
            return (ticks[7] if len(ticks) > 7 else 0), sum(ticks[:8])
    return 0, 0


def read_cpu_ticks() -> tuple[int, int]:
    """:func:`cpu_ticks` of this machine now ((0, 0) without ``/proc/stat``)."""
    try:
        return cpu_ticks(Path("/proc/stat").read_text())
    except OSError:
        return 0, 0


def stolen_pct(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The percentage of the machine's CPU time the hypervisor took between two
    :func:`read_cpu_ticks` (a run with much stolen is noisier than its rounds show)."""
    total = after[1] - before[1]
    return 100.0 * (after[0] - before[0]) / total if total > 0 else 0.0


class Recorder:
    """Collects every command a run started, for the report."""

    def __init__(self) -> None:
        self.commands: list[str] = []

    def add(self, env: dict[str, str], cmd: list[str]) -> None:
        prefix = " ".join(f"{k}={v}" for k, v in env.items())
        self.commands.append((prefix + " " if prefix else "") + " ".join(cmd))


RECORDER = Recorder()

#: ``PYTHONPATH`` for every started process: a ``git archive`` snapshot of the
#: package (bench.run --snapshot REV), so a run measures one commit, not a work
#: tree that others are editing. None: the installed package.
SNAPSHOT: Path | None = None


def snapshot(rev: str) -> tuple[Path, str]:
    """Export ``rev``'s ``src/`` into bench/work/snapshot-<sha>; return its path and the sha."""
    sha = subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    dest = WORK / f"snapshot-{sha}"
    if not (dest / "src" / "aiserve_trio").exists():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "archive", sha, "src"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest / "src", sha


def wait_http(
    url: str, proc: subprocess.Popen[bytes], timeout: float, log: Path, ca_file: Path | None = None
) -> None:
    """Poll ``url`` until it answers (any status); raise if the process dies or time runs out.

    ``ca_file``: the CA an ``https://`` URL's certificate is checked against."""
    context = ssl.create_default_context(cafile=str(ca_file)) if ca_file is not None else None
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"{url}: process exited with {proc.returncode}:\n{tail}")
        try:
            urllib.request.urlopen(url, timeout=2, context=context).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


@contextlib.contextmanager
def start(
    name: str,
    cmd: list[str],
    *,
    port: int,
    health: str = "/healthz",
    cpu: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
    ours: bool = True,
    tls: UpstreamPKI | None = None,
) -> Iterator[Running]:
    """Start ``cmd`` (pinned to ``cpu``), wait for ``health`` to answer, stop it on exit.

    ``ours``: the process runs this project's code (it gets the snapshot's PYTHONPATH);
    ``tls``: it serves HTTPS with a certificate of this CA.
    """
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / f"{name}.log"
    full = pinned(cmd, cpu)
    extra = dict(env or {})
    if SNAPSHOT is not None and ours:
        extra["PYTHONPATH"] = f"{SNAPSHOT}:{ROOT}"
    RECORDER.add(extra, full)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            full, cwd=ROOT, env={**os.environ, **extra}, stdout=out, stderr=subprocess.STDOUT
        )
    base = f"{'https' if tls is not None else 'http'}://127.0.0.1:{port}"
    try:
        wait_http(base + health, proc, timeout, log, tls.ca if tls is not None else None)
        yield Running(name, full, proc, base, extra)
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def sim_cmd(port: int, args: list[str]) -> list[str]:
    """The ``aiserve-sim`` command line."""
    return [str(BIN / "aiserve-sim"), "--bind", f"127.0.0.1:{port}", "--seed", "1", *args]


@contextlib.contextmanager
def sim(args: list[str], name: str = "sim") -> Iterator[Running]:
    """The simulated upstream, on the load generator's CPU."""
    port = free_port()
    with start(name, sim_cmd(port, args), port=port, cpu=LOAD_CPU) as r:
        yield r


@contextlib.contextmanager
def redis() -> Iterator[Running]:
    """A throw-away redis-server (no persistence) on the load generator's CPU."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / "redis.log"
    full = pinned(cmd, LOAD_CPU)
    RECORDER.add({}, full)
    with log.open("wb") as out:
        proc = subprocess.Popen(full, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
                break
            if time.monotonic() > end or proc.poll() is not None:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
        yield Running("redis", full, proc, f"redis://127.0.0.1:{port}/0")
    finally:
        stop(proc)


def hypercorn_cmd(
    port: int, app: str, extra: list[str] | None = None, config: Path | None = None
) -> list[str]:
    """hypercorn with the bench's server settings (one Trio worker, no access log), or ``config``."""
    return [
        str(BIN / "hypercorn"),
        "--config",
        str(config or ROOT / "bench" / "configs" / "hypercorn-bench.toml"),
        "--bind",
        f"127.0.0.1:{port}",
        *(extra or []),
        app,
    ]


@contextlib.contextmanager
def ceiling(upstream: Running) -> Iterator[Running]:
    """bench/ceiling_relay.py: hypercorn-Trio relaying the sim with no stages."""
    port = free_port()
    env = {"BENCH_UPSTREAM": upstream.base}
    with start(
        "ceiling", hypercorn_cmd(port, "bench.ceiling_relay:app"), port=port, health="/",
        cpu=SYSTEM_CPU, env=env,
    ) as r:
        yield r


@dataclass(frozen=True)
class GatewayAuth:
    """The bench key the gateway accepts (auth on, as an operator would run it)."""

    plain: str
    toml: str


def _legacy_scrypt(plain: str, log_n: int = 14) -> str:
    """``plain`` hashed as revisions before SHA-256 keys stored it (scrypt, log2 N = 14)."""
    salt = secrets.token_bytes(16)
    n = 1 << log_n
    digest = hashlib.scrypt(
        plain.encode(), salt=salt, n=n, r=8, p=1, maxmem=256 * n * 8 + (1 << 20), dklen=32
    )
    return f"scrypt${log_n}$8$1${salt.hex()}${digest.hex()}"


def gateway_auth() -> GatewayAuth | None:
    """A fresh key and its ``[auth]`` TOML, or None when the measured build has no auth."""
    src = SNAPSHOT if SNAPSHOT is not None else ROOT / "src"
    settings = src / "aiserve_trio" / "security" / "settings.py"
    texts = [(src / "aiserve_trio" / "config.py").read_text()]
    texts += [settings.read_text()] if settings.exists() else []
    if not any("class AuthConfig" in t for t in texts):
        return None
    # The key and its hash as security/auth.py makes them (new_key, hash_key), without
    # importing the work tree's package: it may be in the middle of someone's edit.
    plain = f"aik_bench_{secrets.token_urlsafe(24)}"
    digest = "sha256$" + hashlib.sha256(plain.encode()).hexdigest()
    if "sha256$" not in (src / "aiserve_trio" / "security" / "auth.py").read_text():
        digest = _legacy_scrypt(plain)  # a revision from before SHA-256 keys
    toml = f"""
[auth]
enabled = true

[[auth.keys]]
id = "bench"
hash = "{digest}"
tenant = "default"
"""
    return GatewayAuth(plain, toml)


def gateway_toml(
    routes: dict[str, str], *, bus: str = "memory", redis_url: str | None = None,
    auth: GatewayAuth | None = None, extra: str = "", http2: bool = False,
    ca_file: Path | None = None,
) -> str:
    """Gateway config: one ``openai`` adapter + route per entry of ``routes`` (path -> sim URL).

    ``extra`` is more TOML (whole tables) appended as is; ``http2``: h2c to the sim (HTTP/2
    over ALPN to an ``https://`` one); ``ca_file``: the CA an ``https://`` upstream's
    certificate is checked against.
    """
    trust = f'ca_file = "{ca_file}"\n' if ca_file is not None else ""
    sessions = f'backend = "{bus}"' + (f'\nurl = "{redis_url}"' if redis_url else "")
    parts = [
        f"""[server]
name = "aiserve-trio-bench"

[sessions]
{sessions}
""",
        auth.toml if auth is not None else "",
        extra,
    ]
    for i, (path, upstream) in enumerate(routes.items()):
        parts.append(
            f"""
[adapters.sim{i}]
kind = "openai"
base_url = "{upstream}/v1"
models = ["sim-model"]
max_connections = 20000
max_retries = 2
http2 = {"true" if http2 else "false"}
{trust}
[[routes]]
path = "{path}"
name = "r{i}"
adapter = "sim{i}"
default_model = "sim-model"
"""
        )
    return "".join(parts)


#: Gateway TOML for held-stream runs: streams longer than the default 30 s
#: deadline, and no admission cap below the number of streams.
HELD_STREAMS_TOML = (
    "\n[deadline]\ndefault_ms = 900000\nmax_ms = 900000\n"
    "\n[limits]\nmax_inflight = 20000\nmax_streams = 20000\n"
)


def held_sim_args(itl_ms: int, tokens: int) -> list[str]:
    """Simulator flags for held streams: the first token at once, then one every ``itl_ms``."""
    return ["--prefill-overhead-ms", "0", "--prefill-per-token-ms", "0",
            "--itl-ms", str(itl_ms), "--output-tokens-mean", str(tokens)]


@contextlib.contextmanager
def gateway(
    name: str, routes: dict[str, str], *, bus: str = "memory", redis_url: str | None = None,
    auth: GatewayAuth | None = None, extra: str = "", http2: bool = False,
    hypercorn_args: list[str] | None = None, hypercorn_config: Path | None = None,
) -> Iterator[Running]:
    """aiserve-trio under hypercorn (one Trio worker) with a generated config."""
    port = free_port()
    WORK.mkdir(parents=True, exist_ok=True)
    cfg = WORK / f"{name}.toml"
    cfg.write_text(gateway_toml(routes, bus=bus, redis_url=redis_url, auth=auth, extra=extra, http2=http2))
    env = {"AISERVE_CONFIG": str(cfg.relative_to(ROOT))}
    cmd = hypercorn_cmd(port, "aiserve_trio:app", hypercorn_args, hypercorn_config)
    with start(name, cmd, port=port, cpu=SYSTEM_CPU, env=env) as r:
        yield r


def litellm_available() -> str | None:
    """The litellm proxy executable in its own venv, or None when it is not installed."""
    exe = LITELLM_VENV / "bin" / "litellm"
    return str(exe) if exe.exists() else None


def litellm_version() -> str | None:
    """The installed LiteLLM version, read from its venv's metadata."""
    py = LITELLM_VENV / "bin" / "python"
    if not py.exists():
        return None
    out = subprocess.run(
        [str(py), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
        capture_output=True, text=True, check=False,
    )
    return out.stdout.strip() or None


@contextlib.contextmanager
def litellm(upstream: Running, ca_file: Path | None = None) -> Iterator[Running]:
    """LiteLLM proxy, one worker, with the sim as an OpenAI-compatible backend.

    ``ca_file``: the CA of an ``https://`` upstream (``SSL_CERT_FILE``, which LiteLLM's
    HTTP clients read)."""
    exe = litellm_available()
    if exe is None:
        raise RuntimeError(f"LiteLLM is not installed in {LITELLM_VENV} (see bench/README.md)")
    port = free_port()
    cfg = WORK / "litellm.yaml"
    cfg.write_text(
        f"""model_list:
  - model_name: sim-model
    litellm_params:
      model: openai/sim-model
      api_base: {upstream.base}/v1
      api_key: sk-sim
general_settings:
  master_key: {LITELLM_KEY}
litellm_settings:
  telemetry: false
  drop_params: true
"""
    )
    env = {
        # Offline machine: use the bundled model-cost map instead of fetching it.
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_LOG": "ERROR",
        "NO_DOCS": "True",
    }
    if ca_file is not None:
        env["SSL_CERT_FILE"] = str(ca_file)
    cmd = [exe, "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    with start(
        "litellm", cmd, port=port, health="/health/liveliness", cpu=SYSTEM_CPU, env=env, timeout=180,
        ours=False,
    ) as r:
        yield r
