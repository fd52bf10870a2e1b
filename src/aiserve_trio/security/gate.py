"""The gate every HTTP request passes: admission, authentication, authorisation, rate limits.

:class:`Gate` is built once per app from ``[auth]`` and ``[limits]`` and reads
the endpoint table's rules (``http/endpoints.py``). :meth:`Gate.authenticate`
runs first and returns the :class:`~.auth.Principal` the request acts as -- its
tenant is the only tenant the request can touch, whatever the client sends. It
costs a hash of the key (microseconds, the same for every wrong key) and takes no
slot, so a client without a valid key costs nobody a slot; its failures are
counted per address in the edge guard's penalty box. The admin, console, debug
and session endpoints are checked first against what a web page could send
(:mod:`.browser`). Then :meth:`Gate.admit` holds the admission slot the endpoint
takes (a fast 503 beyond the worker's caps, before any body is read), and
:meth:`Gate.after_chat` charges the tokens a reply used.

With ``[auth] enabled = false`` every request acts as the route's (or the
default) tenant with every right, and start-up says so loudly.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import time
from collections import ChainMap
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import msgspec
import trio

from ..core.api import encoder
from ..core.decoding import config_roots
from ..core.errors import BadRequest, ConfigError, Forbidden, Unauthorized
from ..http.endpoints import Admission as Admit
from ..http.endpoints import Auth, Endpoint, Request
from ..http.types import JSON_HEADERS, STRIKE, Scope
from ..sessions.bus import check_session_id
from ..spend.budget import Budgets, Limit, check, route_reserves
from ..spend.ledger import NO_HOLD, Hold, Ledger, LedgerMetrics, Seed
from . import roles
from .admission import Admission
from .auth import KEY_RE, KeyEntry, KeyStore, Principal, StreamTokens, bearer, secret_from_env
from .browser import BrowserGuard
from .keystore.records import is_db_key_id
from .keystore.table import KeyTable
from .oidc import Oidc, TokenRefused, looks_like_jwt
from .oidc import expiry as jwt_expiry
from .ratelimit import Limiter, MemoryLimiter, RedisLimiter

if TYPE_CHECKING:
    from ..config import Config
    from ..stages.outcome import Outcome

log = logging.getLogger("aiserve_trio.security")
#: At most this many legacy (scrypt, ~0.1 s each) key verifications run at once.
_VERIFY_LIMIT = 2
#: Endpoints a web page must not drive (checked by :class:`BrowserGuard`)...
_GUARDED = frozenset(
    {
        Auth.ADMIN,
        Auth.ADMIN_OR_CONSOLE_TOKEN,
        Auth.SESSION_READ,
        Auth.SESSION_WRITE,
        Auth.KEY_OR_STREAM_TOKEN,
    }
)
#: ...and, of them, those that with auth off answer only clients on loopback.
_ADMIN = frozenset({Auth.ADMIN, Auth.ADMIN_OR_CONSOLE_TOKEN})
#: Admin endpoints that act for every tenant: a ``global_admin`` key's (issue 51, item 5).
_EVERY_TENANT = ("/admin/config", "/debug/", "/metrics")
#: Endpoints on a tenant's sessions, and whether they change them.
_SESSIONS = {Auth.SESSION_READ: False, Auth.KEY_OR_STREAM_TOKEN: False, Auth.SESSION_WRITE: True}
#: Model endpoints, where a key may also come as ``x-api-key`` or ``api-key`` (issue 47, 6).
_KEY_HEADERS = frozenset({Auth.CHAT, Auth.KEY})
#: What a console token is signed for (a stream token names a session id there).
CONSOLE_SUBJECT = "console"


def challenge(err: Unauthorized, headers: Mapping[str, str]) -> str:
    """The ``WWW-Authenticate`` of a 401: every 401 names its scheme (RFC 9110 11.6.1),
    and a credential that was sent and refused -- a wrong key, a bad or expired token --
    is ``invalid_token`` with the refusal's code as its description (RFC 6750 3.1), so
    an OAuth client knows to sign in again rather than that it sent nothing."""
    sent = any(headers.get(name) for name in ("authorization", "x-api-key", "api-key"))
    if not sent:
        return 'Bearer realm="aiserve-trio"'
    return f'Bearer realm="aiserve-trio", error="invalid_token", error_description="{err.code}"'


class StreamToken(msgspec.Struct, kw_only=True):
    token: str
    session_id: str
    expires_in: int


class Gate:
    """Admission, authentication and rate limits for one app."""

    def __init__(
        self,
        config: Config,
        *,
        previous: Gate | None = None,
        ledger: Ledger | None = None,
        dbkeys: KeyTable | None = None,
    ) -> None:
        """Build the gate of ``config``.

        Args:
            ledger: the worker's spend ledger (default: :func:`build_ledger`'s, uncounted
                and without a seed); a successor takes ``previous``'s.
            previous: the gate of the config this one replaces (a reload): the
                worker-wide state is carried over, not rebuilt -- the admission
                counts (the new caps apply from :meth:`activate`), the rate
                limiter's windows, the stream-token secret (issued tokens stay
                valid for keys that still exist), the database keys' table.
            dbkeys: the worker's table of database keys (``security/keystore``), when
                the audit database keeps keys.
        """
        lim = config.limits
        self._limits = lim
        self.admission: Admission
        self.shared_secret: bool
        if previous is not None:
            self.admission = previous.admission
        else:
            self.admission = Admission(
                lim.max_inflight,
                lim.max_streams,
                tenant_max_streams=lim.tenant_max_streams,
                max_receiving=lim.max_receiving,
                max_per_client=lim.max_per_client,
            )
        self._address_header = lim.client_address_header.lower()
        auth = config.auth
        self.enabled = auth is not None and auth.enabled
        self.metrics_open = auth is None or auth.metrics == "open"
        #: ``Authorization`` that opens ``GET /metrics`` and nothing else (the scrape token).
        self.metrics_bearer: bytes | None = None
        if auth is not None and auth.metrics_token_env:
            token = os.environ.get(auth.metrics_token_env, "")
            if len(token.encode()) < 16:
                raise ConfigError(
                    f"[auth] metrics_token_env: ${auth.metrics_token_env} must hold a token "
                    "of at least 16 bytes"
                )
            self.metrics_bearer = f"Bearer {token}".encode()
        self.default_tenant = config.server.default_tenant
        entries = []
        for k in auth.keys if auth is not None else []:
            p = Principal(
                key_id=k.id,
                tenant=k.tenant,
                routes=frozenset(k.routes),
                channels=frozenset(k.channels),
                admin=k.admin or k.global_admin,
                global_admin=k.global_admin,
                rpm=k.rpm,
                tpm=k.tpm,
                sessions=k.sessions,
                team=k.team,
                roles=frozenset(k.roles),
                mcp_tools=tuple(k.mcp_tools),
            )
            entries.append(KeyEntry(p, k.hash))
        self.keys = KeyStore(entries)
        self._channels = config.server.channels
        cors = config.cors
        origins = frozenset(cors.allow_origins if cors is not None else ()) - {"*"}
        self.browser = BrowserGuard(self.enabled, origins, frozenset(config.server.allowed_hosts))
        #: The worker's database keys (issue 47), checked beside the config's.
        self.dbkeys: KeyTable | None = previous.dbkeys if previous is not None else dbkeys
        tenant_of = {e.principal.key_id: e.principal.tenant for e in entries}
        principals = {e.principal.key_id: e.principal for e in entries}
        self._tenant_of: Mapping[str, str] = tenant_of
        self._principals: Mapping[str, Principal] = principals
        if self.dbkeys is not None:  # tokens of database keys too (the table's live dicts)
            self._tenant_of = ChainMap(tenant_of, self.dbkeys.tenant_of)
            self._principals = ChainMap(principals, self.dbkeys.principals)
        ttl = auth.stream_token_ttl_s if auth is not None else 300
        self.limiter: Limiter
        if previous is not None:
            self.shared_secret = previous.shared_secret
            self._secret: bytes = previous._secret
            self.limiter = previous.limiter
            self._verify: trio.CapacityLimiter = previous._verify
        else:
            secret = secret_from_env(auth.token_secret_env) if auth is not None else None
            self.shared_secret = secret is not None
            self._secret = secret or secrets.token_bytes(32)
            if auth is not None and auth.ratelimit_backend == "redis":
                self.limiter = RedisLimiter(config.sessions.url, config.sessions.key_prefix)
            else:
                self.limiter = MemoryLimiter()
            self._verify = trio.CapacityLimiter(_VERIFY_LIMIT)
        #: Spend budgets per key and tenant; the ledger (the spend) is worker-wide.
        self.budgets = Budgets.of(config)
        self.currency = config.pricing.currency
        #: What a request of each route (by path) holds against its budgets.
        self.reserves = route_reserves(config) if self.budgets or self.dbkeys is not None else {}
        self.ledger: Ledger = (
            previous.ledger
            if previous is not None
            else ledger
            if ledger is not None
            else build_ledger(config)
        )
        if self.dbkeys is not None:
            # Database keys' budgets are seeded at start and read back from the audit log
            # as the config's are (a restart, or another worker, forgets none).
            self.ledger.seed_also(self.dbkeys.budgets)
        self.tokens = StreamTokens(self._secret, ttl)
        console_ttl = auth.console_token_ttl_s if auth is not None else 900
        self.console_tokens = StreamTokens(self._secret, console_ttl, purpose="console")
        #: Console tokens logged out before their expiry (worker-wide, like the secret).
        self.revoked: Revoked = previous.revoked if previous is not None else Revoked.of(config)
        #: Single sign-on's issuers and their cached keys (worker-wide, like the secret).
        self.oidc: Oidc = previous.oidc if previous is not None else Oidc()
        roots = config_roots(config.source, config.base_dir, config.server.config_paths)
        issuers = auth.oidc if auth is not None else ()
        #: This config's issuers: in use from the start, or from :meth:`activate` (a reload).
        self._issuers = self.oidc.prepare(issuers, config.base_dir, roots)
        if previous is None:
            self.oidc.use(self._issuers)

    def successor(self, config: Config) -> Gate:
        """The gate of a reloaded ``config``, carrying this one's worker-wide state."""
        return Gate(config, previous=self)

    def activate(self) -> None:
        """Apply this gate's admission caps and issuers (when its config becomes the
        current one)."""
        self.oidc.use(self._issuers)
        lim = self._limits
        self.admission.configure(
            lim.max_inflight,
            lim.max_streams,
            tenant_max_streams=lim.tenant_max_streams,
            max_receiving=lim.max_receiving,
            max_per_client=lim.max_per_client,
        )

    async def aopen(self) -> None:
        if isinstance(self.limiter, RedisLimiter):
            await self.limiter.aopen()
        await self.ledger.aopen()
        await self.revoked.aopen()
        self.announce()

    async def aclose(self) -> None:
        await self.revoked.aclose()
        await self.ledger.aclose()
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
        for jwks in self.oidc.issuers.values():
            log.info("auth: single sign-on with the JWTs of %s", jwks.settings.issuer)
        for key_id in self.keys.legacy:
            log.warning(
                "key %r has a legacy scrypt hash (~0.1 s per check): give it a new "
                "one with `aiserve-keys`, or see the log line after its first use",
                key_id,
            )
        if not self.shared_secret:
            log.warning("stream tokens use a per-worker secret: set the token secret env var")

    def admit(
        self, endpoint: Endpoint, scope: Scope, headers: dict[str, str]
    ) -> contextlib.AbstractContextManager[None]:
        """Hold the slots ``endpoint`` takes for the block (probes take none):
        an in-flight slot and one of the client address's.

        Raises (entering the block):
            Overloaded: the worker is at ``limits.max_inflight``.
            RateLimited: the client address is at ``limits.max_per_client``.
        """
        if endpoint.admission is Admit.NONE:
            return contextlib.nullcontext()
        adm = self.admission
        return adm.request(self.client_address(scope, headers) if adm.max_per_client else None)

    def client_address(self, scope: Scope, headers: dict[str, str]) -> str | None:
        """Who the request comes from: the trusted proxy's header, or the connection's
        peer (also when the header is missing: a request that did not come through the
        proxy is counted under its own address, not let through uncounted)."""
        if self._address_header:
            value = headers.get(self._address_header)
            forwarded = value.rsplit(",", 1)[-1].strip() if value else ""
            if forwarded:
                return forwarded
        client = scope.get("client")
        return str(client[0]) if client else None

    def stream_slot(
        self, endpoint: Endpoint, principal: Principal | None
    ) -> contextlib.AbstractContextManager[None]:
        """Hold an open-stream slot for endpoints that are streams by nature (session
        events), counted against the tenant's ``limits.tenant_max_streams`` like a chat's.

        Raises:
            Overloaded: the worker is at ``limits.max_streams``.
            RateLimited: the tenant holds ``limits.tenant_max_streams`` streams.
        """
        if endpoint.admission is Admit.STREAM:
            tenant = self.tenant(principal, self.default_tenant)
            key = (principal.key_id, principal.max_streams) if principal else None
            return self.admission.stream(tenant, key if key and key[1] else None)
        return contextlib.nullcontext()

    async def authenticate(self, endpoint: Endpoint, request: Request) -> Principal | None:
        """Who the request acts as; ``None`` for an open endpoint (or when auth is off).

        Call it before :meth:`admit`: it takes no slot. On a chat route, a request
        without ``X-Channel`` from a key limited to one channel acts on that channel
        (the header is set to it for the stages after); limited to several, it must say.

        Raises:
            Unauthorized: no key, a bad key, a bad or expired stream token.
            Forbidden: the key may not use this route, channel, session or admin
                endpoint; or (admin, console, debug, session endpoints) a web page
                may have sent the request (:class:`BrowserGuard`).
            UnsupportedMediaType: a body on those endpoints that is not JSON or TOML.
            BadRequest: no ``X-Channel`` from a key limited to several channels.
            RateLimited: the key is over its request or token rate (chat routes,
                session writes).
        """
        need = endpoint.auth
        if need in _GUARDED:
            client = request.scope.get("client")
            peer = str(client[0]) if client else None
            self.browser.check(request.method, request.headers, peer, admin=need in _ADMIN)
        if need is Auth.OPEN or (need is Auth.METRICS and self.metrics_open):
            return None
        if need is Auth.METRICS and self.metrics_bearer is not None:
            sent = request.headers.get("authorization", "").encode()
            if hmac.compare_digest(sent, self.metrics_bearer):
                return None
        if not self.enabled:
            return None
        try:
            principal = await self._principal(endpoint, request)
        except Unauthorized as err:
            self._failed(request.scope, err)
            err.headers.setdefault("WWW-Authenticate", challenge(err, request.headers))
            raise
        if need in (Auth.ADMIN, Auth.METRICS, Auth.ADMIN_OR_CONSOLE_TOKEN):
            # What each role may do is security/roles.py's (issue 47, item 4).
            roles.check(principal, roles.action_for(request.method, request.path), request.path)
        if need in (Auth.ADMIN, Auth.METRICS) and request.path.startswith(_EVERY_TENANT):
            principal.check_global_admin(request.path)
        if need in _SESSIONS:
            principal.check_sessions(write=_SESSIONS[need])
        channel = request.headers.get("x-channel")
        if channel is not None:
            principal.check_channel(channel.strip().lower())
        if need is Auth.CHAT:
            roles.check(principal, roles.Action.MODEL_CALL, request.path)
            principal.check_route(endpoint.route or endpoint.path)
            only = principal.channel(channel, self._channels)
            if only is not None:
                request.headers["x-channel"] = only
            await self.limiter.admit(principal)
        elif need is Auth.SESSION_WRITE:
            # A write may create a session: it is a request of the key's rate, as a chat
            # is (issue 55: 10,050 PUT /vars in 32 s were free and filled the sessions).
            await self.limiter.admit(principal)
        return principal

    @staticmethod
    def _failed(scope: Scope, err: Unauthorized) -> None:
        """Count a failed authentication against the connection's address; once it is in
        the penalty box, an HTTP/1 connection is closed after the answer."""
        client = scope.get("client")
        # The worker's penalty box: the server puts it in the scope (the seam does).
        count: Callable[[str], float] | None = (scope.get("extensions") or {}).get(STRIKE)
        refused = count(str(client[0])) if client and count is not None else 0.0
        if refused > 0 and scope.get("http_version", "") < "2":
            err.headers["Connection"] = "close"

    async def _principal(self, endpoint: Endpoint, request: Request) -> Principal:
        auth = request.headers.get("authorization")
        if auth is None and endpoint.auth is Auth.KEY_OR_STREAM_TOKEN:
            token = _query_token(request.scope.get("query_string", b""))
            if token is not None:
                sid = request.params.get("id", "")
                key_id = self.tokens.check(token, self._tenant_of, sid, time.time())
                return self._principals[key_id]
        if auth is None and endpoint.auth in _KEY_HEADERS:
            # Anthropic's clients send the key as x-api-key, Azure OpenAI's as api-key.
            api_key = request.headers.get("x-api-key") or request.headers.get("api-key")
            if api_key is not None:
                auth = f"Bearer {api_key}"
        plain = bearer(auth)
        if self.oidc and looks_like_jwt(plain):
            return await self._signed_on(endpoint, plain)
        if endpoint.auth is Auth.ADMIN_OR_CONSOLE_TOKEN and not plain.startswith("aik_"):
            subject = CONSOLE_SUBJECT
            key_id = self.console_tokens.check(plain, self._tenant_of, subject, time.time())
            if await self.revoked.denied(plain, key_id, int(plain.partition(".")[0])):
                raise Unauthorized(
                    "the console token was logged out: log in again",
                    code="revoked_console_token",
                )
            return self._principals[key_id]
        hit = self.check_key(plain)
        if hit is not None:
            return hit
        async with self._verify:
            # A legacy scrypt hash, until its first success: scrypt releases the GIL,
            # so verifying in a thread keeps the loop serving.
            ok = await trio.to_thread.run_sync(self.keys.verify_legacy, plain)
        return self.keys.migrate(plain, ok)

    def check_key(self, plain: str) -> Principal | None:
        """The principal of API key ``plain`` (None: a legacy scrypt hash to verify).

        Raises:
            Unauthorized: malformed, unknown, wrong, expired or revoked.
        """
        if self.dbkeys is not None and (m := KEY_RE.match(plain)) and is_db_key_id(m["id"]):
            # A database key (``vk...``, an id no config key may take): the same hash and
            # constant-time compare, against the worker's table, never the database.
            digest = hashlib.sha256(plain.encode("utf-8", "surrogatepass")).digest()
            return self.dbkeys.check(m["id"], digest, time.time())
        return self.keys.check(plain)

    async def _signed_on(self, endpoint: Endpoint, token: str) -> Principal:
        """The principal of an issuer's JWT (``[[auth.oidc]]``, security/oidc.py); on the
        console's API, unless it was logged out there."""
        try:
            principal = await self.oidc.principal(token, time.time())
        except TokenRefused as exc:
            raise Unauthorized(str(exc), code=exc.code) from None
        if endpoint.auth is Auth.ADMIN_OR_CONSOLE_TOKEN and await self.revoked.denied(
            token, principal.key_id, jwt_expiry(token)
        ):
            raise Unauthorized(
                "the token was logged out of the console: sign in again",
                code="revoked_console_token",
            )
        return principal

    def derived_key(self, purpose: str) -> bytes:
        """A key for signing what only this gateway's workers issue (``purpose`` keeps
        one use's signatures from checking for another): from the secret the console
        and stream tokens use, shared by the workers when ``token_secret_env`` is set."""
        return hmac.new(self._secret, f"aiserve-trio {purpose}".encode(), "sha256").digest()

    def signed_on(self, request: Request) -> tuple[str, int] | None:
        """The issuer's JWT ``request`` was authenticated with, and the seconds it has
        left; None for a key. The console keeps it as its token (every worker checks it)."""
        plain = bearer(request.headers.get("authorization"))
        if not (self.oidc and looks_like_jwt(plain)):
            return None
        return plain, max(0, jwt_expiry(plain) - int(time.time()))

    def tenant(self, principal: Principal | None, fallback: str) -> str:
        """The tenant a request acts for: the key's, never one the client names."""
        return principal.tenant if principal is not None else fallback

    async def stream_token(self, request: Request) -> None:
        """``POST /v1/sessions/{id}/stream-token``: a token for that session's events.

        Raises:
            BadRequest: a malformed session id.
            Forbidden: auth is off (there is nothing to sign for).
        """
        sid = check_session_id(request.params["id"])
        principal = request.principal
        if principal is None:
            raise Forbidden("auth is off: event streams need no token", code="auth_disabled")
        token = self.tokens.issue(principal, sid)
        body = StreamToken(token=token, session_id=sid, expires_in=self.tokens.ttl_s)
        await request.responder.complete(200, JSON_HEADERS, encoder.encode(body))

    def console_token(self, principal: Principal) -> str:
        """A console token for an admin key: ``Authorization: Bearer`` on the console's API."""
        return self.console_tokens.issue(principal, CONSOLE_SUBJECT)

    async def console_logout(self, request: Request) -> tuple[int, bool]:
        """Deny the console token ``request`` was authenticated with until its expiry.

        Returns:
            The token's expiry, and whether every worker refuses it now (see
            :class:`Revoked`).

        Raises:
            BadRequest: the request came with an admin key, not a console token.
        """
        plain = bearer(request.headers.get("authorization"))
        principal = request.principal
        if plain.startswith("aik_") or principal is None or principal.key_id is None:
            raise BadRequest(
                "log out sends the console token (Authorization: Bearer <token>), not a key",
                code="not_a_console_token",
            )
        if self.oidc and looks_like_jwt(plain):
            expiry = jwt_expiry(plain)
        else:
            expiry = int(plain.partition(".")[0])
        return expiry, await self.revoked.add(plain, principal.key_id, expiry, time.time())

    async def within_budget(
        self,
        principal: Principal | None,
        tenant: str,
        path: str = "",
        body_bytes: int | None = None,
    ) -> Hold:
        """Refuse a chat request whose key's or tenant's budget is spent or held by the
        requests in flight; else hold its maximum cost against them (``spend/budget.py``)
        until the returned hold is let go, after its real cost is charged.

        Args:
            tenant: the tenant the request acts for (with auth off, its route's).
            path: the route's path (what its requests hold); body_bytes: the body's
                declared length (None: not declared).

        Raises:
            BudgetExceeded: naming the budget and when it resets (``Retry-After``).
        """
        limits = self._limits_of(principal.key_id if principal else None, tenant)
        if not limits:
            return NO_HOLD
        now = time.time()
        spent = await self.ledger.spent(limits, now)
        # No checkpoint from here to the hold: two requests never both take the rest.
        check(limits, spent, now, self.currency, self.ledger.held(limits, now))
        reserve = self.reserves.get(path)
        return self.ledger.hold(limits, reserve.amount(body_bytes) if reserve else 0.0, now)

    def _limits_of(self, key_id: str | None, tenant: str) -> list[Limit]:
        """The budgets a request counts against: the config's (the key's and the
        tenant's) and a database key's own (``security/keystore``)."""
        limits = self.budgets.limits(key_id, tenant) if self.budgets else []
        if self.dbkeys is not None and key_id is not None:
            own = self.dbkeys.budget(key_id)
            if own is not None:
                limits = [own, *limits]
        return limits

    async def after_chat(self, principal: Principal | None, outcome: Outcome) -> None:
        """Charge a finished chat request's tokens to its key, and its cost to its budgets."""
        # A key without a token rate has nothing to charge: no shielded scope for it.
        if principal is not None and principal.tpm and outcome.usage is not None:
            used = outcome.usage.prompt_tokens + outcome.usage.completion_tokens
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                await self.limiter.charge(principal, used)
        if outcome.cost > 0 and (self.budgets or self.dbkeys is not None):
            limits = self._limits_of(outcome.key_id, outcome.tenant)
            if limits:
                with trio.CancelScope(shield=True), trio.move_on_after(2.0):
                    await self.ledger.charge(limits, outcome.cost, time.time())


