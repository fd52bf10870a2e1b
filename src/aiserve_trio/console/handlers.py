"""The console's endpoints: the page, its files, and the API the page calls.

================================  ======================  =====================================
``GET /admin/``                   open                    the page (no secrets in it)
``GET /admin/static/{name}``      open                    its script and style sheet
``POST /admin/api/login``         admin key               a console token (``expires_in`` s)
``GET /admin/api/overview``       admin key or token      SLA per model, stages, open streams
``GET /admin/api/slow``           admin key or token      the slowest recent requests
``GET /admin/api/routes``         admin key or token      routes and their steps, the version
``PUT /admin/api/routes/steps``   admin key or token      a route's steps: new order, on/off
================================  ======================  =====================================

With ``[auth] enabled = false`` the API answers only clients on a loopback address,
as ``/debug/*`` does, and login hands out no token (there is nothing to sign for).

The numbers are this worker's (each hypercorn worker has its own registry, like
``/metrics``): the page says which worker answered.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Protocol

import msgspec
import trio

from ..budgets import STAGES
from ..errors import NotFound
from ..http.endpoints import Admission, Auth, Endpoint, Request
from ..http.types import JSON_HEADERS, Headers
from ..observability.debug import require_loopback
from . import sla

if TYPE_CHECKING:
    from ..config import Config
    from ..observability.metrics import Metrics
    from ..observability.observer import RequestObserver
    from ..security.gate import Gate

#: The page's files: name -> content type.
FILES = {
    "index.html": b"text/html; charset=utf-8",
    "console.js": b"text/javascript; charset=utf-8",
    "console.css": b"text/css; charset=utf-8",
}
#: Everything the page loads comes from here; no inline script or style, no framing.
CSP = (
    b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    b"img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_STATIC_HEADERS: Headers = [
    (b"content-security-policy", CSP),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-cache"),
]
#: API answers are never cached (a token's, a key's view).
_API_HEADERS: Headers = [*JSON_HEADERS, (b"cache-control", b"no-store")]
#: Seconds the overview's window covers.
WINDOW_S = 60.0
_encoder = msgspec.json.Encoder()


class Host(Protocol):
    """What the console reads from the app."""

    @property
    def config(self) -> Config: ...

    @property
    def gate(self) -> Gate: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def observer(self) -> RequestObserver: ...


def static_files() -> dict[str, bytes]:
    """The page's files as shipped in the package."""
    folder = resources.files(__package__) / "static"
    return {name: (folder / name).read_bytes() for name in FILES}


class Login(msgspec.Struct, kw_only=True):
    #: None with auth off.
    token: str | None
    expires_in: int | None
    key_id: str | None
    auth: bool


class Overview(msgspec.Struct, kw_only=True):
    #: The worker that answered (each has its own numbers).
    pid: int
    #: The numbers of the last ``window.window_s`` seconds, and since the worker started.
    window: sla.Table
    total: sla.Table
    #: Chat requests in their sse stage now.
    open_streams: int


@dataclass
class Console:
    """The handlers of one app."""

    host: Host
    files: dict[str, bytes]
    window: sla.Window

    @classmethod
    def of(cls, host: Host) -> Console:
        return cls(host, static_files(), sla.Window(WINDOW_S))

    def endpoints(self) -> list[Endpoint]:
        get, req = ("GET",), Admission.REQUEST
        api = Auth.ADMIN_OR_CONSOLE_TOKEN
        return [
            Endpoint("/admin", get, Auth.OPEN, req, self.redirect, "console"),
            Endpoint("/admin/", get, Auth.OPEN, req, self.page, "console"),
            Endpoint("/admin/static/{name}", get, Auth.OPEN, req, self.static, "console"),
            Endpoint("/admin/api/login", ("POST",), Auth.ADMIN, req, self.login, "console_api"),
            Endpoint("/admin/api/overview", get, api, req, self.overview, "console_api"),
            Endpoint("/admin/api/slow", get, api, req, self.slow, "console_api"),
        ]

    # --- the page ------------------------------------------------------------------

    async def redirect(self, request: Request) -> None:
        await request.responder.complete(308, [(b"location", b"/admin/")], b"")

    async def page(self, request: Request) -> None:
        await self._file(request, "index.html")

    async def static(self, request: Request) -> None:
        name = request.params["name"]
        if name not in FILES or name == "index.html":
            raise NotFound(f"the console has no file {name[:100]!r}")
        await self._file(request, name)

    async def _file(self, request: Request, name: str) -> None:
        headers = [(b"content-type", FILES[name]), *_STATIC_HEADERS]
        await request.responder.complete(200, headers, self.files[name])

    # --- the API -------------------------------------------------------------------

    def _local(self, request: Request) -> None:
        if not self.host.gate.enabled:
            require_loopback(request, "the console's endpoints")

    async def _json(self, request: Request, body: msgspec.Struct | dict[str, object]) -> None:
        await request.responder.complete(200, _API_HEADERS, _encoder.encode(body))

    async def login(self, request: Request) -> None:
        """``POST /admin/api/login`` with ``Authorization: Bearer <admin key>``: a console token.

        Raises:
            Forbidden: auth is off and the client is not on loopback (the gate has
                refused keys that are not admin keys).
        """
        self._local(request)
        gate = self.host.gate
        p = request.principal
        if p is None:
            out = Login(token=None, expires_in=None, key_id=None, auth=gate.enabled)
        else:
            token = gate.console_token(p)
            ttl = gate.console_tokens.ttl_s
            out = Login(token=token, expires_in=ttl, key_id=p.key_id, auth=True)
        await self._json(request, out)

    async def overview(self, request: Request) -> None:
        """``GET /admin/api/overview``: see :mod:`.sla`."""
        self._local(request)
        m = self.host.metrics
        metrics = (
            m.request_duration,
            m.model_ttft,
            m.requests,
            m.model_tokens,
            m.stage_latency,
            m.task_count,
        )
        snap = sla.read((f for metric in metrics for f in metric.collect()), trio.current_time())
        start = self.window.add(snap)
        span = snap.at - start.at
        out = Overview(
            pid=os.getpid(),
            window=sla.overview(sla.since(snap, start), span, STAGES),
            total=sla.overview(snap, None, STAGES),
            open_streams=round(snap.live.get("sse", 0.0)),
        )
        await self._json(request, out)

    async def slow(self, request: Request) -> None:
        """``GET /admin/api/slow``: the slowest of the recent requests, with stage times."""
        self._local(request)
        await self._json(request, self.host.observer.slowest())

