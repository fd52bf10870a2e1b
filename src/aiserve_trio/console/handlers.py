"""The console's endpoints: the page, its files, and the API the page calls.

================================  ======================  =====================================
``GET /admin/``                   open                    the page (no secrets in it)
``GET /admin/static/{name}``      open                    its script and style sheet
``POST /admin/api/login``         admin key               a console token (``expires_in`` s)
``POST /admin/api/logout``        console token           the token refused until its expiry
``GET /admin/api/overview``       admin key or token      SLA per model, stages, open streams
``GET /admin/api/slow``           admin key or token      the slowest recent requests
``GET /admin/api/routes``         admin key or token      routes and their steps, the version
``PUT /admin/api/routes/steps``   admin key or token      a route's steps: new order, on/off
``GET /admin/api/cache``          admin key or token      cache results, similarity, semantic hits
``GET /admin/api/spend``          admin key or token      spend per day, tenant, key, model; budgets
================================  ======================  =====================================

With ``[auth] enabled = false`` the API answers only clients on a loopback address
through a loopback ``Host``, as ``/debug/*`` does (the gate checks it, with what a web
page could send: ``security/browser.py``), and login hands out no token.

The numbers are this worker's (each hypercorn worker has its own registry, like
``/metrics``): the page says which worker answered.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import msgspec
import trio

from ..config import ConfigError, parse_config
from ..core.budgets import STAGES
from ..core.errors import (
    BadRequest,
    BodyReadTimeout,
    Conflict,
    NotFound,
    Unprocessable,
    UnsupportedMediaType,
)
from ..http.body import read_body
from ..http.endpoints import Admission, Auth, Endpoint, Request
from ..http.types import JSON_HEADERS, Headers
from ..observability.metrics import label_value
from ..reload import config_version
from ..routes import route_adapters, route_label, route_models
from . import cacheview, sla
from .edit import EditError, StepState, set_steps
from .spend import spend_view

if TYPE_CHECKING:
    from ..audit.usage import UsageEndpoints
    from ..config import Config
    from ..observability.metrics import Metrics
    from ..observability.observer import RequestObserver
    from ..security.gate import Gate
    from ..security.keystore.service import KeyService

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
#: A steps change is a few hundred bytes; it must arrive within this many seconds.
MAX_BODY = 64 * 1024
BODY_TIMEOUT_S = 5.0
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

    @property
    def cache(self) -> cacheview.CacheLike | None: ...


class Result(Protocol):
    """What one reload did (``reload.ReloadResult``)."""

    @property
    def applied(self) -> bool: ...

    @property
    def version(self) -> str: ...

    @property
    def error(self) -> str | None: ...

    @property
    def unchanged(self) -> bool: ...


class Reloads(Protocol):
    """The app's reloader (``reload.Reloader``): validates, writes and applies a config."""

    async def reload(self, *, by: str, candidate: str | None = None) -> Result: ...

    def status(self) -> dict[str, object]: ...


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


class Logout(msgspec.Struct, kw_only=True):
    #: False with auth off (there is no token to refuse).
    revoked: bool
    #: Refused by every worker (it reached the Redis session bus), or by this one only.
    shared: bool
    #: Until when the token is refused (its expiry, Unix seconds).
    until: int | None


class StepOut(msgspec.Struct, kw_only=True):
    name: str
    kind: str
    enabled: bool


class RouteOut(msgspec.Struct, kw_only=True):
    path: str
    name: str
    steps: list[StepOut]
    #: The adapters the route serves from (the default first; more with model routing).
    adapters: list[str]
    #: Each model the route serves -> the adapter that answers it.
    models: dict[str, str]


class Routes(msgspec.Struct, kw_only=True):
    #: The active config's version (send it back with a change).
    version: str
    #: Whether a change can be saved; if not, ``reason`` says why.
    writable: bool
    reason: str | None
    #: The reloader's status: version, source, loaded_at, loaded_by, last_refused...
    reload: dict[str, object]
    routes: list[RouteOut]


