"""A config the app cannot start with, under the hypercorn binary: one line, non-zero exit.

``aiserve_trio:app`` builds the app from the config on the first ASGI call, the
lifespan start-up, in each hypercorn worker (``_DeferredApp``). Reported the
ASGI way (``lifespan.startup.failed``), a bad config goes wrong twice in
hypercorn 0.18:

- the Trio worker turns the message into ``LifespanFailureError``, raised out of
  its lifespan nursery after it has logged "Running on ..." (its start-up event
  is set in a ``finally``), and multiprocessing prints that ~50-line
  ExceptionGroup as the worker dies with status 1;
- the parent loses the status. ``hypercorn.run.run()`` waits for a worker to
  exit, records its exit code and drops it from its list, terminates the other
  workers, then *overwrites* the code with ``_join_exited()`` of the list that
  is left: empty with one worker, so 0; with more, 0 unless another worker
  happened to be reaped in the microseconds between ``terminate()`` and that
  call. (Upstream: pgjones/hypercorn#269; the fix, PR #372, is not released.)

No code of ours runs in that parent -- with ``workers >= 1`` it never imports
the app -- and its ``run()`` returns 0 whatever a worker does, so the worker
ends it (:func:`refuse_to_start`):

1. it writes the one line on stderr;
2. it sends the parent ``SIGUSR1``. hypercorn handles SIGINT, SIGTERM and SIGHUP
   (each ends in status 0) but not this one, so the default action ends the
   process at once: "killed by signal 10", 138 in a shell, a failure to
   systemd's ``Restart=on-failure`` and to any supervisor;
3. it leaves with ``os._exit(EX_CONFIG)``: nothing unwinds, so neither Trio,
   hypercorn nor multiprocessing print anything more, and "Running on" is
   never logged.

With several workers, every one of them reads the same bad file: the first
to claim the report (an exclusive lock file named after the parent) ends its
sibling workers at once (SIGKILL: one still starting up would otherwise die
printing a traceback), and the others stay quiet. A parent ended by a signal
runs no clean-up, and the one it would have run is unlinking the named
semaphores of its ``shutdown_event`` (which its workers receive, pickled, in
their Process's kwargs); its resource tracker would do it instead, with a
warning on stderr. So the reporting worker unlinks them first -- after its
siblings are gone, since one still unpickling them would fail. The operator
reads the line once.

A signal to PID 1 of a container is dropped by the kernel unless PID 1 handles
it: run hypercorn under an init (``docker run --init``) for the status to reach
the runtime. With ``workers = 0`` hypercorn runs the worker in its own process,
which then simply exits with ``EX_CONFIG``. Anywhere else (tests, another
server) nothing here runs: the app answers ``lifespan.startup.failed``.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import ssl
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from multiprocessing import resource_tracker, synchronize
from pathlib import Path, PurePath
from typing import Any, Literal, NoReturn

#: sysexits.h: configuration error.
EX_CONFIG = 78
#: What ends hypercorn's parent: a signal it has no handler for, ended by default (no core).
PARENT_SIGNAL = signal.SIGUSR1
#: hypercorn versions (major, minor) whose parent loses a failed worker's exit status.
LOSES_WORKER_STATUS = ((0, 18),)
#: How long a worker that did not report waits for the parent to be ended.
QUIET_WAIT_S = 5.0


def hypercorn_process() -> Literal["worker", "server"] | None:
    """Which part of the hypercorn binary this process is, if any.

    ``worker``: a worker process its parent spawned (``workers >= 1``);
    ``server``: the hypercorn process itself (``workers = 0``); None: not hypercorn.
    """
    target = getattr(multiprocessing.current_process(), "_target", None)
    if target is not None:
        module: str = getattr(target, "__module__", "")
        return "worker" if module.startswith("hypercorn.") else None
    argv0 = PurePath(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if argv0 is not None and (
        argv0.name == "hypercorn" or argv0.parts[-2:] == ("hypercorn", "__main__.py")
    ):
        return "server"
    return None


def unusable_tls_files(server_config: object) -> str | None:
    """Why hypercorn's TLS files (``certfile``, ``keyfile``, ``ca_certs``) cannot be used, or
    None. hypercorn loads them only after the app's start-up, where a missing file is a
    ~35-line traceback and the binary still exits 0: the app checks them first, so a bad
    path is refused like a bad config (:func:`refuse_to_start`)."""
    files = {k: getattr(server_config, k, None) for k in ("certfile", "keyfile", "ca_certs")}
    for key, path in files.items():
        if not path:
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            return f"hypercorn's {key} {str(path)!r} cannot be read: {exc.strerror}"
    if files["certfile"]:
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                files["certfile"], files["keyfile"] or None
            )
        except (ssl.SSLError, ValueError) as exc:
            return f"hypercorn's certfile {files['certfile']!r} is not usable: {exc}"
    return None


def refuse_to_start(message: str, role: Literal["worker", "server"]) -> NoReturn:
    """Say ``message`` in one line on stderr and end the hypercorn process non-zero.

    Args:
        message: the ConfigError's text (it names the file and the TOML key).
        role: from :func:`hypercorn_process`.
    """
    line = "aiserve-trio: not started: " + " ".join(message.split()) + "\n"
    parent = multiprocessing.parent_process() if role == "worker" else None
    if parent is None or parent.pid is None or not _parent_loses_status():
        _say(line)
        os._exit(EX_CONFIG)
    if os.getppid() != parent.pid:
        os._exit(EX_CONFIG)  # re-parented: another worker has reported and ended it
    claim = _claim(parent.pid)
    if claim is None:
        _wait_for_new_parent(parent.pid, QUIET_WAIT_S)  # another worker reports
        os._exit(EX_CONFIG)
    # The parent is held still while its siblings go: running, it would see a worker
    # end, stop the rest and exit 0 before the signal that ends it non-zero arrives.
    os.kill(parent.pid, signal.SIGSTOP)
    try:
        for pid in _sibling_workers(parent.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.unlink(claim)  # it decided between the siblings, who are gone now
        _say(line)
        for name in _parent_semaphores():
            _unlink(name)
        os.kill(parent.pid, PARENT_SIGNAL)  # pending until it runs again
    finally:
        os.kill(parent.pid, signal.SIGCONT)
    os._exit(EX_CONFIG)


def _claim(parent: int) -> str | None:
    """Claim the report for the workers of ``parent``: the lock file's path, or None."""
    try:
        started = Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "0"
    path = os.path.join(tempfile.gettempdir(), f"aiserve-trio-refuse-{parent}-{started}")
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return None
    return path


