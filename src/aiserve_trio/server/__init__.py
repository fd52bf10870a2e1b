"""The gateway's one seam into hypercorn (moved here from ``hypercorn_seam.py`` and ``http/``)."""

from .disconnect import Disconnect, ReceiveWatcher, ServerCall, server_call
from .tcp import ALLOW_UNPATCHED, SWITCH, SeamRefused, install, installed, uninstall

__all__ = [
    "ALLOW_UNPATCHED",
    "SWITCH",
    "Disconnect",
    "ReceiveWatcher",
    "SeamRefused",
    "ServerCall",
    "install",
    "installed",
    "server_call",
    "uninstall",
]
