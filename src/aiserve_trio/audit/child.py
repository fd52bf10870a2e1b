"""The audit writer's process: ``python -m aiserve_trio.audit SPEC`` (``__main__.py``).

Started by :class:`~aiserve_trio.audit.process.ProcessStore`, one per worker. It owns
the database connection and runs the calls the worker sends it, one at a time, in
order: each a frame on its stdin, each answered by a frame on its stdout. A frame is
a 4-byte little-endian length and a MessagePack array. A call is ``[method, args]``
(``open``, ``insert``, ``purge``, ``query``, ``close``); its answer ``[true, result]``
or ``[false, [error type, message]]``. With ``access_log`` in the spec, ``insert``
also prints each row as a JSON line on stderr (the worker's own stderr, inherited).

It exits when its stdin ends: after ``close``, or when the worker is gone. The spec
(JSON) names the backend and where it is; a PostgreSQL DSN is read from the
environment variable the spec names, never from the command line (which ``ps``
shows).
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import msgspec

from .row import access_line

_HEAD = struct.Struct("<I")
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


def frame(payload: Any) -> bytes:
    """``payload`` as one frame: its length, then its MessagePack bytes."""
    body = _encode(payload)
    return _HEAD.pack(len(body)) + body


def read_frame(stream: IO[bytes]) -> Any:
    """The next frame's payload from a blocking ``stream``; None at its end."""
    head = stream.read(_HEAD.size)
    if len(head) < _HEAD.size:
        return None
    (size,) = _HEAD.unpack(head)
    body = stream.read(size)
    if len(body) < size:
        return None
    return _decode(body)


def open_database(spec: dict[str, str]) -> Any:
    """The database the spec names (see the module docstring)."""
    if spec["backend"] == "postgres":
        from .postgres import PostgresDatabase

        dsn = os.environ.get(spec["dsn_env"], "")
        return PostgresDatabase(dsn, name=spec["name"])
    from .sqlite import SQLiteDatabase

    return SQLiteDatabase(Path(spec["path"]))


def serve(db: Any, calls: IO[bytes], answers: IO[bytes], access: IO[bytes] | None) -> None:
    """Answer calls until ``calls`` ends (see the module docstring)."""

    def insert(rows: Sequence[Sequence[Any]]) -> None:
        db.insert(rows)
        if access is not None:
            access.write(b"".join(access_line(r) for r in rows))
            access.flush()

    methods: dict[str, Callable[..., Any]] = {
        "open": db.open,
        "insert": insert,
        "purge": db.purge,
        "query": db.query,
        "close": db.close,
    }
    while True:
        call = read_frame(calls)
        if call is None:
            break
        method, args = call
        try:
            answer = [True, methods[method](*args)]
        except Exception as exc:
            answer = [False, [type(exc).__name__, str(exc)]]
        answers.write(frame(answer))
        answers.flush()
    db.close()


def main(argv: list[str]) -> None:
    spec = json.loads(argv[1])
    access = sys.stderr.buffer if spec.get("access_log") else None
    serve(open_database(spec), sys.stdin.buffer, sys.stdout.buffer, access)

