"""API keys, tenants and signed stream tokens (sans-IO, plus a small CLI).

A plain API key looks like ``aik_<id>_<secret>``: the ``id`` finds the key's
entry, the secret is what is checked. The config only ever holds a hash,
``sha256$<digest hex>``: the SHA-256 of the whole key. A key is 192 random bits,
not a password, so a fast hash is as safe as a slow one against a leaked config
(there is nothing to guess), and it is checked in about a microsecond on the
event loop, compared in constant time. Every presented key -- malformed, of an
unknown id, or of a known id with a wrong secret -- costs the same hash and
comparison, so answers do not tell ids apart and a flood of wrong keys costs the
gateway next to nothing.

Hashes of the first format, ``scrypt$<log2 n>$<r>$<p>$<salt>$<digest>`` (~0.1 s
of CPU each), are still accepted so that existing configs keep working: such a
key is verified with scrypt (in a thread) until its first success, then
re-hashed in memory to the new format and never scrypted again; the log prints
the ``sha256$`` line to put in the config instead (docs/security.md, migration).

Browsers' ``EventSource`` cannot send an ``Authorization`` header, so an
authenticated client asks for a *stream token*: an HMAC-SHA256 over the tenant,
the session id, the key id and an expiry, passed as ``?token=``. It opens one
session's event stream for a few minutes and nothing else. The operator console
exchanges an admin key for a *console token* the same way; each kind of token is
signed with its own key derived from the secret, so one is never taken for the other.

CLI::

    aiserve-keys new demo          # a new key and its hash
    aiserve-keys hash < key.txt    # the hash of a key you have
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import re
import secrets
import sys
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from ..core.errors import BadRequest, Forbidden, Unauthorized

log = logging.getLogger("aiserve_trio.security")
KEY_RE = re.compile(r"^aik_(?P<id>[a-z0-9]{1,32})_(?P<secret>[A-Za-z0-9_-]{16,128})$")
HASH_RE = re.compile(r"^sha256\$(?P<digest>[0-9a-f]{64})$")
LEGACY_HASH_RE = re.compile(
    r"^scrypt\$(?P<logn>\d{1,2})\$(?P<r>\d{1,2})\$(?P<p>\d{1,2})"
    r"\$(?P<salt>[0-9a-f]{16,64})\$(?P<digest>[0-9a-f]{64})$"
)
#: Refused legacy (scrypt) presentations remembered, so repeating one costs no scrypt.
_CACHE_MAX = 4096
WILDCARD = "*"
#: What a key may do with its tenant's sessions: ``""`` follows its routes and channels.
SessionGrant = Literal["", "none", "read", "write"]


def new_key(key_id: str) -> str:
    """A new random plain key for ``key_id`` (192 random bits).

    Raises:
        ValueError: ``key_id`` is not 1-32 lower-case letters or digits.
    """
    if not re.fullmatch(r"[a-z0-9]{1,32}", key_id):
        raise ValueError("`key_id` must be 1-32 lower-case letters or digits")
    return f"aik_{key_id}_{secrets.token_urlsafe(24)}"


def hash_key(plain: str) -> str:
    """The storable hash of a plain key: ``sha256$`` and the SHA-256 of the whole key.

    Raises:
        ValueError: ``plain`` is not a well-formed key.
    """
    if not KEY_RE.match(plain):
        raise ValueError("a key must look like aik_<id>_<secret>")
    return "sha256$" + _digest(plain).hex()


def check_hash(value: str) -> None:
    """Raise ValueError unless ``value`` is a hash :func:`hash_key` makes (or a legacy one)."""
    if HASH_RE.match(value):
        return
    m = LEGACY_HASH_RE.match(value)
    if not m or not 4 <= int(m["logn"]) <= 20:
        raise ValueError("must be a hash printed by `aiserve-keys hash` (sha256$...)")


def verify_legacy(plain: str, stored: str) -> bool:
    """Whether ``plain`` matches a legacy ``scrypt$`` hash (slow: ~0.1 s of CPU)."""
    m = LEGACY_HASH_RE.match(stored)
    if not m:
        return False
    n, r, p = 1 << int(m["logn"]), int(m["r"]), int(m["p"])
    salt = bytes.fromhex(m["salt"])
    digest = hashlib.scrypt(
        plain.encode(), salt=salt, n=n, r=r, p=p, maxmem=256 * n * r + (1 << 20), dklen=32
    )
    return hmac.compare_digest(digest.hex(), m["digest"])


def legacy_hash(plain: str, *, log_n: int, salt: bytes | None = None) -> str:
    """A ``scrypt$`` hash of the first format (for migration tests and tools)."""
    salt = salt if salt is not None else secrets.token_bytes(16)
    n = 1 << log_n
    digest = hashlib.scrypt(
        plain.encode(), salt=salt, n=n, r=8, p=1, maxmem=256 * n * 8 + (1 << 20), dklen=32
    )
    return f"scrypt${log_n}$8$1${salt.hex()}${digest.hex()}"


def _digest(plain: str) -> bytes:
    return hashlib.sha256(plain.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is: the key's id and tenant, and what it may do."""

    key_id: str
    tenant: str
    routes: frozenset[str]
    channels: frozenset[str]
    admin: bool = False
    #: Requests and tokens (prompt + completion) per minute; 0 = unlimited.
    rpm: int = 0
    tpm: int = 0
    #: The key's explicit sessions grant (``""``: what its routes and channels allow).
    sessions: SessionGrant = ""
    #: An admin of every tenant (``global_admin``); an admin without it, of its own.
    global_admin: bool = False
    #: The team the key belongs to inside its tenant ("": none).
    team: str = ""
    #: Roles beyond what ``admin`` says (``key-manager``, ``viewer``, ``user``).
    roles: frozenset[str] = frozenset()
    #: MCP tools this key may list and call (``server/tool``, ``server/*``); none by default.
    mcp_tools: tuple[str, ...] = ()
    #: Streams this key may hold open at once in a worker (0: no cap of its own).
    max_streams: int = 0
    #: The models this key may call (a database key's own or its team's or tenant's,
    #: ``security/keystore``); None: every model of its routes.
    models: frozenset[str] | None = None

    def check_route(self, path: str) -> None:
        """Raises Forbidden unless this key may call ``path``."""
        if WILDCARD not in self.routes and path not in self.routes:
            raise Forbidden(f"this API key may not call {path[:200]}", code="route_not_allowed")

    def check_channel(self, channel: str) -> None:
        """Raises Forbidden unless this key may use ``channel``."""
        if WILDCARD not in self.channels and channel not in self.channels:
            raise Forbidden(
                f"this API key may not use channel {channel!r}",
                param="X-Channel",
                code="channel_not_allowed",
            )

    def check_admin(self, what: str) -> None:
        """Raises Forbidden unless this is an admin key."""
        if not self.admin:
            raise Forbidden(f"{what} needs an admin API key", code="admin_only")

    def check_global_admin(self, what: str) -> None:
        """Raises Forbidden unless this is an admin key of every tenant (``global_admin``)."""
        if not self.global_admin:
            raise Forbidden(
                f"{what} acts for every tenant: it needs a key with global_admin = true",
                code="global_admin_only",
            )

    @property
    def admin_tenant(self) -> str | None:
        """The one tenant an admin key sees; None for a global admin (every tenant)."""
        return None if self.global_admin else self.tenant

    def check_sessions(self, write: bool) -> None:
        """Raises Forbidden unless this key may read (``write``: change) its tenant's sessions.

        A key that may chat (some route, some channel) may, as its chats do; a key
        without (an admin tool's) needs ``sessions = "read"`` or ``"write"``.
        """
        grant = self.sessions
        if not grant:
            grant = "write" if self.routes and self.channels else "none"
        if grant == "write" or (grant == "read" and not write):
            return
        what = "change" if write else "read"
        raise Forbidden(
            f"this API key may not {what} sessions (its `sessions` grant is {grant!r})",
            code="sessions_not_allowed",
        )

    def channel(self, header: str | None, channels: list[str]) -> str | None:
        """The channel a request without ``X-Channel`` acts on, from the key's own channels:
        its only one; None when the key may use any (the server's default applies).

        Raises:
            BadRequest: the key may use several channels: the request must say which.
        """
        if header is not None or WILDCARD in self.channels:
            return None
        mine = [c for c in channels if c in self.channels]
        if not mine:
            raise Forbidden("this API key may not use any channel", code="channel_not_allowed")
        if len(mine) == 1:
            return mine[0]
        raise BadRequest(
            f"this API key may use channels {', '.join(sorted(self.channels)) or '(none)'}: "
            "send `X-Channel` to say which",
            param="X-Channel",
            code="channel_required",
        )


