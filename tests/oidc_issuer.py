"""A small OIDC issuer on loopback for the single sign-on tests (issue 47, item 3).

It serves ``/.well-known/openid-configuration`` and its JWKS over real HTTP on
127.0.0.1 (h11 on a Trio listener, in the test's own run) and signs tokens with keys
generated here (RSA and P-256), through PyJWT -- nothing is mocked. It can rotate to a
new key, go down (connections are refused: the listener is closed) and come back, and
counts the JWKS fetches it answered.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import h11
import jwt
import trio
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

AUDIENCE = "aiserve-gateway"


@dataclass
class SigningKey:
    kid: str
    alg: str
    private: Any

    @classmethod
    def new(cls, kid: str, alg: str = "RS256") -> SigningKey:
        if alg.startswith("ES"):
            return cls(kid, alg, ec.generate_private_key(ec.SECP256R1()))
        return cls(kid, alg, rsa.generate_private_key(public_exponent=65537, key_size=2048))

    def jwk(self) -> dict[str, Any]:
        algo = ECAlgorithm if self.alg.startswith("ES") else RSAAlgorithm
        out: dict[str, Any] = algo.to_jwk(self.private.public_key(), as_dict=True)
        return {**out, "kid": self.kid, "use": "sig", "alg": self.alg}


@dataclass
class Issuer:
    """Keys, tokens and the HTTP side; :func:`running_issuer` starts it."""

    keys: list[SigningKey] = field(default_factory=lambda: [SigningKey.new("k1")])
    port: int = 0
    jwks_fetches: int = 0
    discovery_fetches: int = 0
    _listeners: list[trio.SocketListener] = field(default_factory=list)
    _nursery: trio.Nursery | None = None
    _serving: trio.CancelScope = field(default_factory=trio.CancelScope)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def jwks(self) -> dict[str, Any]:
        return {"keys": [k.jwk() for k in self.keys]}

    def token(
        self,
        *,
        key: SigningKey | None = None,
        kid: str | None = "",
        lifetime_s: float = 300,
        now: float | None = None,
        headers: dict[str, Any] | None = None,
        **claims: Any,
    ) -> str:
        """A token signed with ``key`` (the newest key), valid from now for ``lifetime_s``;
        ``claims`` replace or add to the defaults (``None`` removes one)."""
        key = key or self.keys[-1]
        now = time.time() if now is None else now
        body: dict[str, Any] = {
            "iss": self.url,
            "aud": AUDIENCE,
            "sub": "alice",
            "iat": int(now),
            "nbf": int(now),
            "exp": int(now + lifetime_s),
            "tenant": "bank-a",
            "groups": ["gateway-users"],
        }
        body.update(claims)
        body = {k: v for k, v in body.items() if v is not None}
        head = dict(headers or {})
        if kid is not None:
            head["kid"] = kid or key.kid
        return jwt.encode(body, key.private, algorithm=key.alg, headers=head)

    def rotate(self, kid: str, *, keep_old: bool = False) -> SigningKey:
        """Sign from now on with a new key (published in the JWKS)."""
        new = SigningKey.new(kid)
        self.keys = [*self.keys, new] if keep_old else [new]
        return new

    async def down(self) -> None:
        """Stop listening: every fetch is refused until :meth:`up`."""
        self._serving.cancel()
        for listener in self._listeners:
            await listener.aclose()
        self._listeners = []

    async def up(self) -> None:
        assert self._nursery is not None
        self._listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
        self._serving = await self._nursery.start(self._listen)

    async def _listen(self, *, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            await trio.serve_listeners(self._serve, self._listeners)

    async def _serve(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    conn.receive_data(data)
                    continue
                if isinstance(event, h11.Request):
                    break
                return
            status, body = self._answer(event.target.decode())
            head = [("content-type", "application/json"), ("content-length", str(len(body)))]
            out = conn.send(
                h11.Response(status_code=status, headers=[*head, ("connection", "close")])
            )
            out = (
                (out or b"")
                + (conn.send(h11.Data(data=body)) or b"")
                + (conn.send(h11.EndOfMessage()) or b"")
            )
            await stream.send_all(out)
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError):
            pass
        finally:
            await stream.aclose()

    def _answer(self, target: str) -> tuple[int, bytes]:
        if target == "/.well-known/openid-configuration":
            self.discovery_fetches += 1
            doc = {"issuer": self.url, "jwks_uri": f"{self.url}/jwks"}
            return 200, json.dumps(doc).encode()
        if target == "/jwks":
            self.jwks_fetches += 1
            return 200, json.dumps(self.jwks()).encode()
        return 404, b"{}"


@asynccontextmanager
async def running_issuer(*keys: SigningKey) -> AsyncIterator[Issuer]:
    """An issuer listening on a free loopback port for the block."""
    issuer = Issuer(keys=list(keys)) if keys else Issuer()
    async with trio.open_nursery() as nursery:
        issuer._nursery = nursery
        await issuer.up()
        issuer.port = issuer._listeners[0].socket.getsockname()[1]
        try:
            yield issuer
        finally:
            nursery.cancel_scope.cancel()


def oidc_toml(issuer_url: str, **values: Any) -> str:
    """An ``[[auth.oidc]]`` table for ``issuer_url`` (discovery), ``values`` added or
    replacing: the claims ``tenant`` and ``groups``, ``gateway-admins`` -> admin,
    ``gateway-users`` -> user, ``gateway-viewers`` -> viewer."""
    table: dict[str, Any] = {
        "issuer": issuer_url,
        "audience": [AUDIENCE],
        "tenant_claim": "tenant",
        "team_claim": "team",
        "roles_claim": "groups",
        "min_refresh_s": 30,
        "fetch_timeout_s": 2,
    }
    table.update(values)
    lines = ["[[auth.oidc]]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in table.items() if v is not None]
    lines += [
        "[auth.oidc.role_map]",
        'gateway-admins = ["admin"]',
        'gateway-root = ["global-admin"]',
        'gateway-users = ["user"]',
        'gateway-viewers = ["viewer"]',
    ]
    return "\n".join(lines) + "\n"
