"""API keys, tenants and signed stream tokens (sans-IO, plus a small CLI).

A plain API key looks like ``aik_<id>_<secret>``: the ``id`` finds the key's
entry without trying every hash, the secret is what is checked. The config only
ever holds a hash: ``scrypt$<log2 n>$<r>$<p>$<salt hex>$<digest hex>``, so a
leaked config file does not leak keys. Verifying a hash costs ~0.1 s of CPU on
purpose; a verified key is remembered (by the SHA-256 of the presented key) so
that only a key's first request pays it, and failed presentations are
remembered too, so a client cannot make the gateway burn CPU by repeating a bad
key.

Browsers' ``EventSource`` cannot send an ``Authorization`` header, so an
authenticated client asks for a *stream token*: an HMAC-SHA256 over the tenant,
the session id, the key id and an expiry, passed as ``?token=``. It opens one
session's event stream for a few minutes and nothing else. The operator console
exchanges an admin key for a *console token* the same way; each kind of token is
signed with its own key derived from the secret, so one is never taken for the other.

CLI::

    python -m aiserve_trio.security.auth new demo     # a new key and its hash
    aiserve-keys hash < key.txt                       # the hash of a key you have
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import secrets
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TypeVar

from ..errors import Forbidden, Unauthorized

KEY_RE = re.compile(r"^aik_(?P<id>[a-z0-9]{1,32})_(?P<secret>[A-Za-z0-9_-]{16,128})$")
HASH_RE = re.compile(
    r"^scrypt\$(?P<logn>\d{1,2})\$(?P<r>\d{1,2})\$(?P<p>\d{1,2})"
    r"\$(?P<salt>[0-9a-f]{16,64})\$(?P<digest>[0-9a-f]{64})$"
)
#: scrypt cost for new keys: n = 2**14, r = 8 (16 MiB, ~0.1 s).
DEFAULT_LOG_N = 14
_CACHE_MAX = 4096
_V = TypeVar("_V")
WILDCARD = "*"


def new_key(key_id: str) -> str:
    """A new random plain key for ``key_id``.

    Raises:
        ValueError: ``key_id`` is not 1-32 lower-case letters or digits.
    """
    if not re.fullmatch(r"[a-z0-9]{1,32}", key_id):
        raise ValueError("`key_id` must be 1-32 lower-case letters or digits")
    return f"aik_{key_id}_{secrets.token_urlsafe(24)}"


#: Hashes this cheap are verified inline: a thread would cost more than the hash.
CHEAP_LOG_N = 10


def hash_key(plain: str, *, log_n: int = DEFAULT_LOG_N, salt: bytes | None = None) -> str:
    """The storable hash of a plain key (scrypt with a random per-key salt).

    Raises:
        ValueError: ``plain`` is not a well-formed key.
    """
    if not KEY_RE.match(plain):
        raise ValueError("a key must look like aik_<id>_<secret>")
    salt = salt if salt is not None else secrets.token_bytes(16)
    digest = _scrypt(plain, salt, log_n, 8, 1)
    return f"scrypt${log_n}$8$1${salt.hex()}${digest.hex()}"


def check_hash(value: str) -> None:
    """Raise ValueError unless ``value`` is a hash :func:`hash_key` could have made."""
    m = HASH_RE.match(value)
    if not m or not 4 <= int(m["logn"]) <= 20:
        raise ValueError("must be a hash printed by `aiserve-keys hash` (scrypt$...)")


def verify_hash(plain: str, stored: str) -> bool:
    """Whether ``plain`` hashes to ``stored`` (compared in constant time)."""
    m = HASH_RE.match(stored)
    if not m:
        return False
    digest = _scrypt(plain, bytes.fromhex(m["salt"]), int(m["logn"]), int(m["r"]), int(m["p"]))
    return hmac.compare_digest(digest.hex(), m["digest"])


def _scrypt(plain: str, salt: bytes, log_n: int, r: int, p: int) -> bytes:
    n = 1 << log_n
    return hashlib.scrypt(
        plain.encode(), salt=salt, n=n, r=r, p=p, maxmem=256 * n * r + (1 << 20), dklen=32
    )


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


@dataclass(frozen=True, slots=True)
class KeyEntry:
    principal: Principal
    hash: str


class KeyStore:
    """Looks up presented keys; remembers verified and refused ones (bounded)."""

    def __init__(self, entries: list[KeyEntry]) -> None:
        self._by_id = {e.principal.key_id: e for e in entries}
        if len(self._by_id) != len(entries):
            raise ValueError("two keys share an id")
        self._good: OrderedDict[bytes, Principal] = OrderedDict()
        self._bad: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_id)

    def cached(self, plain: str) -> Principal | None:
        """The principal of an already verified key, without hashing it again.

        Raises:
            Unauthorized: the key is malformed, unknown, or was refused before.
        """
        m = KEY_RE.match(plain)
        if not m or m["id"] not in self._by_id:
            raise Unauthorized("the API key is not valid")
        fp = _fingerprint(plain)
        if fp in self._bad:
            raise Unauthorized("the API key is not valid")
        hit = self._good.get(fp)
        if hit is not None:
            self._good.move_to_end(fp)
        return hit

    def cheap(self, plain: str) -> bool:
        """Whether ``plain``'s stored hash is cheap enough (scrypt n <= 2**10, well
        under a millisecond) to verify on the event loop rather than in a thread."""
        m = KEY_RE.match(plain)
        entry = self._by_id.get(m["id"]) if m else None
        h = HASH_RE.match(entry.hash) if entry is not None else None
        return h is not None and int(h["logn"]) <= CHEAP_LOG_N

    def verify(self, plain: str) -> Principal:
        """Verify ``plain`` against its stored hash (slow: call it off the event loop).

        Raises:
            Unauthorized: the key does not match.
        """
        hit = self.cached(plain)
        if hit is not None:
            return hit
        m = KEY_RE.match(plain)
        assert m is not None  # cached() checked it
        entry = self._by_id[m["id"]]
        fp = _fingerprint(plain)
        if not verify_hash(plain, entry.hash):
            _remember(self._bad, fp, None)
            raise Unauthorized("the API key is not valid")
        _remember(self._good, fp, entry.principal)
        return entry.principal


def _fingerprint(plain: str) -> bytes:
    return hashlib.sha256(plain.encode()).digest()


def _remember(cache: OrderedDict[bytes, _V], key: bytes, value: _V) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > _CACHE_MAX:
        cache.popitem(last=False)


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

    def check(self, token: str, tenant_of: dict[str, str], session_id: str, now: float) -> str:
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
