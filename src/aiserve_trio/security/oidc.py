"""Single sign-on: JWTs of an OIDC issuer as ``Authorization: Bearer`` (issue 47, item 3).

Two halves:

- a pure core -- :func:`peek` reads a token's header and issuer without trusting them,
  :func:`verify` checks it against an issuer's :class:`KeySet` at a given ``now``
  (signature through PyJWT, ``iss``, ``aud``, ``exp`` and ``nbf`` with the issuer's clock
  skew) and :func:`principal_of` maps its claims to a :class:`~.auth.Principal`; each
  refusal is a :class:`TokenRefused` whose ``code`` says why (the gate answers it as a 401
  in the OpenAI error envelope);
- :class:`Jwks`, one issuer's keys: from a file, or fetched from its URL (or the
  ``jwks_uri`` of its discovery document) and cached. :class:`Oidc` holds them for the
  worker (a reload keeps them) and refreshes them in the background every
  ``refresh_s``; a token naming a key id the cache does not hold fetches them again
  at most once per ``min_refresh_s`` -- one fetch, however many requests wait on it.
  A fetch that fails keeps the keys already held: the issuer down, tokens signed with
  known keys keep working.

A fetch is a few KB read with a deadline; its parse (at most :data:`MAX_KEYS` keys, at
most :data:`MAX_JWKS_BYTES`) costs well under a millisecond, so no fetch holds the loop.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import math
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import httpx2
import jwt
import msgspec
import trio

from ..core.decoding import confined, outside
from ..core.errors import ConfigError
from .auth import Principal
from .settings import OidcIssuer

log = logging.getLogger("aiserve_trio.security")
#: A JWKS or discovery document larger than this is refused (real ones are a few KB).
MAX_JWKS_BYTES = 256 * 1024
#: Keys read from one JWKS at most.
MAX_KEYS = 64
#: A token longer than this is refused before it is decoded.
MAX_TOKEN_BYTES = 16 * 1024
#: The subject kept in a principal's id at most (characters).
MAX_SUBJECT = 128
#: Tokens remembered as verified, per worker (the oldest forgotten first).
MAX_VERIFIED = 4096


#: Issuers' settings with the keys of their ``jwks_file`` (read at load), not yet in use.
Prepared = list[tuple[OidcIssuer, "KeySet | None"]]


class TokenRefused(Exception):
    """A token that is not accepted; ``code`` says why (the gate's 401 carries it)."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.code = code


def looks_like_jwt(credential: str) -> bool:
    """Whether ``credential`` is a compact JWS (``eyJ...``: a JSON header), not a key
    (``aik_...``) or a console token (``<expiry>.<key id>.<mac>``)."""
    return credential.startswith("eyJ") and credential.count(".") == 2


# --- the pure core -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Peeked:
    """What a token says of itself, before anything is checked."""

    alg: str
    kid: str | None
    issuer: str


def peek(token: str) -> Peeked:
    """The header's ``alg`` and ``kid`` and the payload's ``iss``, unverified.

    Raises:
        TokenRefused: not a JWT (``invalid_token``); or ``alg: none``
            (``token_alg_none``).
    """
    if len(token) > MAX_TOKEN_BYTES:
        raise TokenRefused("the token is too long", code="invalid_token")
    # Read here, not with PyJWT's unverified decode: a third of a token's cost went there.
    parts = token.split(".")
    if len(parts) != 3:
        raise TokenRefused("the token is not a valid JWT", code="invalid_token")
    header, claims = _part(parts[0]), _part(parts[1])
    alg, kid, iss = header.get("alg"), header.get("kid"), claims.get("iss")
    if not isinstance(alg, str) or alg.lower() == "none":
        raise TokenRefused("the token is not signed (alg: none)", code="token_alg_none")
    if kid is not None and not isinstance(kid, str):
        raise TokenRefused("the token's `kid` is not a string", code="invalid_token")
    if not isinstance(iss, str):
        raise TokenRefused("the token names no issuer (`iss`)", code="token_wrong_issuer")
    return Peeked(alg, kid, iss)


def _part(segment: str) -> dict[str, Any]:
    try:
        out = msgspec.json.decode(base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4)))
    except (ValueError, msgspec.DecodeError):
        out = None
    if not isinstance(out, dict):
        raise TokenRefused("the token is not a valid JWT", code="invalid_token")
    return out


