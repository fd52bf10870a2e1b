"""``/mcp``'s client sessions (``Mcp-Session-Id``) of the handshake-era protocol.

A session id is signed, not stored: ``initialize`` answers with the protocol
version, a nonce and the key's id, encoded, and an HMAC of them under a key derived
from the gate's secret (``[auth] token_secret_env``, ``AISERVE_TOKEN_SECRET``). Any
worker, on any host, with that secret reads it back; no worker keeps a table that
grows with sessions, so there is no cap to evict from and no tenant can crowd out
another's sessions. Without the variable each worker has a secret of its own (as for
console and stream tokens), and a session is its worker's.

What a worker does keep is small and bounded: the cancel scopes of the calls running
in it (``notifications/cancelled`` cancels a call of the worker it reaches), and the
ids ended by ``DELETE`` (at most ``[mcp] max_sessions``, the oldest forgotten first),
which it answers 404 from then on. Pure: no I/O, no clock.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from collections import OrderedDict
from dataclasses import dataclass

#: A longer ``Mcp-Session-Id`` is not one of ours (ours are ~100 characters).
MAX_ID = 512


@dataclass(frozen=True, slots=True)
class Session:
    """A client's ``Mcp-Session-Id``: whose it is, at which protocol version."""

    sid: str
    key_id: str | None
    version: str


class SessionIds:
    """Issues session ids and reads them back (None: not one this secret signed)."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        self._key = key

    def _sign(self, body: str) -> str:
        digest = hmac.new(self._key, body.encode(), hashlib.sha256).digest()[:18]
        return base64.urlsafe_b64encode(digest).decode()

    def issue(self, key_id: str | None, version: str) -> str:
        payload = f"{version}|{secrets.token_urlsafe(12)}|{key_id or ''}"
        body = base64.urlsafe_b64encode(payload.encode()).decode().rstrip("=")
        return f"{body}.{self._sign(body)}"

    def read(self, sid: str) -> Session | None:
        if len(sid) > MAX_ID:
            return None
        body, dot, sig = sid.rpartition(".")
        if not dot or not hmac.compare_digest(sig.encode(), self._sign(body).encode()):
            return None
        try:
            payload = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None
        version, _, rest = payload.partition("|")
        _nonce, _, key_id = rest.partition("|")
        return Session(sid, key_id or None, version)


class Ended:
    """Session ids ended by ``DELETE`` in this worker, the newest ``limit``."""

    __slots__ = ("_ids", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._ids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, sid: object) -> bool:
        return sid in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, sid: str) -> None:
        self._ids[sid] = None
        while len(self._ids) > self.limit:
            self._ids.popitem(last=False)
