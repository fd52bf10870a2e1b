"""The audit log's database calls, run in a process of the worker's own.

:class:`ProcessStore` starts ``python -m aiserve_trio.audit`` (``child.py``),
sends it each call as a frame on a pipe and reads the answer from another: the
worker keeps no database connection and no thread. Measured against the same calls
in a thread of the worker (``bench.ab --together``, c=16, non-streamed, 8 rounds,
2026-12-02; docs/architecture.md, "Where the audit log's CPU goes"): a thread beside
the event loop cost the loop ~25 us a request beyond its own inserts -- two threads
of one process taking turns at the GIL and at the allocator, on one CPU -- and a
process costs it about nothing; the inserts themselves, ~9 us a row in the child,
are all that is left.

A child that dies (killed, out of memory) fails the call under way, as a database
error does, and the next call starts a new one, which opens the database again. A
call abandoned by a cancellation (the shutdown's grace ran out) leaves the pipes
mid-frame: the child is killed, the same way. The child ends by itself when the
worker does (its stdin ends).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import trio

from .child import frame
from .schema import SchemaTooNew

#: The directory holding the ``aiserve_trio`` package, put first on the child's
#: ``PYTHONPATH``: the child imports the same code as the worker.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_decode = msgspec.msgpack.Decoder().decode
#: Seconds :meth:`ProcessStore.stop` waits for a killed child to be reaped.
REAP_WAIT = 2.0
#: Errors the child names that are raised as themselves (the rest: AuditStoreError).
_KNOWN: dict[str, type[Exception]] = {"SchemaTooNew": SchemaTooNew}


class AuditStoreError(Exception):
    """The database refused a call, or the writer's process is gone."""


class ProcessStore:
    """The database calls of one :class:`~aiserve_trio.audit.log.AuditLog`, in a child
    process (see the module docstring)."""

    def __init__(self, spec: dict[str, Any], *, name: str, placeholder: str, day_sql: str) -> None:
        """Args:
        spec: what the child opens (``child.open_database``), and ``access_log``.
        name: how the start-up log names the database.
        placeholder, day_sql: the backend's SQL spellings (the usage reads').
        """
        self.spec = spec
        self.name = name
        self.placeholder = placeholder
        self.day_sql = day_sql
        self._proc: trio.Process | None = None
        self._buffer = bytearray()
        #: One call at a time on the pipes.
        self._lock = trio.Lock()

    def __str__(self) -> str:
        return self.name

    @property
    def pid(self) -> int | None:
        """The child's pid while it runs (tests)."""
        return None if self._proc is None else self._proc.pid

    async def open(self) -> int:
        """Start the child, which connects and migrates; the schema version."""
        return int(await self._call("open"))

    async def insert(self, rows: list[tuple[Any, ...]]) -> None:
        await self._call("insert", rows)

    async def purge(self, before: float) -> int:
        return int(await self._call("purge", before))

    async def query(self, sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in await self._call("query", sql, list(params))]

    async def close(self) -> None:
        """Have the child close the database and end (the caller bounds the wait)."""
        proc = self._proc
        if proc is None:
            return
        try:
            await self._call("close")
            self._proc = None
            await _reap(proc)  # its stdin ends: it exits
        finally:
            await self.stop()

    async def stop(self) -> None:
        """Kill the child if it runs, and reap it (the app is ending, the child did not
        answer in time, or its pipes are mid-frame)."""
        proc, self._proc = self._proc, None
        self._buffer.clear()
        if proc is None:
            return
        # Bounded: a killed process is gone in ms, but one stuck in the kernel (a dead
        # NFS mount) must not hold the app's exit.
        with trio.CancelScope(shield=True), trio.move_on_after(REAP_WAIT):
            if proc.returncode is None:
                proc.kill()
            await _reap(proc)

    async def _start(self) -> trio.Process:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p
        )
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "aiserve_trio.audit", json.dumps(self.spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._proc = proc
        self._buffer.clear()
        return proc

    async def _call(self, method: str, *args: Any) -> Any:
        async with self._lock:
            proc = self._proc
            if proc is None or proc.returncode is not None:
                proc = await self._start()
                if method != "open":  # a new child opens the database first
                    await self._exchange(proc, "open", ())
            return await self._exchange(proc, method, args)

    async def _exchange(self, proc: trio.Process, method: str, args: tuple[Any, ...]) -> Any:
        assert proc.stdin is not None
        assert proc.stdout is not None
        done = False
        try:
            await proc.stdin.send_all(frame([method, list(args)]))
            ok, result = _decode(await self._read(proc.stdout))
            done = True
        except (trio.BrokenResourceError, trio.ClosedResourceError, EOFError) as exc:
            raise AuditStoreError(
                f"the audit writer's process ended (exit status {proc.returncode})"
            ) from exc
        finally:
            if not done:
                await self.stop()  # dead, or mid-frame: the next call starts a new one
        if not ok:
            kind, message = result
            raise _KNOWN.get(kind, AuditStoreError)(
                message if kind in _KNOWN else f"{kind}: {message}"
            )
        return result

    async def _read(self, stream: trio.abc.ReceiveStream) -> bytes:
        """One frame's body from the child's stdout."""
        buf = self._buffer
        while True:
            if len(buf) >= 4:
                size = int.from_bytes(buf[:4], "little")
                if len(buf) >= 4 + size:
                    body = bytes(buf[4 : 4 + size])
                    del buf[: 4 + size]
                    return body
            chunk = await stream.receive_some(1 << 16)
            if not chunk:
                raise EOFError
            buf += chunk


async def _reap(proc: trio.Process) -> None:
    """Close the pipes to ``proc`` and wait for it to exit."""
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            await pipe.aclose()
    await proc.wait()