@dataclass(frozen=True, slots=True)
class Key:
    """A public key, and the algorithm its JWK restricts it to (None: any of its type)."""

    jwk: jwt.PyJWK
    alg: str | None

    def fits(self, alg: str) -> bool:
        """Whether a token signed with ``alg`` may be checked with this key."""
        kty = {"RS": "RSA", "PS": "RSA", "ES": "EC", "Ed": "OKP"}.get(alg[:2])
        return self.jwk.key_type == kty and self.alg in (None, alg)


@dataclass(frozen=True, slots=True)
class KeySet:
    """An issuer's public keys: by key id, and those without one."""

    by_kid: Mapping[str, Key] = field(default_factory=dict)
    anonymous: tuple[Key, ...] = ()

    def __len__(self) -> int:
        return len(self.by_kid) + len(self.anonymous)

    def find(self, kid: str | None, alg: str) -> Key | None:
        """The key ``kid`` names; a token without ``kid``: the one key that fits ``alg``."""
        if kid is not None:
            return self.by_kid.get(kid)
        fits = [k for k in (*self.by_kid.values(), *self.anonymous) if k.fits(alg)]
        return fits[0] if len(fits) == 1 else None


def parse_jwks(data: bytes) -> KeySet:
    """The signing keys of a JWKS document (keys of other uses or types are skipped).

    Raises:
        ValueError: not a JWKS, too large, or without a usable key.
    """
    if len(data) > MAX_JWKS_BYTES:
        raise ValueError(f"the JWKS is larger than {MAX_JWKS_BYTES} bytes")
    try:
        doc = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise ValueError(f"the JWKS is not JSON: {exc}") from None
    entries = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise ValueError("the JWKS has no `keys` list")
    by_kid: dict[str, Key] = {}
    anonymous: list[Key] = []
    for entry in entries[:MAX_KEYS]:
        if not isinstance(entry, dict) or entry.get("use", "sig") != "sig":
            continue
        if "d" in entry or entry.get("kty") == "oct":
            continue  # a private or symmetric key has no place in a JWKS: never used
        try:
            jwk = jwt.PyJWK(entry)
        except jwt.PyJWTError:
            continue  # a key type or curve this gateway does not verify with
        alg, kid = entry.get("alg"), entry.get("kid")
        key = Key(jwk, alg if isinstance(alg, str) else None)
        if isinstance(kid, str):
            by_kid[kid] = key
        else:
            anonymous.append(key)
    if not by_kid and not anonymous:
        raise ValueError("the JWKS holds no usable signing key")
    return KeySet(by_kid, tuple(anonymous))


@dataclass(frozen=True, slots=True)
class Rules:
    """What a token of one issuer must satisfy."""

    issuer: str
    audiences: frozenset[str]
    algorithms: frozenset[str]
    skew_s: float

    @classmethod
    def of(cls, settings: OidcIssuer) -> Rules:
        return cls(
            settings.issuer,
            frozenset(settings.audience),
            frozenset(settings.algorithms),
            settings.clock_skew_s,
        )


