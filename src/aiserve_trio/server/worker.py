"""What one worker's seam keeps across its connections, in one object passed explicitly.

:func:`~.seam.install` makes one :class:`Worker` from hypercorn's config and binds it to
the server class it puts in hypercorn's worker; each ``GatewayTCPServer`` hands it to its
task group and its HTTP/2 protocol. Nothing of it lives in a module: two workers (or two
tests) never share a penalty box.

The app reaches the one part of it that it needs, the penalty box's count of failed
authentications, through the scope: the seam puts :meth:`Worker.strike` in every HTTP
scope's ``extensions`` under ``http.types.STRIKE``, where the gate finds it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from time import time
from wsgiref.handlers import format_date_time

import trio
from hypercorn.config import Config

from ..http.turns import Turns
from ..security.edge import EdgeSettings, PenaltyBox, edge_settings, peer_key
from . import datecache

log = logging.getLogger("aiserve_trio.edge")


class DatedConfig(Config):
    """hypercorn's config, whose ``Date`` header is formatted once a second.

    Made by :meth:`Worker.dated` as a view sharing the config's attributes, so it reads
    exactly what hypercorn loaded; the worker's formatter is in a slot of the view's own,
    not among those attributes.
    """

    __slots__ = ("date",)
    date: Callable[[float], str]

    def response_headers(self, protocol: str) -> list[tuple[bytes, bytes]]:
        if self.alt_svc_headers or self._quic_addresses:  # HTTP/3 advertised: hypercorn's own
            return super().response_headers(protocol)
        headers = []
        if self.include_date_header:
            headers.append((b"date", self.date(time()).encode("ascii")))
        if self.include_server_header:
            headers.append((b"server", f"hypercorn-{protocol}".encode("ascii")))
        return headers


class Worker:
    """One worker's seam state: the edge guard's settings and penalty box, the queue of
    requests starting, and the config view with the ``Date`` header formatted once a second.

    Args:
        config: hypercorn's config, whose ``aiserve_*`` keys are the guard's settings
            (:func:`~..security.edge.edge_settings`; what is wrong in them is logged at
            ERROR and left at its default); None: the defaults.
    """

    __slots__ = ("_view", "box", "date", "settings", "turns")

    def __init__(self, config: object | None = None) -> None:
        settings, problems = edge_settings(config)
        for problem in problems:
            log.error("hypercorn config: %s", problem)
        #: The guard's settings.
        self.settings: EdgeSettings = settings
        #: Addresses that misbehaved, refused at accept; None: turned off
        #: (``aiserve_penalty_first_s = 0``, behind a proxy).
        self.box: PenaltyBox | None = (
            PenaltyBox(settings.penalty_first_s, settings.penalty_max_s, settings.penalty_peers)
            if settings.penalty_first_s > 0
            else None
        )
        #: The worker's queue of requests starting, which the app uses through the scope
        #: (``http.types.TURNS``; its limit is the app's ``[deadline] max_starting``) and
        #: the read loop consults before reading a request (``preread.py``).
        self.turns = Turns()
        #: ``format_date_time``, formatting each whole second once.
        self.date = datecache.cached(format_date_time)
        self._view: tuple[Config, DatedConfig] | None = None

    def dated(self, config: Config) -> DatedConfig:
        """The :class:`DatedConfig` view of ``config`` (the same one while the config is)."""
        if isinstance(config, DatedConfig):
            return config
        held = self._view
        if held is None or held[0] is not config:
            view = object.__new__(DatedConfig)
            view.__dict__ = config.__dict__  # the same attributes, not a copy
            view.date = self.date
            held = self._view = (config, view)
        return held[1]

    def strike(self, host: str) -> float:
        """Count a failed authentication by ``host``; how long its new connections are
        refused (0: not refused, or no penalty box)."""
        box = self.box
        return box.strike(peer_key(host), trio.current_time()) if box is not None else 0.0
