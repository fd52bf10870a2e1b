"""The endpoints besides the chat routes that the app itself answers: probes, metrics,
the models listing, the slowest requests, the configuration and spend (admin).

The console (``console/``), the sessions (``sessions/http.py``), profiles and run
traces (``observability/debug.py``) and the audit log's reads (``audit/usage.py``)
have their own modules; this one holds what is left, bound to the app's long-lived
parts (:class:`Admin`) and, where a runtime matters, to that runtime's parts.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from ..core.api import encoder
from ..core.errors import (
    BadRequest,
    Overloaded,
    StageDeadlineExceeded,
    Unprocessable,
    UnsupportedMediaType,
)
from ..http.body import read_body
from ..http.types import JSON_HEADERS, METRICS_HEADERS

if TYPE_CHECKING:
    from ..audit.usage import UsageEndpoints
    from ..http.endpoints import Request
    from ..observability.metrics import Metrics
    from ..observability.observer import RequestObserver
    from ..reload import Reloader
    from ..runtime.generation import Parts
    from ..security.keystore.service import KeyService
    from ..sessions.bus import SessionBus

#: The largest config text ``POST /admin/config/reload`` takes.
MAX_CONFIG_BYTES = 1_048_576


class Admin:
    """The handlers; those that depend on the configuration take a runtime's parts first."""

    def __init__(
        self,
        metrics: Metrics,
        observer: RequestObserver,
        bus: SessionBus,
        usage: UsageEndpoints,
        ready: Callable[[], bool],
    ) -> None:
        """Args:
        ready: whether the app has started (and not begun to shut down).
        """
        self.metrics = metrics
        self.observer = observer
        self.bus = bus
        self.usage = usage
        self.ready = ready
        #: The app's reloader (the app makes it once the first runtime is built).
        self.reloader: Reloader | None = None
        #: The database keys (issue 47): their state in ``/healthz``, and the admin
        #: audit trail that config reloads are written to.
        self.keys: KeyService | None = None

    async def healthz(self, request: Request) -> None:
        if self.keys is None:
            await request.responder.complete(200, JSON_HEADERS, b'{"status":"ok"}')
            return
        # The worker serves either way; it says when its key table is the last one it
        # could load (the database is away).
        body = encoder.encode({"status": "ok", "keys": self.keys.health()})
        await request.responder.complete(200, JSON_HEADERS, body)

    async def readyz(self, parts: Parts, request: Request) -> None:
        problems: list[str] = []
        if not self.ready():
            problems.append("not started")
        for name, adapter in parts.adapters.items():
            if not await adapter.ready():
                problems.append(f"adapter {name} not ready")
        reachable = False
        with trio.move_on_after(1.0):  # a hung Redis must not hang the probe
            reachable = await self.bus.ping()
        if not reachable:
            problems.append(f"session bus ({self.bus.kind}) unreachable")
        if problems:
            raise Overloaded("not ready: " + "; ".join(problems), code="not_ready")
        await request.responder.complete(200, JSON_HEADERS, b'{"status":"ready"}')

    async def metrics_text(self, request: Request) -> None:
        await request.responder.complete(200, METRICS_HEADERS, self.metrics.render())

    async def recent(self, request: Request) -> None:
        body = encoder.encode(self.observer.slowest())
        await request.responder.complete(200, JSON_HEADERS, body)

    @staticmethod
    async def models(parts: Parts, request: Request) -> None:
        """Every model of every route the caller may use."""
        p = request.principal
        body = parts.models.body if p is None else parts.models.of(p.routes)
        await request.responder.complete(200, JSON_HEADERS, body)

    @staticmethod
    def client(parts: Parts, request: Request) -> str:
        """Who calls an admin endpoint (``<key id>``, or ``loopback`` with auth off)."""
        if request.principal is not None:
            return request.principal.key_id
        # The gate has refused clients off loopback (auth off) and keys that are not admin.
        return "admin" if parts.gate.enabled else "loopback"

    async def config(self, request: Request) -> None:
        """``GET /admin/config``: the active version and the last refused reload."""
        assert self.reloader is not None
        body = encoder.encode(self.reloader.status())
        await request.responder.complete(200, JSON_HEADERS, body)

    async def config_reload(self, parts: Parts, request: Request) -> None:
        """``POST /admin/config/reload``: load the config file again, or, with a TOML
        body (``Content-Type: application/toml``), save that as the file and load it.

        Raises:
            Unprocessable: the config was refused (``code`` ``config_refused``,
                ``param`` the key); the running configuration stays.
        """
        assert self.reloader is not None
        by = "api:" + self.client(parts, request)
        candidate = await _toml_body(parts, request)
        result = await self.reloader.reload(by=by, candidate=candidate)
        if self.keys is not None:  # the admin audit trail (issue 47, item 5)
            p = request.principal
            await self.keys.record(
                actor=p.key_id if p is not None else by.removeprefix("api:"),
                tenant=p.tenant if p is not None else parts.config.server.default_tenant,
                client=parts.gate.client_address(request.scope, request.headers),
                action="config.reloaded" if result.error is None else "config.refused",
                target=result.version,
                detail={
                    "applied": result.applied,
                    "saved_new_text": candidate is not None,
                    "error": result.error,
                },
            )
        version = [(b"x-aiserve-config-version", result.version.encode())]
        if result.error is not None:
            key = re.search(r"key `([^`]+)`", result.error)
            raise Unprocessable(
                result.error,
                param=key[1] if key else None,
                code="config_refused",
                headers={"X-Aiserve-Config-Version": result.version},
            )
        body = encoder.encode(
            {
                "applied": result.applied,
                "unchanged": result.unchanged,
                "version": result.version,
                "error": None,
            }
        )
        await request.responder.complete(200, [*JSON_HEADERS, *version], body)

    async def usage_admin(self, parts: Parts, request: Request) -> None:
        """``GET /admin/usage`` (audit/usage.py)."""
        self.client(parts, request)
        await self.usage.admin(request)


async def _toml_body(parts: Parts, request: Request) -> str | None:
    """The config text a reload request proposes; None when its body is empty.

    Raises:
        UnsupportedMediaType: a body that is not ``application/toml`` (``text/plain``
            would let a web page send it without a preflight).
        BadRequest: a body that is not UTF-8.
        PayloadTooLarge: more than :data:`MAX_CONFIG_BYTES`.
    """
    limit = parts.config.limits.body_total_timeout_ms / 1000.0
    body: bytes | None = b""
    with trio.move_on_after(limit) as scope:
        body = await read_body(request.receive, MAX_CONFIG_BYTES)
    if scope.cancelled_caught:
        raise StageDeadlineExceeded("parse", "the request body did not arrive in time")
    if not body:
        return None
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/toml":
        raise UnsupportedMediaType(
            "a config to save must be sent as application/toml (no body: read the file again)"
        )
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("the config text is not UTF-8", param="body") from None