def verify(token: str, rules: Rules, keys: KeySet, now: float) -> dict[str, Any]:
    """The claims of ``token`` once it passes ``rules`` with ``keys`` at ``now``.

    Raises:
        TokenRefused: with ``code`` ``invalid_token`` (not a JWT), ``token_alg_none``,
            ``token_alg_not_allowed``, ``token_unknown_kid``, ``token_bad_signature``,
            ``token_wrong_issuer``, ``token_wrong_audience``, ``token_expired`` or
            ``token_not_yet_valid``.
    """
    seen = peek(token)
    if seen.alg not in rules.algorithms:
        raise TokenRefused(
            f"the token's algorithm {seen.alg[:20]!r} is not one this issuer may use "
            f"({', '.join(sorted(rules.algorithms))})",
            code="token_alg_not_allowed",
        )
    key = keys.find(seen.kid, seen.alg)
    if key is None:
        raise TokenRefused(
            f"the token's signing key {str(seen.kid)[:100]!r} is not among the issuer's keys",
            code="token_unknown_kid",
        )
    if not key.fits(seen.alg):
        # A key is used with its own type's (and its JWK's `alg`'s) algorithms only.
        raise TokenRefused(
            f"the token's algorithm {seen.alg!r} does not match its key",
            code="token_bad_signature",
        )
    try:
        claims: dict[str, Any] = jwt.decode(
            token,
            key.jwk.key,
            algorithms=[seen.alg],
            audience=sorted(rules.audiences),
            issuer=rules.issuer,
            options={
                # exp, nbf and iat are checked below, at the caller's `now`.
                "verify_exp": False,
                "verify_nbf": False,
                "verify_iat": False,
                "require": ["exp", "iss", "aud"],
            },
        )
    except jwt.InvalidSignatureError:
        raise TokenRefused(
            "the token's signature is not valid", code="token_bad_signature"
        ) from None
    except jwt.InvalidIssuerError:
        raise TokenRefused(
            "the token's issuer (`iss`) is not this issuer", code="token_wrong_issuer"
        ) from None
    except jwt.InvalidAudienceError:
        raise TokenRefused(
            f"the token is not for this gateway: its audience (`aud`) is not one of "
            f"{', '.join(sorted(rules.audiences))}",
            code="token_wrong_audience",
        ) from None
    except jwt.MissingRequiredClaimError as exc:
        raise TokenRefused(f"the token has no `{exc.claim}` claim", code="invalid_token") from None
    except (jwt.PyJWTError, ValueError, TypeError) as exc:
        raise TokenRefused(f"the token is not valid: {exc}", code="invalid_token") from None
    exp, nbf = claims.get("exp"), claims.get("nbf")
    if not _number(exp) or (nbf is not None and not _number(nbf)):
        raise TokenRefused("the token's `exp` or `nbf` is not a number", code="invalid_token")
    check_times(exp, nbf, rules.skew_s, now)
    return claims


def check_times(exp: float, nbf: float | None, skew_s: float, now: float) -> None:
    """Raises TokenRefused unless ``now`` is within ``nbf``..``exp``, give or take ``skew_s``."""
    if now > exp + skew_s:
        raise TokenRefused(f"the token expired {int(now - exp)} s ago", code="token_expired")
    if nbf is not None and now < nbf - skew_s:
        raise TokenRefused(
            f"the token is not valid for another {math.ceil(nbf - now)} s",
            code="token_not_yet_valid",
        )