class StepIn(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    enabled: bool = True


class StepsIn(msgspec.Struct, forbid_unknown_fields=True):
    """``PUT /admin/api/routes/steps``: every step of the route, in the new order."""

    path: str
    #: The version the change was made against (``GET /admin/api/routes``).
    version: str
    steps: list[StepIn]


class Saved(msgspec.Struct, kw_only=True):
    applied: bool
    unchanged: bool
    version: str


_steps_in = msgspec.json.Decoder(StepsIn)


class Overview(msgspec.Struct, kw_only=True):
    #: The worker that answered (each has its own numbers).
    pid: int
    #: The numbers of the last ``window.window_s`` seconds, and since the worker started.
    window: sla.Table
    total: sla.Table
    #: Chat requests in their sse stage now.
    open_streams: int
    #: The audit database keeps keys: the API keys and audit trail sections are shown.
    keys: bool = False
    #: MCP servers are configured: the MCP section is shown.
    mcp: bool = False


@dataclass
class Console:
    """The handlers of one app."""

    host: Host
    files: dict[str, bytes]
    window: sla.Window
    #: The app's reloader; None: the routes are shown read-only.
    reloader: Reloads | None = None
    #: The audit log's usage reads (the Spend page); None: spend is not shown.
    usage: UsageEndpoints | None = None
    #: The admin audit trail (issue 47): a steps change is one of its rows.
    keys: KeyService | None = None
    #: One steps change at a time: read the file, edit it, reload.
    _saving: trio.Lock = field(default_factory=trio.Lock)

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
            Endpoint("/admin/api/logout", ("POST",), api, req, self.logout, "console_api"),
            Endpoint("/admin/api/overview", get, api, req, self.overview, "console_api"),
            Endpoint("/admin/api/slow", get, api, req, self.slow, "console_api"),
            Endpoint("/admin/api/routes", get, api, req, self.routes, "console_api"),
            Endpoint("/admin/api/routes/steps", ("PUT",), api, req, self.put_steps, "console_api"),
            Endpoint("/admin/api/cache", get, api, req, self.cache, "console_api"),
            Endpoint("/admin/api/spend", get, api, req, self.spend, "console_api"),
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

    async def _json(self, request: Request, body: msgspec.Struct | dict[str, object]) -> None:
        await request.responder.complete(200, _API_HEADERS, _encoder.encode(body))

    async def login(self, request: Request) -> None:
        """``POST /admin/api/login`` with ``Authorization: Bearer <admin key>``: a console token;
        with an issuer's JWT (``[[auth.oidc]]``), that JWT back, with the seconds it has left.

        With auth off the gate has refused clients off loopback; with auth on, keys
        that are not admin keys.
        """
        gate = self.host.gate
        p = request.principal
        if p is None:
            out = Login(token=None, expires_in=None, key_id=None, auth=gate.enabled)
        elif (signed_on := gate.signed_on(request)) is not None:
            # An issuer's JWT (pasted, or set by a reverse proxy): the console uses it as
            # it is, until it expires -- there is no key to sign a console token for.
            token, ttl = signed_on
            out = Login(token=token, expires_in=ttl, key_id=p.key_id, auth=True)
        else:
            token = gate.console_token(p)
            ttl = gate.console_tokens.ttl_s
            out = Login(token=token, expires_in=ttl, key_id=p.key_id, auth=True)
        await self._json(request, out)

    async def logout(self, request: Request) -> None:
        """``POST /admin/api/logout`` with ``Authorization: Bearer <console token>``: the
        token is refused from now until its expiry (the gate's
        :class:`~aiserve_trio.security.gate.Revoked`); the page's "Log out" calls it
        before forgetting the token.

        Raises:
            BadRequest: an admin key was sent instead of a console token.
        """
        if request.principal is None:  # auth off: no token was handed out
            out = Logout(revoked=False, shared=False, until=None)
        else:
            until, shared = await self.host.gate.console_logout(request)
            out = Logout(revoked=True, shared=shared, until=until)
        await self._json(request, out)

    def _snapshot(self) -> sla.Snapshot:
        m = self.host.metrics
        metrics = (
            m.request_duration,
            m.model_ttft,
            m.requests,
            m.model_tokens,
            m.stage_latency,
            m.task_count,
        )
        return sla.read((f for metric in metrics for f in metric.collect()), trio.current_time())

    async def sample(self) -> None:
        """Keep the last minute's snapshots whether or not a page is polling, so the
        window a page first looks at already covers the minute before (the app's
        background task)."""
        while True:
            self.window.add(self._snapshot())
            await trio.sleep(self.window.step)

    async def overview(self, request: Request) -> None:
        """``GET /admin/api/overview``: see :mod:`.sla`."""
        snap = self._snapshot()
        start = self.window.add(snap)
        span = snap.at - start.at
        names = {
            label_value(model): model
            for adapter in self.host.config.adapters.values()
            for model in getattr(adapter, "models", ())
        }
        out = Overview(
            pid=os.getpid(),
            window=sla.overview(sla.since(snap, start), span, STAGES, names),
            total=sla.overview(snap, None, STAGES, names),
            open_streams=round(snap.live.get("sse", 0.0)),
            keys=self.keys is not None,
            mcp=bool(self.host.config.mcp.servers),
        )
        await self._json(request, out)

    async def slow(self, request: Request) -> None:
        """``GET /admin/api/slow``: the slowest of the recent requests, with stage times
        (an admin of one tenant sees that tenant's requests only)."""
        p = request.principal
        tenant = p.admin_tenant if p is not None else None
        await self._json(request, self.host.observer.slowest(tenant))

    async def cache(self, request: Request) -> None:
        """``GET /admin/api/cache``: see :mod:`.cacheview`."""
        m = self.host.metrics
        p = request.principal  # an admin of one tenant sees that tenant's questions only
        out = cacheview.view(
            m.cache_requests.collect(),
            m.cache_similarity.collect(),
            self.host.cache,
            p.admin_tenant if p is not None else None,
        )
        await self._json(request, out)

    async def spend(self, request: Request) -> None:
        """``GET /admin/api/spend``: see :mod:`.spend`."""
        p = request.principal  # an admin of one tenant sees that tenant's spend only
        tenant = p.admin_tenant if p is not None else None
        auth = self.host.config.auth
        keys = frozenset(k.id for k in (auth.keys if auth else []) if k.tenant == tenant)
        out = await spend_view(self.usage, self.host.gate, tenant=tenant, keys=keys)
        await self._json(request, out)

    # --- routes and their steps ------------------------------------------------------

    def _writable(self) -> str | None:
        """Why a change cannot be saved, or None."""
        if self.reloader is None:
            return "this gateway cannot reload its configuration"
        source = self.host.config.source
        if source.startswith("<"):
            return "the gateway was started without a config file (AISERVE_CONFIG)"
        return None

    def _version(self) -> tuple[str, dict[str, object]]:
        if self.reloader is None:
            return "", {}
        status = self.reloader.status()
        return str(status.get("version", "")), status

    async def routes(self, request: Request) -> None:
        """``GET /admin/api/routes``: every route, its steps, and whether they can be changed."""
        version, status = self._version()
        why = self._writable()
        out = Routes(
            version=version,
            writable=why is None,
            reason=why,
            reload=status,
            routes=[
                RouteOut(
                    path=rc.path,
                    name=route_label(rc),
                    steps=[StepOut(name=s.name, kind=s.KIND, enabled=s.enabled) for s in rc.steps],
                    adapters=route_adapters(rc),
                    models=route_models(self.host.config.adapters, rc),
                )
                for rc in self.host.config.routes
            ],
        )
        await self._json(request, out)

    async def put_steps(self, request: Request) -> None:
        """``PUT /admin/api/routes/steps``: a route's steps in a new order, switched on or off.

        The change is made in the config file's text (:mod:`.edit`) and handed to the
        reloader, which validates the whole file, writes it and applies it -- or
        refuses it and writes nothing.

        Raises:
            BadRequest: the body is not a :class:`StepsIn`.
            Conflict: the config cannot be saved, or changed since ``version``.
            Unprocessable: the steps are not the route's, or the reloader refused
                the new config (its one-line reason).
        """
        if request.principal is not None:  # the config is every tenant's
            request.principal.check_global_admin(request.path)
        change = await self._read(request)
        if change is None:
            return  # the client went away
        reloader = self.reloader
        why = self._writable()
        if why is not None or reloader is None:
            raise Conflict(f"cannot save: {why}", code="config_not_writable")
        steps = [StepState(s.name, s.enabled) for s in change.steps]
        by = f"console:{request.principal.key_id if request.principal else 'loopback'}"
        async with self._saving:
            version, _ = self._version()
            if change.version != version:
                raise Conflict(
                    f"the configuration changed since this page read it (version "
                    f"{change.version or '-'}; now {version}): look at the steps again",
                    param="version",
                    code="stale_version",
                )
            path = Path(self.host.config.source)
            try:
                text = await trio.to_thread.run_sync(path.read_text, "utf-8")
            except OSError as exc:
                why = f"cannot read {path}: {exc.strerror}"
                raise Conflict(why, code="config_unreadable") from None
            # The file as it is now must be the config that runs: a hand edit not yet
            # reloaded would otherwise be applied with the console's change, unseen.
            on_disk = await trio.to_thread.run_sync(_version_of, text, path)
            if on_disk != version:
                raise Conflict(
                    f"{path} changed on disk since it was loaded (now: {on_disk}); reload it "
                    "(or wait for the file watcher), then make the change again",
                    code="config_file_changed",
                )
            try:
                candidate = set_steps(text, change.path, steps)
            except EditError as exc:
                raise Unprocessable(str(exc), param="steps", code=exc.code) from None
            result = await reloader.reload(by=by, candidate=candidate)
        if self.keys is not None:
            p = request.principal
            await self.keys.record(
                actor=p.key_id if p is not None else "loopback",
                tenant=p.tenant if p is not None else self.host.config.server.default_tenant,
                client=self.host.gate.client_address(request.scope, request.headers),
                action="chain.edited" if result.error is None else "chain.refused",
                target=change.path,
                detail={
                    "steps": [{"name": s.name, "enabled": s.enabled} for s in change.steps],
                    "version": result.version,
                    "error": result.error,
                },
            )
        if result.error is not None:
            raise Unprocessable(result.error, code="config_refused")
        out = Saved(applied=result.applied, unchanged=result.unchanged, version=result.version)
        await self._json(request, out)

    async def _read(self, request: Request) -> StepsIn | None:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise UnsupportedMediaType("the body must be application/json")
        body: bytes | None = None
        with trio.move_on_after(BODY_TIMEOUT_S) as scope:
            body = await read_body(request.receive, MAX_BODY)
        if scope.cancelled_caught:
            raise BodyReadTimeout("the request body did not arrive in time")
        if body is None:
            return None
        try:
            return _steps_in.decode(body)
        except msgspec.ValidationError as exc:
            shape = "{path, version, steps: [{name, enabled}]}"
            raise BadRequest(f"expected {shape}: {exc}", param="body") from None
        except msgspec.DecodeError:
            raise BadRequest("the body is not valid JSON", param="body") from None


def _version_of(text: str, path: Path) -> str:
    """The version of the config ``text`` (the file at ``path``), or why it has none."""
    try:
        config = parse_config(text, source=str(path), base_dir=path.parent)
    except ConfigError as exc:
        return f"not valid now: {exc}"
    return config_version(config)