#: Console tokens logged out, kept per worker at most (each for at most the token's TTL).
MAX_REVOKED = 4096
#: Seconds a Redis call may take before the deny-list goes on without it.
REVOKED_REDIS_TIMEOUT_S = 0.5


def token_digest(token: str) -> str:
    """What is kept of a token: never the token itself."""
    return hashlib.sha256(token.encode()).hexdigest()


class Revoked:
    """Console tokens logged out before they expire: ``POST /admin/api/logout``.

    A console token is stateless (an HMAC of its key, purpose and expiry, ``security/auth.py``:
    any worker with the secret accepts it), so "Log out" used to clear the tab only and the
    token stayed good for its 900 s (issue 55, item 2). :class:`Revoked` denies a logged-out
    token until its expiry, checked by the gate after the token's signature:

    - in this worker, a dict of the token's SHA-256 -> its expiry, at most
      :data:`MAX_REVOKED` entries, each dropped at the first logout after its token has
      expired (past its expiry it is refused as expired anyway). Full of live entries, a
      logout denies
      instead every console token of that key expiring no later than the one logged out
      (one entry per key: the key's other tabs log out too -- never a token left valid);
    - with a Redis session bus (``[sessions] backend = "redis"``), also in that Redis
      (``{key_prefix}:console:revoked:{sha256}``, expiring with the token), so that every
      worker and host refuses it: each console-token request asks Redis (one ``EXISTS``,
      the page's 3 s polling). Redis away: the worker that took the logout refuses the
      token, the others do not learn of it until Redis answers (the logout says
      ``"shared": false``) -- a Redis outage does not lock operators out of the console.

    Without Redis, several workers each keep their own list: a logout reaches the worker
    that answered it, so set ``[sessions] backend = "redis"`` when console tokens must be
    revocable across workers (with one worker, the list is enough).
    """

    def __init__(
        self, redis_url: str | None = None, prefix: str = "aiserve", *,
        max_entries: int = MAX_REVOKED,
    ) -> None:  # fmt: skip
        self._client: Any = None
        if redis_url is not None:
            from ..util.redisconn import client_for_url  # late: coredis is optional

            # A pool of at least a Redis Cluster's node count: coredis warns below it.
            self._client = client_for_url(redis_url, 8, REVOKED_REDIS_TIMEOUT_S)
        self._prefix = prefix
        self._stack: AsyncExitStack | None = None
        self.max_entries = max_entries
        #: Token digest -> its expiry (Unix seconds).
        self._tokens: dict[str, int] = {}
        #: Key id -> every console token of it expiring at or before this is denied
        #: (a full list's fallback: bounded by the number of keys).
        self._until: dict[str, int] = {}

    @classmethod
    def of(cls, config: Config) -> Revoked:
        sc = config.sessions
        if sc.backend == "redis":
            return cls(sc.url, sc.key_prefix)
        return cls()

    @property
    def shared(self) -> bool:
        return self._client is not None

    def __len__(self) -> int:
        return len(self._tokens)

    async def aopen(self) -> None:
        if self._client is not None:
            stack = AsyncExitStack()
            await stack.enter_async_context(self._client)
            self._stack = stack

    async def aclose(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    def _key(self, token_digest: str) -> str:
        return f"{self._prefix}:console:revoked:{token_digest}"

    def _drop_expired(self, now: float) -> None:
        for d in [d for d, expiry in self._tokens.items() if expiry < now]:
            del self._tokens[d]
        for k in [k for k, until in self._until.items() if until < now]:
            del self._until[k]

    async def add(self, token: str, key_id: str, expiry: int, now: float) -> bool:
        """Deny ``token`` (of ``key_id``, valid until ``expiry``) from now on.

        Returns:
            Whether every worker will refuse it (it reached Redis); False without Redis
            or when Redis did not answer (this worker refuses it all the same).
        """
        d = token_digest(token)
        self._drop_expired(now)  # at most max_entries: a logout is an operator's click
        if d in self._tokens or len(self._tokens) < self.max_entries:
            self._tokens[d] = expiry
        else:
            self._until[key_id] = max(self._until.get(key_id, 0), expiry)
            log.warning(
                "console: %d logged-out tokens held; every console token of %r issued "
                "until now is denied", len(self._tokens), key_id,
            )  # fmt: skip
        if self._client is None:
            return False
        done = await self._redis(lambda: self._client.set(self._key(d), key_id, exat=expiry + 1))
        return bool(done)

    async def denied(self, token: str, key_id: str, expiry: int) -> bool:
        """Whether ``token`` (checked already: signed, not expired) was logged out."""
        if expiry <= self._until.get(key_id, -1):
            return True
        d = token_digest(token)
        if d in self._tokens:
            return True
        if self._client is None:
            return False
        found = await self._redis(lambda: self._client.exists([self._key(d)]))
        if found and len(self._tokens) < self.max_entries:
            self._tokens[d] = expiry  # the next request need not ask Redis
        return bool(found)

    async def _redis(self, call: Any) -> Any:
        """``call()``, or None when Redis fails or is slower than the timeout."""
        from coredis.exceptions import RedisError  # late: coredis only with Redis

        try:
            with trio.move_on_after(REVOKED_REDIS_TIMEOUT_S):
                return await call()
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("console: the logged-out tokens' Redis cannot be reached: %s", exc)
        return None


def build_ledger(
    config: Config, metrics: LedgerMetrics | None = None, seed: Seed | None = None
) -> Ledger:
    """The spend ledger: in the session bus's Redis when there is one and a budget
    to keep (the config's, or database keys' that may have one), else in this worker (a
    budget added by a reload is then kept per worker).

    Args:
        metrics: its gauges and counters.
        seed: where a lost (Redis) or forgotten (restart) period's spend is read from
            (the audit log); the budgets it seeds are the config's.
    """
    sc = config.sessions
    budgets = Budgets.of(config)
    limits = [*budgets.keys.values(), *budgets.tenants.values()] if seed is not None else None
    # Database keys (auth on, an audit database) may carry budgets of their own.
    auth, audit = config.auth, config.audit
    dbkeys = auth is not None and auth.enabled and audit is not None and audit.backend != "off"
    if sc.backend == "redis" and (budgets or dbkeys):
        return Ledger(sc.url, sc.key_prefix, metrics=metrics, seed=seed, limits=limits)
    return Ledger(metrics=metrics, seed=seed, limits=limits)


def _query_token(query: bytes) -> str | None:
    try:
        values = parse_qs(query.decode("ascii"), max_num_fields=8).get("token")
    except (UnicodeDecodeError, ValueError) as exc:
        raise Unauthorized("the query string is not valid", code="invalid_stream_token") from exc
    return values[0] if values else None