@dataclass(frozen=True, slots=True)
class KeyEntry:
    principal: Principal
    hash: str


class KeyStore:
    """Checks presented keys against their stored hashes (sans-IO).

    :meth:`check` does the same work for every presented key, so that its time
    says nothing about whether the id exists.
    """

    def __init__(self, entries: list[KeyEntry]) -> None:
        self._by_id = {e.principal.key_id: e for e in entries}
        if len(self._by_id) != len(entries):
            raise ValueError("two keys share an id")
        self._digests = {
            e.principal.key_id: bytes.fromhex(e.hash.removeprefix("sha256$"))
            for e in entries
            if HASH_RE.match(e.hash)
        }
        #: Keys still under a scrypt hash, until their first successful use.
        self._legacy = {
            e.principal.key_id: e.hash for e in entries if e.principal.key_id not in self._digests
        }
        self._bad: OrderedDict[bytes, None] = OrderedDict()
        #: Compared against when the id is unknown (never equal to a real digest).
        self._nothing = secrets.token_bytes(32)

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def legacy(self) -> list[str]:
        """The ids of keys still under a scrypt hash."""
        return sorted(self._legacy)

    def check(self, plain: str) -> Principal | None:
        """The principal of ``plain``, in constant time; None when its id still has a
        legacy scrypt hash, which :meth:`verify_legacy` checks (slowly, off the loop).

        Raises:
            Unauthorized: the key is malformed, of an unknown id, or does not match.
        """
        m = KEY_RE.match(plain)
        key_id = m["id"] if m else ""
        got = _digest(plain)
        want = self._digests.get(key_id, self._nothing)
        if hmac.compare_digest(got, want) and m is not None:
            return self._by_id[key_id].principal
        if key_id in self._legacy and m is not None and got not in self._bad:
            return None
        raise Unauthorized("the API key is not valid")

    def verify_legacy(self, plain: str) -> bool:
        """Whether ``plain`` matches its id's scrypt hash (slow: call it in a thread)."""
        m = KEY_RE.match(plain)
        stored = self._legacy.get(m["id"]) if m else None
        return stored is not None and verify_legacy(plain, stored)

    def migrate(self, plain: str, ok: bool) -> Principal:
        """Record the result of :meth:`verify_legacy` (on the event loop): a match is
        re-hashed to the new format, a mismatch remembered.

        Raises:
            Unauthorized: ``ok`` is false.
        """
        m = KEY_RE.match(plain)
        got = _digest(plain)
        if not ok or m is None:
            self._bad[got] = None
            while len(self._bad) > _CACHE_MAX:
                self._bad.popitem(last=False)
            raise Unauthorized("the API key is not valid")
        key_id = m["id"]
        if self._legacy.pop(key_id, None) is not None:
            self._digests[key_id] = got
            log.warning(
                'key %r has a legacy scrypt hash: it is re-hashed in memory; put hash = "%s" '
                "in its [[auth.keys]] entry (docs/security.md, key migration)",
                key_id,
                "sha256$" + got.hex(),
            )
        return self._by_id[key_id].principal