def _number(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def claim(claims: Mapping[str, Any], path: str) -> Any:
    """The claim at ``path`` (``realm_access.roles`` reaches inside objects); None if absent."""
    value: Any = claims
    for part in path.split(".") if path else ():
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return value.split() if " " in value else [value]  # `scope` is space-separated
    if isinstance(value, list):
        return [v for v in value if isinstance(v, str)]
    return []


def principal_of(claims: Mapping[str, Any], settings: OidcIssuer) -> Principal:
    """The principal a verified token's claims make under ``settings``' mapping.

    Its id is ``<issuer name>:<subject>`` (never a key's id: a key id has no ``:``);
    its routes and channels are ``settings``' for a caller with the ``user`` role, none
    otherwise.

    Raises:
        TokenRefused: no subject, or no valid tenant (``token_claims``).
    """
    from ..core.tenants import check_tenant  # a leaf; late only to keep this module's head short

    subject = claim(claims, settings.subject_claim)
    if not isinstance(subject, str) or not subject:
        raise TokenRefused(
            f"the token has no `{settings.subject_claim}` claim", code="token_claims"
        )
    tenant = settings.tenant or claim(claims, settings.tenant_claim)
    try:
        check_tenant(tenant if isinstance(tenant, str) else "")
    except ValueError:
        raise TokenRefused(
            f"the token's `{settings.tenant_claim}` claim does not name a valid tenant",
            code="token_claims",
        ) from None
    team = claim(claims, settings.team_claim) if settings.team_claim else ""
    roles = set(settings.default_roles)
    for value in _strings(claim(claims, settings.roles_claim)):
        roles.update(settings.role_map.get(value, ()))
    global_admin = "global-admin" in roles
    if global_admin:
        roles.discard("global-admin")
        roles.add("admin")
    user = "user" in roles
    return Principal(
        key_id=f"{settings.name}:{subject[:MAX_SUBJECT]}",
        tenant=tenant,
        routes=frozenset(settings.routes) if user else frozenset(),
        channels=frozenset(settings.channels) if user else frozenset(),
        admin="admin" in roles,
        global_admin=global_admin,
        team=team[:64] if isinstance(team, str) else "",
        roles=frozenset(roles),
    )


# --- the keys: fetched, cached, refreshed ----------------------------------------------

#: Fetches ``url`` (at most ``limit`` bytes) within ``timeout_s``: the body, or raises OSError.
Fetch = Callable[[str, int, float], Awaitable[bytes]]


async def http_get(url: str, limit: int, timeout_s: float) -> bytes:
    """GET ``url``: its body (at most ``limit`` bytes) or OSError (not 200, too large,
    too slow, unreachable)."""
    with trio.move_on_after(timeout_s) as scope:
        try:
            client = httpx2.AsyncClient(follow_redirects=False, trust_env=False)
            accept = {"accept": "application/json"}
            async with client, client.stream("GET", url, headers=accept) as r:
                if r.status_code != 200:
                    raise OSError(f"HTTP {r.status_code}")
                body = bytearray()
                async for chunk in r.aiter_bytes():
                    body += chunk
                    if len(body) > limit:
                        raise OSError(f"larger than {limit} bytes")
                return bytes(body)
        except httpx2.HTTPError as exc:
            raise OSError(str(exc) or type(exc).__name__) from None
    assert scope.cancelled_caught
    raise OSError(f"no answer within {timeout_s} s")


class Jwks:
    """One issuer's keys, from a file or its URL (cached; see the module's docstring)."""

    def __init__(self, settings: OidcIssuer, file_keys: KeySet | None, fetch: Fetch) -> None:
        self.settings = settings
        self.rules = Rules.of(settings)
        self.keys = file_keys or KeySet()
        self.fixed = file_keys is not None
        self._fetch = fetch
        self._lock = trio.Lock()
        #: trio.current_time() of the last fetch tried (None: never) and succeeded.
        self.tried_at: float | None = None
        self.fetched_at: float | None = None
        self.fetches = 0
        self.failures = 0
        #: Counts the key sets fetched: a caller that waited sees whether it moved.
        self.generation = 0
        self._jwks_url = settings.jwks_url

    def source(self) -> tuple[object, ...]:
        """What the keys depend on: a reload with the same keeps this cache."""
        s = self.settings
        return (s.issuer, s.jwks_url, s.jwks_file, s.fetch_timeout_s)

    def due(self, now: float) -> float:
        """When the next background refresh is due (``inf`` for a file's keys)."""
        if self.fixed:
            return math.inf
        if self.tried_at is None:
            return now
        s = self.settings
        held = -math.inf if self.fetched_at is None else self.fetched_at + s.refresh_s
        return max(held, self.tried_at + s.min_refresh_s)

    async def refresh(self, *, unknown_kid: bool = False) -> bool:
        """Fetch the keys again (one fetch at a time; a caller that waited for another's
        gets its result). ``unknown_kid``: only if none was tried in ``min_refresh_s``.

        Returns:
            Whether new keys are held since the call began.
        """
        if self.fixed:
            return False
        generation = self.generation
        if self._lock.locked():  # a fetch under way: its result is this caller's too
            async with self._lock:
                return self.generation != generation
        now = trio.current_time()
        recent = self.tried_at is not None and now - self.tried_at < self.settings.min_refresh_s
        if unknown_kid and recent:
            return False
        async with self._lock:
            self.tried_at = now
            self.fetches += 1
            try:
                keys = await self._load()
            except (OSError, ValueError) as exc:
                self.failures += 1
                log.warning(
                    "oidc %s: cannot fetch the signing keys (%s); %s",
                    self.settings.name,
                    exc,
                    f"keeping the {len(self.keys)} held" if len(self.keys) else "none held",
                )
                return False
            self.keys = keys
            self.fetched_at = trio.current_time()
            self.generation += 1
            return True

    async def _load(self) -> KeySet:
        s = self.settings
        url = self._jwks_url
        if url is None:
            url = await self._discover()
        data: bytes = await self._fetch(url, MAX_JWKS_BYTES, s.fetch_timeout_s)
        return parse_jwks(data)

    async def _discover(self) -> str:
        s = self.settings
        where = s.issuer.rstrip("/") + "/.well-known/openid-configuration"
        data: bytes = await self._fetch(where, MAX_JWKS_BYTES, s.fetch_timeout_s)
        try:
            doc = msgspec.json.decode(data)
        except msgspec.DecodeError as exc:
            raise ValueError(f"{where} is not JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("issuer") != s.issuer:
            raise ValueError(f"{where} is not the discovery document of {s.issuer}")
        uri = doc.get("jwks_uri")
        if not isinstance(uri, str) or not uri.startswith(("https://", "http://")):
            raise ValueError(f"{where} names no jwks_uri")
        self._jwks_url = uri
        return uri


def read_jwks_file(settings: OidcIssuer, base_dir: str, roots: tuple[str, ...] | None) -> KeySet:
    """The keys of ``settings.jwks_file`` (relative to the config's folder).

    Raises:
        ConfigError: the file is outside the config's folders, unreadable or not a JWKS.
    """
    assert settings.jwks_file is not None
    file = Path(base_dir) / settings.jwks_file
    where = f"[[auth.oidc]] {settings.name}: `jwks_file`"
    if not confined(str(file), roots):
        raise ConfigError(f"{where}: {outside('the JWKS file', settings.jwks_file)}")
    try:
        return parse_jwks(file.read_bytes()[: MAX_JWKS_BYTES + 1])
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {file}: {exc.strerror}") from None
    except ValueError as exc:
        raise ConfigError(f"{where}: {file}: {exc}") from None


@dataclass(frozen=True, slots=True)
class _Verified:
    """A token verified once: good again while its issuer's keys and rules are the same
    ones (a refresh or a reload checks it anew) and its times hold."""

    jwks: Jwks
    generation: int
    rules: Rules
    principal: Principal
    exp: float
    nbf: float | None

    def valid(self, issuers: Mapping[str, Jwks]) -> bool:
        j = self.jwks
        return (
            issuers.get(j.rules.issuer) is j
            and j.generation == self.generation
            and j.rules is self.rules
        )


class Oidc:
    """The worker's issuers and their keys: verifies a bearer JWT into a principal.

    Built once per worker; :meth:`configure` takes a reloaded config's issuers, keeping
    the cached keys of those whose source did not change.
    """

    def __init__(self, fetch: Fetch = http_get) -> None:
        self._fetch = fetch
        self.issuers: dict[str, Jwks] = {}
        self._wake = trio.Event()
        #: Tokens verified lately (by SHA-256): a caller sends its token until it expires,
        #: and checking it again costs its times only (see :meth:`principal`).
        self._verified: OrderedDict[bytes, _Verified] = OrderedDict()

    def configure(
        self, issuers: Iterable[OidcIssuer], base_dir: str = ".",
        roots: tuple[str, ...] | None = None,
    ) -> None:  # fmt: skip
        """Use ``issuers`` from now on (a file's keys are read here: ConfigError if bad)."""
        self.use(self.prepare(issuers, base_dir, roots))

    @staticmethod
    def prepare(
        issuers: Iterable[OidcIssuer], base_dir: str = ".",
        roots: tuple[str, ...] | None = None,
    ) -> Prepared:  # fmt: skip
        """``issuers`` with their files' keys, read (ConfigError if bad); nothing changes
        until :meth:`use` (a reload that is refused later changes nothing)."""
        return [
            (s, read_jwks_file(s, base_dir, roots) if s.jwks_file is not None else None)
            for s in issuers
        ]

    def use(self, prepared: Prepared) -> None:
        """Check tokens with ``prepared``'s issuers from now on, keeping the keys held of
        each whose source did not change."""
        fresh: dict[str, Jwks] = {}
        for settings, file_keys in prepared:
            jwks = Jwks(settings, file_keys, self._fetch)
            old = self.issuers.get(settings.issuer)
            if old is not None and not old.fixed and old.source() == jwks.source():
                old.settings, old.rules = settings, jwks.rules
                jwks = old
            fresh[settings.issuer] = jwks
        self.issuers = fresh
        self._wake.set()

    def __bool__(self) -> bool:
        return bool(self.issuers)

    async def principal(self, token: str, now: float) -> Principal:
        """The principal of a bearer JWT, verified at ``now`` (Unix seconds).

        A token naming a key the cache does not hold fetches the keys again (at most
        once per the issuer's ``min_refresh_s``) and is checked once more.

        Raises:
            TokenRefused: the token is not accepted (its ``code`` says why).
        """
        digest = hashlib.sha256(token.encode()).digest()
        hit = self._verified.get(digest)
        if hit is not None and hit.valid(self.issuers):
            check_times(hit.exp, hit.nbf, hit.rules.skew_s, now)
            return hit.principal
        seen = peek(token)
        jwks = self.issuers.get(seen.issuer)
        if jwks is None:
            raise TokenRefused(
                f"the token's issuer {seen.issuer[:200]!r} is not one this gateway trusts",
                code="token_wrong_issuer",
            )
        try:
            claims = verify(token, jwks.rules, jwks.keys, now)
        except TokenRefused as exc:
            if exc.code != "token_unknown_kid" or not await jwks.refresh(unknown_kid=True):
                raise
            claims = verify(token, jwks.rules, jwks.keys, now)
        principal = principal_of(claims, jwks.settings)
        self._verified[digest] = _Verified(
            jwks, jwks.generation, jwks.rules, principal, claims["exp"], claims.get("nbf")
        )
        while len(self._verified) > MAX_VERIFIED:
            self._verified.popitem(last=False)
        return principal

    async def run(self) -> None:
        """Fetch every issuer's keys now, then again when due (the worker's background)."""
        while True:
            now = trio.current_time()
            due = [j for j in self.issuers.values() if j.due(now) <= now]
            if due:
                async with trio.open_nursery() as nursery:
                    for jwks in due:
                        nursery.start_soon(jwks.refresh)
                continue
            self._wake = trio.Event()
            later = min((j.due(now) for j in self.issuers.values()), default=math.inf)
            with trio.move_on_at(later):
                await self._wake.wait()


def expiry(token: str) -> int:
    """The ``exp`` of a token already verified (for the console's login and logout)."""
    exp = jwt.decode(token, options={"verify_signature": False}).get("exp")
    return int(exp) if _number(exp) else 0
