"""The one place adapters reach into a library's private attributes.

Two things the adapters need have no public API:

- how many connections an httpx2 client holds open, and how many are busy
  (``client._transport._pool.connections``), for the pool gauge and tests;
- the TCP stream under a trio-websocket connection (``ws._stream``), which
  trio-websocket 0.12 leaves open when the server closed first.

Each access is a :class:`PrivateAccess`: the library and the version range the
access was written for. Outside that range (or if the attribute turns out not
to be there) the access is not attempted: the caller gets the safe fallback
(counts unknown; the stream close skipped) and one warning is logged, so that
a library upgrade degrades a gauge instead of breaking requests.
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
from collections.abc import Callable

import httpx2
import trio
from trio_websocket import WebSocketConnection

log = logging.getLogger("aiserve_trio.adapters.compat")
_NUMBERS = re.compile(r"\d+")


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading numeric release parts of ``version`` (``"2.16.2rc1"`` -> ``(2, 16, 2)``)."""
    out: list[int] = []
    for part in version.split("."):
        m = _NUMBERS.match(part)
        if m is None:
            break
        out.append(int(m.group()))
        if m.end() != len(part):  # "2rc1": a pre-release tag ends the release parts
            break
    return tuple(out)


class PrivateAccess:
    """One use of a library's private attribute, allowed for the versions it was written for."""

    __slots__ = ("_installed", "_supported", "_warned", "before", "dist", "since", "what")

    def __init__(
        self,
        dist: str,
        since: str,
        before: str,
        what: str,
        *,
        installed: Callable[[str], str] = importlib.metadata.version,
    ) -> None:
        """Describe the access.

        Args:
            dist: the distribution name (``importlib.metadata``).
            since: the first version the access is known to work with.
            before: the first version it is not known to work with (exclusive).
            what: the attribute path, for the warning.
            installed: how to read the installed version (tests replace it).
        """
        self.dist = dist
        self.since = since
        self.before = before
        self.what = what
        self._installed = installed
        self._supported: bool | None = None
        self._warned = False

    @property
    def supported(self) -> bool:
        """Whether the installed version is in ``[since, before)`` (looked up once)."""
        if self._supported is None:
            try:
                got = version_tuple(self._installed(self.dist))
            except importlib.metadata.PackageNotFoundError:
                got = ()
            self._supported = bool(got) and (
                version_tuple(self.since) <= got < version_tuple(self.before)
            )
            if not self._supported:
                self.give_up(f"installed version is not in [{self.since}, {self.before})")
        return self._supported

    def give_up(self, why: str) -> None:
        """Stop using the access for this process, and say so once."""
        self._supported = False
        if not self._warned:
            self._warned = True
            log.warning("%s: not used (%s); falling back", self.what, why)


HTTPX2_POOL = PrivateAccess("httpx2", "2.16", "2.18", "httpx2.AsyncClient._transport._pool")
WS_STREAM = PrivateAccess(
    "trio-websocket", "0.12", "0.13", "trio_websocket.WebSocketConnection._stream"
)


def pool_connections(client: httpx2.AsyncClient) -> tuple[int, int] | None:
    """(open connections, of which busy) of ``client``'s pool; None when that cannot be known.

    A client whose transport is not httpx2's own (a test's mock transport)
    holds no connections: ``(0, 0)``.
    """
    access = HTTPX2_POOL
    if not access.supported:
        return None
    transport = getattr(client, "_transport", None)
    if not isinstance(transport, httpx2.AsyncHTTPTransport):
        return 0, 0
    try:
        conns = transport._pool.connections
        return len(conns), sum(1 for c in conns if not c.is_idle())
    except AttributeError as exc:  # the shape changed within the range after all
        access.give_up(f"{type(exc).__name__}: {exc}")
        return None


async def close_ws_stream(ws: WebSocketConnection) -> None:
    """Close the TCP stream under ``ws`` at once; skipped when the access is not supported.

    Call it after ``ws.aclose()``: trio-websocket 0.12 leaves the stream open
    when the server closed first (the client waits for EOF, then just stops
    reading), and the socket would otherwise wait for the garbage collector.
    """
    access = WS_STREAM
    if not access.supported:
        return
    stream = getattr(ws, "_stream", None)
    if not isinstance(stream, trio.abc.AsyncResource):
        access.give_up(f"no AsyncResource at _stream (found {type(stream).__name__})")
        return
    await trio.aclose_forcefully(stream)