def bearer(header: str | None) -> str:
    """The key from an ``Authorization: Bearer <key>`` header.

    Raises:
        Unauthorized: no header, or not the Bearer scheme.
    """
    if header is None:
        raise Unauthorized("no API key: send `Authorization: Bearer <key>`", code="missing_api_key")
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise Unauthorized("the Authorization header must be `Bearer <key>`")
    return value.strip()


# --- stream tokens ---------------------------------------------------------------


class StreamTokens:
    """Signs and checks short-lived tokens that open one session's event stream
    (``purpose="stream"``) or, with another ``purpose``, one other thing.

    The signing key is derived from the secret and the purpose, so a token issued for
    one purpose never checks for another, whatever its subject.
    """

    def __init__(self, secret: bytes, ttl_s: int, *, purpose: str = "stream") -> None:
        if len(secret) < 16:
            raise ValueError("the stream-token secret must be at least 16 bytes")
        derive = f"aiserve-trio {purpose} token".encode()
        self._secret = hmac.new(secret, derive, hashlib.sha256).digest()
        self.ttl_s = ttl_s
        self.purpose = purpose
        self._invalid = f"invalid_{purpose}_token"

    def issue(self, principal: Principal, session_id: str, now: float | None = None) -> str:
        """A token for ``principal`` to follow ``session_id`` until now + ttl."""
        expiry = int((time.time() if now is None else now) + self.ttl_s)
        payload = f"{principal.tenant}|{session_id}|{principal.key_id}|{expiry}"
        return f"{expiry}.{principal.key_id}.{self._sign(payload)}"

    def check(self, token: str, tenant_of: Mapping[str, str], session_id: str, now: float) -> str:
        """Check ``token`` for ``session_id``; return the key id it was issued to.

        Args:
            tenant_of: key id -> tenant, from the key store (a token names only
                its key; the tenant comes from the server's own records).

        Raises:
            Unauthorized: malformed, forged, for another session, or expired.
        """
        expiry_s, _, rest = token.partition(".")
        key_id, _, sig = rest.partition(".")
        tenant = tenant_of.get(key_id)
        if not expiry_s.isdigit() or tenant is None or len(expiry_s) > 12:
            raise Unauthorized(f"the {self.purpose} token is not valid", code=self._invalid)
        want = self._sign(f"{tenant}|{session_id}|{key_id}|{expiry_s}")
        if not hmac.compare_digest(want, sig):
            raise Unauthorized(f"the {self.purpose} token is not valid", code=self._invalid)
        if int(expiry_s) < now:
            raise Unauthorized(
                f"the {self.purpose} token has expired", code=f"expired_{self.purpose}_token"
            )
        return key_id

    def _sign(self, payload: str) -> str:
        mac = hmac.new(self._secret, payload.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def main(argv: list[str] | None = None) -> int:
    """``aiserve-keys new <id>`` | ``aiserve-keys hash`` (plain key on stdin)."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["new"] and len(args) == 2:
        try:
            plain = new_key(args[1])
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        print(f"key:  {plain}")
        print(f'hash = "{hash_key(plain)}"')
        print("Give the key to its owner; put only the hash in [[auth.keys]].", file=sys.stderr)
        return 0
    if args == ["hash"]:
        plain = sys.stdin.readline().strip()
        try:
            print(hash_key(plain))
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        return 0
    print("usage: aiserve-keys new <id> | aiserve-keys hash  (key on stdin)", file=sys.stderr)
    return 2


def secret_from_env(name: str) -> bytes | None:
    """The stream-token secret from environment variable ``name``, if set."""
    value = os.environ.get(name)
    return value.encode() if value else None


if __name__ == "__main__":
    raise SystemExit(main())
