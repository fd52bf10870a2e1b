"""Putting the seam in place: one attribute of hypercorn, after the version and every
fingerprint are checked.

hypercorn's Trio worker (``hypercorn.trio.run.worker_serve``) builds one ``TCPServer``
per accepted connection, looked up by that name in its module when the worker starts
serving -- after the app's lifespan start-up. :func:`install`, called from that
start-up, replaces that one name with :class:`~.tcp.GatewayTCPServer` bound to this
worker's :class:`~.worker.Worker`, and the ``trio`` that module sees with a view of it
whose ``SocketListener`` accepts every waiting connection at once (``accept.py``,
:data:`ACCEPT_SEAM`). Importing the package changes nothing.
"""

from __future__ import annotations

import importlib
import logging
import os
from functools import partial
from typing import Any, Final

import trio
from hypercorn.trio.tcp_server import TCPServer

from .accept import trio_view
from .fingerprints import problems
from .tcp import GatewayTCPServer
from .worker import Worker

log = logging.getLogger("aiserve_trio.seam")

#: Environment switch: ``off`` runs hypercorn exactly as shipped.
SWITCH: Final = "AISERVE_HYPERCORN_PATCHES"
#: hypercorn's TOML key: a hypercorn the seam does not know runs as shipped (ERROR logged).
ALLOW_UNPATCHED: Final = "aiserve_allow_unpatched"
#: The one attribute of hypercorn the seam replaces: (module, name).
SEAM: Final = ("hypercorn.trio.run", "TCPServer")
#: ... and the ``trio`` it builds its listeners with (``accept.trio_view``).
ACCEPT_SEAM: Final = ("hypercorn.trio.run", "trio")


class SeamRefused(Exception):
    """The installed hypercorn is not the one the seam was written against."""



def _worker_module() -> Any:
    return importlib.import_module(SEAM[0])


def installed() -> bool:
    """Whether hypercorn's Trio worker builds :class:`~.tcp.GatewayTCPServer` now."""
    built = getattr(_worker_module(), SEAM[1], None)
    return isinstance(built, partial) and built.func is GatewayTCPServer


def install(config: object | None = None, *, pinned: dict[str, str] | None = None) -> str:
    """Put the seam in place (once per worker); say what was done, for the start-up log.

    The worker's :class:`~.worker.Worker` is made here, from ``config``, and bound to the
    server class hypercorn's worker will build each connection with.

    Args:
        config: hypercorn's config (its TOML's ``aiserve_allow_unpatched``, and the edge
            guard's ``aiserve_*`` keys); None outside hypercorn's worker.
        pinned: the fingerprints to check (tests); ``fingerprints.PINNED`` by default.
    Raises:
        SeamRefused: this hypercorn is not the one the seam was written against, and
            ``aiserve_allow_unpatched`` is not set.
    """
    if os.environ.get(SWITCH, "").strip().lower() == "off":
        return f"off ({SWITCH}=off): hypercorn as shipped, without the edge guard"
    if installed():
        return "already installed"
    found = problems(pinned)
    if found:
        why = "; ".join(found)
        if getattr(config, ALLOW_UNPATCHED, False) is True:
            log.error(
                "hypercorn seam not installed, running hypercorn as shipped without the edge"
                " guard (%s = true): %s",
                ALLOW_UNPATCHED,
                why,
            )
            return "not installed (hypercorn as shipped)"
        raise SeamRefused(
            f"the hypercorn seam cannot be installed: {why} (pin hypercorn>=0.18,<0.19, or set"
            f" {ALLOW_UNPATCHED} = true in hypercorn's TOML to run hypercorn as shipped)"
        )
    setattr(_worker_module(), SEAM[1], partial(GatewayTCPServer, worker=Worker(config)))
    setattr(_worker_module(), ACCEPT_SEAM[1], trio_view())
    return f"installed: {SEAM[0]}.{SEAM[1]} = {GatewayTCPServer.__module__}.GatewayTCPServer"


def uninstall() -> None:
    """Put hypercorn's own ``TCPServer`` back (tests)."""
    setattr(_worker_module(), SEAM[1], TCPServer)
    setattr(_worker_module(), ACCEPT_SEAM[1], trio)