def _sibling_workers(parent: int) -> list[int]:
    """The other hypercorn workers of ``parent`` (its spawned children, not its
    resource tracker), from /proc; empty where /proc cannot tell."""
    me = os.getpid()
    try:
        children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    except OSError:
        return []
    out = []
    for child in children:
        pid = int(child)
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if pid != me and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            out.append(pid)
    return out


def _say(line: str) -> None:
    sys.stdout.flush()
    sys.stderr.write(line)
    sys.stderr.flush()


def _parent_loses_status() -> bool:
    try:
        major, minor = dist_version("hypercorn").split(".")[:2]
        return (int(major), int(minor)) in LOSES_WORKER_STATUS
    except (PackageNotFoundError, ValueError):
        return False


def _parent_semaphores() -> list[str]:
    """The names of the named semaphores in this worker's Process kwargs, sorted."""
    kwargs: dict[str, Any] = getattr(multiprocessing.current_process(), "_kwargs", {})
    names: set[str] = set()

    def walk(value: Any, depth: int) -> None:
        if isinstance(value, synchronize.SemLock):
            name = getattr(getattr(value, "_semlock", None), "name", None)
            if isinstance(name, str):
                names.add(name)
        elif depth and hasattr(value, "__dict__"):
            for inner in vars(value).values():
                walk(inner, depth - 1)

    for value in kwargs.values():
        walk(value, 3)
    return sorted(names)


def _unlink(name: str) -> bool:
    """Unlink a semaphore and tell the resource tracker; False if it was gone already."""
    sem_unlink = getattr(synchronize, "sem_unlink", None)
    if sem_unlink is None:
        return True
    try:
        sem_unlink(name)
    except FileNotFoundError:
        return False
    resource_tracker.unregister(name, "semaphore")
    return True


def _wait_for_new_parent(pid: int, timeout: float) -> None:
    end = time.monotonic() + timeout
    while os.getppid() == pid and time.monotonic() < end:
        time.sleep(0.01)


def show_startup_logs() -> None:
    """Make the gateway's INFO lines (ready, the hypercorn guard) reach stderr.

    hypercorn configures only its own loggers; without this, an operator would
    see none of the gateway's start-up lines. Logging the operator configured
    (a level or a handler on ``aiserve_trio``) is left alone.
    """
    log = logging.getLogger("aiserve_trio")
    if log.level != logging.NOTSET or log.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    # hypercorn's own format, so the lines read as one log.
    handler.setFormatter(
        logging.Formatter(
            "%(asctime)s [%(process)d] [%(levelname)s] %(message)s", "[%Y-%m-%d %H:%M:%S %z]"
        )
    )
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
