"""The gate's settings: ``[auth]`` and its keys, and ``[limits]`` (what one request and
one worker may take before the gate or the parse stage refuses more).

A leaf module (msgspec, the decoding helpers and the key hashes' rule): the config
imports it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import msgspec

from ..core.decoding import Section, as_field, decode_toml, field_error, not_above, positive
from ..core.errors import ConfigError
from ..core.tenants import check_tenant
from ..spend.settings import Period, check_budget
from .auth import check_hash
from .keystore.records import is_db_key_id
from .roles import check_roles

_KEY_ID_RE = re.compile(r"^[a-z0-9]{1,32}$")


class LimitsConfig(Section):
    #: Images and audio travel inside the body as base64: room for a few.
    max_body_bytes: int = 8_388_608
    #: One content part (an image, audio, a file) at most.
    max_part_bytes: int = 5_242_880
    #: Deeper JSON is refused before any decoder recurses into it.
    max_json_depth: int = 64
    #: Values in the body (counted by commas and brackets outside strings, in slices,
    #: before it is decoded): a decode is one call that cannot yield, 5-12 ms for
    #: 50,000 values. A real request holds a few thousand.
    max_json_values: int = 50_000
    max_messages: int = 256
    max_content_chars: int = 262_144
    #: Pieces, counted before any translation (``apis/shape.py``): a request's cost on
    #: the event loop grows with them, not with its bytes. Content parts (blocks) in
    #: one message, in the whole request (a Responses ``input`` item counts as one),
    #: and tools (OpenAI's own limit is 128). Far above what real clients send.
    max_content_parts: int = 1_000
    max_request_parts: int = 10_000
    max_tools: int = 128
    max_tokens: int = 131_072
    #: Per worker: requests in flight and open event streams; beyond, a fast 503.
    max_inflight: int = 4_096
    max_streams: int = 4_096
    #: Open streams one tenant may hold in a worker (0: no cap); beyond, 429.
    tenant_max_streams: int = 0
    #: A client that accepts no byte of a write for this long is dropped.
    write_timeout_ms: int = 10_000
    #: ``: ping`` comments on a stream idle this long (0: none).
    heartbeat_s: float = 15.0
    #: The body must keep arriving: at most this long between two of its chunks,
    #: at most ``body_total_timeout_ms`` in all, and, after its first second, at
    #: ``body_min_rate`` bytes per second or faster (0: no rate floor); else 408.
    body_read_timeout_ms: int = 5_000
    body_total_timeout_ms: int = 30_000
    body_min_rate: int = 16
    #: In-flight slots for requests whose body is still arriving (0: a quarter of
    #: ``max_inflight``): slow uploads cannot take every slot.
    max_receiving: int = 0
    #: Requests in flight from one client address (0: no cap); beyond, 429.
    max_per_client: int = 0
    #: The header a trusted proxy puts the client's address in (e.g.
    #: ``x-forwarded-for``, its last entry); empty: the connection's address.
    client_address_header: str = ""

    def __post_init__(self) -> None:
        positive(
            self,
            "max_body_bytes",
            "max_part_bytes",
            "max_json_depth",
            "max_json_values",
            "max_messages",
            "max_content_chars",
            "max_content_parts",
            "max_request_parts",
            "max_tools",
            "max_tokens",
            "max_inflight",
            "max_streams",
            "write_timeout_ms",
            "body_read_timeout_ms",
            "body_total_timeout_ms",
        )
        not_above(self, "body_read_timeout_ms", "body_total_timeout_ms")
        for key in ("body_min_rate", "max_receiving", "max_per_client"):
            if getattr(self, key) < 0:
                raise field_error(key, "must not be negative")
        if self.heartbeat_s < 0:
            raise field_error("heartbeat_s", "must not be negative")


class AuthKey(Section):
    #: The ``<id>`` in ``aik_<id>_<secret>``.
    id: str
    #: ``sha256$...`` from ``aiserve-keys`` (or a legacy ``scrypt$...``); never the plain key.
    hash: str
    tenant: str
    #: Paths this key may call (``"*"``: every route); see ``sessions`` for session endpoints.
    routes: list[str] = msgspec.field(default_factory=lambda: ["*"])
    channels: list[str] = msgspec.field(default_factory=lambda: ["*"])
    admin: bool = False
    #: An admin of every tenant: others' usage, the console's cache view, the config
    #: (``/admin/config``, reload, the console's steps) and ``/debug/``. An admin key
    #: without it sees its own tenant only (issue 51, item 5). Implies ``admin``.
    global_admin: bool = False
    #: Requests and tokens (prompt + completion) per minute; 0: unlimited.
    rpm: int = 0
    tpm: int = 0
    #: Its tenant's sessions (``/v1/sessions/...``): ``read``, ``write`` (and read) or
    #: ``none``; unset: read and write when the key may chat (some route and channel).
    sessions: Literal["", "none", "read", "write"] = ""
    #: Spend allowed per ``budget_period`` in ``[pricing] currency`` (None: no budget).
    budget: float | None = None
    budget_period: Period = "month"
    budget_alert_at: float = 0.8
    #: The team the key belongs to inside its tenant ("": none).
    team: str = ""
    #: Roles beyond ``admin``: ``key-manager``, ``viewer``, ``user``.
    roles: list[str] = msgspec.field(default_factory=list)
    #: MCP tools the key may list and call (``server/tool`` or ``server/*``); none unset.
    mcp_tools: list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        check_budget(self.budget, self.budget_alert_at)
        if not _KEY_ID_RE.match(self.id):
            raise field_error("id", "must be 1-32 lower-case letters/digits")
        if is_db_key_id(self.id):
            # The database keys' ids (issue 47): a config key and a database key never
            # share one.
            raise field_error("id", "`vk` and 14 letters/digits is a database key's id")
        try:
            check_hash(self.hash)
        except ValueError as exc:
            raise field_error("hash", str(exc)) from None
        as_field("tenant", check_tenant, self.tenant)
        if self.rpm < 0 or self.tpm < 0:
            raise ValueError("`rpm` and `tpm` must not be negative")
        try:
            check_roles(self.roles)
        except ValueError as exc:
            raise field_error("roles", str(exc)) from None


#: JWT signature algorithms an issuer may use: public-key ones only (never ``none`` or HS*).
OIDC_ALGORITHMS = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}
)
#: What an issuer's role claim may map to (``global-admin``: an admin of every tenant).
OIDC_ROLES = frozenset({"admin", "global-admin", "key-manager", "viewer", "user"})
_OIDC_NAME_RE = re.compile(r"^[a-z0-9-]{1,32}$")


class OidcIssuer(Section):
    """One ``[[auth.oidc]]`` issuer whose JWTs are accepted as ``Authorization: Bearer``."""

    #: Exactly the token's ``iss``.
    issuer: str
    #: The token's ``aud`` must hold one of these.
    audience: list[str]
    #: Names the issuer in the principal's id (``<name>:<subject>``) and the logs.
    name: str = "sso"
    #: Where the issuer's signing keys (a JWKS) are fetched; unset, and ``jwks_file``
    #: unset too: from the ``jwks_uri`` of ``<issuer>/.well-known/openid-configuration``.
    jwks_url: str | None = None
    #: A JWKS file (relative to this config): the offline alternative to fetching.
    jwks_file: str | None = None
    algorithms: list[str] = msgspec.field(default_factory=lambda: ["RS256", "ES256"])
    #: Leeway for ``exp`` and ``nbf`` (clocks of the issuer and the gateway differ).
    clock_skew_s: float = 60.0
    #: The keys are fetched again this often; and, when a token names a key (``kid``)
    #: not among them, at most once per ``min_refresh_s`` (a rotation at the issuer).
    refresh_s: float = 3600.0
    min_refresh_s: float = 30.0
    #: One fetch of the discovery document or JWKS at most.
    fetch_timeout_s: float = 5.0
    #: The claim naming the tenant, or a fixed ``tenant`` for every token (one of them).
    tenant_claim: str = ""
    tenant: str = ""
    #: The claim naming the team ("": none).
    team_claim: str = ""
    #: The claim holding the caller's groups or roles (a dotted path such as
    #: ``realm_access.roles`` reaches inside objects), and what each value grants.
    roles_claim: str = "roles"
    role_map: dict[str, list[str]] = msgspec.field(default_factory=dict)
    #: Roles every token of this issuer has.
    default_roles: list[str] = msgspec.field(default_factory=list)
    #: The claim identifying the caller.
    subject_claim: str = "sub"
    #: What a caller with the ``user`` role may call (as a key's ``routes``, ``channels``).
    routes: list[str] = msgspec.field(default_factory=lambda: ["*"])
    channels: list[str] = msgspec.field(default_factory=lambda: ["*"])

    def __post_init__(self) -> None:
        if not _OIDC_NAME_RE.match(self.name):
            raise field_error("name", "must be 1-32 lower-case letters, digits or dashes")
        if not self.issuer:
            raise field_error("issuer", "must be the issuer's URL (the tokens' `iss`)")
        if not self.audience or not all(self.audience):
            raise field_error("audience", "must name at least one audience")
        if self.jwks_url is not None and self.jwks_file is not None:
            raise field_error("jwks_file", "set `jwks_url` or `jwks_file`, not both")
        for url in filter(None, (self.jwks_url, self.issuer if self.jwks_file is None else "")):
            if not url.startswith(("https://", "http://")):
                raise field_error("jwks_url", f"{url[:100]!r} must be an http(s) URL")
        bad = [a for a in self.algorithms if a not in OIDC_ALGORITHMS]
        if bad or not self.algorithms:
            raise field_error(
                "algorithms",
                f"{bad or 'none'} not allowed: one or more of {', '.join(sorted(OIDC_ALGORITHMS))}",
            )
        if (self.tenant_claim == "") == (self.tenant == ""):
            raise field_error("tenant_claim", "set `tenant_claim` or a fixed `tenant` (one)")
        if self.tenant:
            as_field("tenant", check_tenant, self.tenant)
        granted = [r for rs in self.role_map.values() for r in rs] + self.default_roles
        if unknown := sorted(set(granted) - OIDC_ROLES):
            raise field_error("role_map", f"unknown roles {unknown}: {sorted(OIDC_ROLES)}")
        if self.clock_skew_s < 0 or self.clock_skew_s > 600:
            raise field_error("clock_skew_s", "must be 0-600 seconds")
        positive(self, "refresh_s", "min_refresh_s", "fetch_timeout_s")
        not_above(self, "min_refresh_s", "refresh_s")


class AuthConfig(Section):
    #: Off only when said so; the server then warns loudly at start-up.
    enabled: bool = True
    #: A TOML file (relative to this config) with more ``[[keys]]`` tables.
    keys_file: str | None = None
    #: Once loaded: these keys, then those of ``keys_file``.
    keys: list[AuthKey] = msgspec.field(default_factory=list)
    #: Environment variable holding the stream-token HMAC secret (>= 16 bytes);
    #: unset: a random secret per worker (tokens then work on one worker only).
    token_secret_env: str = "AISERVE_TOKEN_SECRET"
    stream_token_ttl_s: int = 300
    #: Seconds a console token (``/admin/``, exchanged for an admin key) stays valid.
    console_token_ttl_s: int = 900
    #: ``GET /metrics`` with auth on: ``admin`` (an admin key, or the scrape token of
    #: ``metrics_token_env``) or ``open`` (anyone: it lists every tenant, key id,
    #: spend and budget ratio, so only where the port is private).
    metrics: Literal["open", "admin"] = "admin"
    #: Environment variable holding a token that ``GET /metrics`` accepts as
    #: ``Authorization: Bearer <token>`` (>= 16 bytes): Prometheus's credential,
    #: which opens nothing else. Unset: admin keys only.
    metrics_token_env: str | None = None
    #: Rate-limit state: ``memory`` (per worker) or ``redis`` (``[sessions] url``).
    ratelimit_backend: Literal["memory", "redis"] = "memory"
    #: Single sign-on: ``[[auth.oidc]]`` issuers whose JWTs are accepted (security/oidc.py).
    oidc: list[OidcIssuer] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        positive(self, "stream_token_ttl_s")
        positive(self, "console_token_ttl_s")
        issuers = [o.issuer for o in self.oidc]
        names = [o.name for o in self.oidc]
        if len(set(issuers)) != len(issuers) or len(set(names)) != len(names):
            raise field_error("oidc", "two issuers share an `issuer` or a `name`")


class KeysFile(Section):
    keys: list[AuthKey] = msgspec.field(default_factory=list)


def read_keys_file(file: Path, source: str) -> list[AuthKey]:
    """The ``[[keys]]`` of an ``[auth] keys_file``.

    Raises:
        ConfigError: the file cannot be read (naming ``auth.keys_file`` in
            ``source``), or a key in it is not valid (naming the file and key).
    """
    try:
        data = file.read_bytes()
    except OSError as exc:
        why = f"cannot read {file}: {exc.strerror}"
        raise ConfigError(f"{source}: key `auth.keys_file`: {why}") from None
    return decode_toml(data, KeysFile, source=str(file)).keys
