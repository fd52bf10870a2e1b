"""The gate every HTTP request passes: admission, authentication, authorisation, rate limits.

:class:`Gate` is built once per app from ``[auth]`` and ``[limits]``. The app
calls :meth:`Gate.enter` on the request head (a fast 503 beyond the worker's
in-flight cap, before any body is read), then :meth:`Gate.authenticate`, which
returns the :class:`~.auth.Principal` the request acts as -- its tenant is the
only tenant the request can touch, whatever the client sends -- and
:meth:`Gate.after_chat` to charge the tokens a reply used.

What is open: ``/healthz`` and ``/readyz`` always; ``/metrics`` when
``[auth] metrics = "open"``. ``/debug/*`` needs an admin key. With
``[auth] enabled = false`` (or no ``[auth]`` table) every request acts as the
route's (or the default) tenant with every right, and start-up says so loudly.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import msgspec
import trio

from ..api import encoder, error_json
from ..errors import Forbidden, Overloaded, Unauthorized
from ..stages.request import JSON_HEADERS
from .admission import Admission
from .auth import KeyEntry, KeyStore, Principal, StreamTokens, bearer, secret_from_env
from .ratelimit import Limiter, MemoryLimiter, RedisLimiter

if TYPE_CHECKING:
    from ..config import Config
    from ..stages.request import RequestState, Responder

log = logging.getLogger("aiserve_trio.security")
OPEN_PATHS = frozenset({"/healthz", "/readyz"})
TOKEN_SUFFIX = "/stream-token"
#: At most this many key verifications (scrypt, ~0.1 s each) run at once.
_VERIFY_LIMIT = 2


class StreamToken(msgspec.Struct, kw_only=True):
    token: str
    session_id: str
    expires_in: int


class Gate:
    """Admission, authentication and rate limits for one app."""

    def __init__(self, config: Config) -> None:
        lim = config.limits
        self.admission = Admission(lim.max_inflight, lim.max_streams)
        auth = config.auth
        self.enabled = auth is not None and auth.enabled
        self.metrics_open = auth is None or auth.metrics == "open"
        self.default_tenant = config.server.default_tenant
        entries = []
        for k in auth.keys if auth is not None else []:
            p = Principal(
                key_id=k.id,
                tenant=k.tenant,
                routes=frozenset(k.routes),
                channels=frozenset(k.channels),
                admin=k.admin,
                rpm=k.rpm,
                tpm=k.tpm,
            )
            entries.append(KeyEntry(p, k.hash))
        self.keys = KeyStore(entries)
        self._tenant_of = {e.principal.key_id: e.principal.tenant for e in entries}
        self._principals = {e.principal.key_id: e.principal for e in entries}
        secret = secret_from_env(auth.token_secret_env) if auth is not None else None
        self.shared_secret = secret is not None
        ttl = auth.stream_token_ttl_s if auth is not None else 300
        self.tokens = StreamTokens(secret or secrets.token_bytes(32), ttl)
        self.limiter: Limiter
        if auth is not None and auth.ratelimit_backend == "redis":
            self.limiter = RedisLimiter(config.sessions.url, config.sessions.key_prefix)
        else:
            self.limiter = MemoryLimiter()
        self._verify = trio.CapacityLimiter(_VERIFY_LIMIT)

    async def aopen(self) -> None:
        if isinstance(self.limiter, RedisLimiter):
            await self.limiter.aopen()
        self.announce()

    async def aclose(self) -> None:
        if isinstance(self.limiter, RedisLimiter):
            await self.limiter.aclose()

    def announce(self) -> None:
        """Log, loudly when it is off, how access control is set up."""
        if not self.enabled:
            log.warning(
                "\n%s\n!!! AUTH IS OFF: any client may call every route and read every "
                "session as tenant %r.\n!!! Only for local use on 127.0.0.1; set "
                "[auth] enabled = true with [[auth.keys]] before exposing this server.\n%s",
                "!" * 78,
                self.default_tenant,
                "!" * 78,
            )
            return
        log.info("auth on: %d API keys", len(self.keys))
        if not self.shared_secret:
            log.warning("stream tokens use a per-worker secret: set the token secret env var")

    def enter(self, scope: dict[str, Any] | Any) -> bool:
        """Take an in-flight slot for an HTTP request (probes and metrics need none).

        Returns whether a slot was taken (give it back with :meth:`leave`).

        Raises:
            Overloaded: the worker is at ``limits.max_inflight``.
        """
        path = scope["path"]
        if path in OPEN_PATHS or path == "/metrics":
            return False
        adm = self.admission
        if adm.inflight >= adm.max_inflight:
            raise adm._refuse("requests in flight", adm.max_inflight)
        adm.inflight += 1
        return True

    def leave(self, taken: bool) -> None:
        if taken:
            self.admission.inflight -= 1

    async def authenticate(
        self, scope: dict[str, Any] | Any, headers: dict[str, str], *, chat: bool
    ) -> Principal | None:
        """Who the request acts as; ``None`` for an open path (or when auth is off).

        Args:
            chat: the path is a chat route (route and channel rights apply,
                and the request counts against the key's rate limit).

        Raises:
            Unauthorized: no key, a bad key, a bad or expired stream token.
            Forbidden: the key may not use this route, channel or admin path.
            RateLimited: the key is over its request or token rate.
        """
        path: str = scope["path"]
        if path in OPEN_PATHS or (path == "/metrics" and self.metrics_open):
            return None
        if not self.enabled:
            return None
        principal = await self._principal(scope, headers, path)
        if path == "/metrics" or path.startswith("/debug/"):
            principal.check_admin(path)
        if chat:
            principal.check_route(path)
        channel = headers.get("x-channel")
        if channel is not None:
            principal.check_channel(channel.strip().lower())
        if chat:
            await self.limiter.admit(principal)
        return principal

    async def _principal(
        self, scope: dict[str, Any] | Any, headers: dict[str, str], path: str
    ) -> Principal:
        auth = headers.get("authorization")
        if auth is None and path.endswith("/events") and scope["method"] == "GET":
            token = _query_token(scope.get("query_string", b""))
            if token is not None:
                sid = path.removeprefix("/v1/sessions/").removesuffix("/events")
                key_id = self.tokens.check(token, self._tenant_of, sid, time.time())
                return self._principals[key_id]
        plain = bearer(auth)
        hit = self.keys.cached(plain)
        if hit is not None:
            return hit
        async with self._verify:
            # scrypt releases the GIL: verifying in a thread keeps the loop serving.
            return await trio.to_thread.run_sync(self.keys.verify, plain)

    def tenant(self, principal: Principal | None, fallback: str) -> str:
        """The tenant a request acts for: the key's, never one the client names."""
        return principal.tenant if principal is not None else fallback

    async def stream_token(
        self, principal: Principal | None, method: str, path: str, responder: Responder
    ) -> None:
        """``POST /v1/sessions/{id}/stream-token``: a token for that session's events.

        Raises:
            MethodNotAllowed, BadRequest: not a POST, or a malformed session id.
            Forbidden: auth is off (there is nothing to sign for).
        """
        from ..errors import MethodNotAllowed
        from ..sessions.bus import check_session_id

        if method != "POST":
            raise MethodNotAllowed(f"{method} is not allowed; use POST", headers={"Allow": "POST"})
        sid = check_session_id(path.removeprefix("/v1/sessions/").removesuffix(TOKEN_SUFFIX))
        if principal is None:
            raise Forbidden("auth is off: event streams need no token", code="auth_disabled")
        token = self.tokens.issue(principal, sid)
        body = StreamToken(token=token, session_id=sid, expires_in=self.tokens.ttl_s)
        await responder.complete(200, JSON_HEADERS, encoder.encode(body))

    async def after_chat(self, principal: Principal | None, state: RequestState) -> None:
        """Charge a finished chat request's tokens to its key."""
        if principal is not None and state.usage is not None:
            used = state.usage.prompt_tokens + state.usage.completion_tokens
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                await self.limiter.charge(principal, used)


def _query_token(query: bytes) -> str | None:
    try:
        values = parse_qs(query.decode("ascii"), max_num_fields=8).get("token")
    except (UnicodeDecodeError, ValueError) as exc:
        raise Unauthorized("the query string is not valid", code="invalid_stream_token") from exc
    return values[0] if values else None


def shutdown_event(path: str) -> bytes:
    """The last bytes of a stream the server ends while shutting down (SSE, sans-IO).

    A session event stream gets ``event: close`` (the browser reconnects
    elsewhere); a chat stream gets the OpenAI error envelope and ``[DONE]``.
    """
    if path.endswith("/events"):
        return b"event: close\ndata: {}\n\n"
    err = Overloaded("the gateway is shutting down; the reply was cut", code="shutting_down")
    return b"data: %s\n\ndata: [DONE]\n\n" % error_json(err)
