"""Single sign-on's pure core (issue 47, item 3): a JWT checked against an issuer's keys
at a given time, each refusal with its reason, and the claims mapped to a principal --
with tokens signed by PyJWT with keys made here, no I/O."""

from __future__ import annotations

import base64
import json
import re
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from cryptography.hazmat.primitives import serialization

from aiserve_trio.config import ConfigError
from aiserve_trio.security import oidc as oidc_module
from aiserve_trio.security.oidc import (
    MAX_JWKS_BYTES,
    MAX_KEYS,
    KeySet,
    Oidc,
    Rules,
    TokenRefused,
    looks_like_jwt,
    parse_jwks,
    principal_of,
    verify,
)
from aiserve_trio.security.settings import OidcIssuer

from .authcfg import auth_config, auth_toml
from .oidc_issuer import AUDIENCE, Issuer, SigningKey, oidc_toml

URL = "https://login.bank.example"
NOW = 1_800_000_000.0
KEY = SigningKey.new("k1")
EC_KEY = SigningKey.new("e1", "ES256")


def issuer(*keys: SigningKey) -> Issuer:
    out = Issuer(keys=list(keys) or [KEY])
    out.port = 1  # the URL is not served: these tests do no I/O
    return out


def rules(**kw: Any) -> Rules:
    base: dict[str, Any] = {
        "issuer": issuer().url,
        "audiences": frozenset({AUDIENCE}),
        "algorithms": frozenset({"RS256", "ES256"}),
        "skew_s": 60.0,
    }
    return Rules(**{**base, **kw})


def keyset(*keys: SigningKey) -> KeySet:
    return parse_jwks(json.dumps({"keys": [k.jwk() for k in keys or (KEY,)]}).encode())


def refused(token: str, keys: KeySet | None = None, now: float = NOW, **kw: Any) -> str:
    with pytest.raises(TokenRefused) as caught:
        verify(token, rules(**kw), keys or keyset(), now)
    return caught.value.code


def settings(**kw: Any) -> OidcIssuer:
    base: dict[str, Any] = {
        "issuer": URL,
        "audience": [AUDIENCE],
        "tenant_claim": "tenant",
        "team_claim": "team",
        "roles_claim": "realm_access.roles",
        "role_map": {"ops": ["admin"], "staff": ["user"], "root": ["global-admin"]},
        "routes": ["/v1/chat/completions"],
        "channels": ["web"],
    }
    return msgspec.convert({**base, **kw}, OidcIssuer)


def b64(data: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


def test_a_good_token_gives_its_claims() -> None:
    token = issuer().token(now=NOW, team="cards")
    claims = verify(token, rules(), keyset(), NOW + 10)
    assert (claims["sub"], claims["tenant"], claims["team"]) == ("alice", "bank-a", "cards")
    ec_token = issuer(EC_KEY).token(now=NOW)
    assert verify(ec_token, rules(), keyset(KEY, EC_KEY), NOW)["sub"] == "alice"
    assert looks_like_jwt(token)
    assert not looks_like_jwt("aik_alice_" + "a" * 32)
    assert not looks_like_jwt("1800000900.ops.c2lnbmF0dXJl")  # a console token


def test_a_token_signed_by_another_key_is_refused_for_its_signature() -> None:
    impostor = SigningKey.new("k1")  # the same key id, another key
    assert refused(issuer(impostor).token(now=NOW)) == "token_bad_signature"
    # A payload changed after signing: the same.
    head, body, sig = issuer().token(now=NOW).split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=="))
    forged = ".".join((head, b64({**claims, "tenant": "bank-b"}), sig))
    assert refused(forged) == "token_bad_signature"


def test_audience_issuer_and_times_are_each_refused_with_their_reason() -> None:
    iss = issuer()
    assert refused(iss.token(now=NOW, aud="another-app")) == "token_wrong_audience"
    assert refused(iss.token(now=NOW, iss="https://evil.example")) == "token_wrong_issuer"
    # Expired: beyond the clock skew; within it, still good.
    token = iss.token(now=NOW, lifetime_s=300)
    assert verify(token, rules(), keyset(), NOW + 300 + 59)["sub"] == "alice"
    assert refused(token, now=NOW + 300 + 61) == "token_expired"
    assert refused(token, now=NOW + 300 + 1, skew_s=0) == "token_expired"
    # Not yet valid: nbf ahead by more than the skew.
    early = iss.token(now=NOW, nbf=int(NOW) + 600, lifetime_s=900)
    assert refused(early) == "token_not_yet_valid"
    assert verify(early, rules(), keyset(), NOW + 541)["sub"] == "alice"
    # No exp at all: refused, never taken as "valid forever".
    assert refused(iss.token(now=NOW, exp=None)) == "invalid_token"


def test_alg_none_and_a_public_key_used_as_an_hmac_secret_are_refused() -> None:
    claims = {"iss": issuer().url, "aud": AUDIENCE, "sub": "mallory", "exp": int(NOW) + 300}
    for alg in ("none", "None", "NONE"):
        unsigned = f"{b64({'alg': alg, 'typ': 'JWT', 'kid': 'k1'})}.{b64(claims)}."
        assert refused(unsigned) == "token_alg_none"
    # The classic confusion: HS256 with the issuer's public key as the secret.
    pem = KEY.private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    head = b64({"alg": "HS256", "typ": "JWT", "kid": "k1"})
    import hashlib
    import hmac

    signing_input = f"{head}.{b64(claims)}"
    mac = hmac.new(pem, signing_input.encode(), hashlib.sha256).digest()
    hs = f"{signing_input}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}"
    assert refused(hs) == "token_alg_not_allowed"
    # An allowed algorithm on the wrong type of key (an RSA key named by an ES256 token).
    ec_as_rsa = issuer(EC_KEY).token(now=NOW, kid="k1")
    assert refused(ec_as_rsa) == "token_bad_signature"


def test_an_unknown_key_id_and_garbage_are_refused() -> None:
    other = SigningKey.new("k2")
    assert refused(issuer(other).token(now=NOW)) == "token_unknown_kid"
    for junk in ("eyJ.eyJ.x", "eyJhbGciOiJSUzI1NiJ9.bm90IGpzb24.c2ln", "eyJ" + "A" * 20000):
        assert refused(junk) == "invalid_token"
    # No kid: the one key that fits the algorithm is used.
    assert verify(issuer().token(now=NOW, kid=None), rules(), keyset(KEY, EC_KEY), NOW)


def test_a_jwks_keeps_only_public_signing_keys() -> None:
    enc = {**SigningKey.new("x").jwk(), "use": "enc", "kid": "enc"}
    secret = {"kty": "oct", "k": "c2VjcmV0", "kid": "hmac"}
    keys = parse_jwks(json.dumps({"keys": [enc, secret, KEY.jwk()]}).encode())
    assert set(keys.by_kid) == {"k1"}
    for bad in (b"[]", b"{}", b"not json", json.dumps({"keys": [secret]}).encode()):
        with pytest.raises(ValueError, match="JWKS"):
            parse_jwks(bad)


def test_claims_map_to_tenant_team_and_roles() -> None:
    s = settings()
    claims = {"sub": "alice", "tenant": "bank-a", "team": "cards",
              "realm_access": {"roles": ["staff", "unrelated"]}}  # fmt: skip
    p = principal_of(claims, s)
    assert (p.key_id, p.tenant, p.team, p.roles) == (
        "sso:alice",
        "bank-a",
        "cards",
        frozenset({"user"}),
    )
    assert p.routes == {"/v1/chat/completions"}
    assert (p.channels, p.admin) == (frozenset({"web"}), False)
    ops = principal_of({**claims, "realm_access": {"roles": ["ops"]}}, s)
    assert (ops.admin, ops.global_admin, ops.roles) == (True, False, frozenset({"admin"}))
    assert not ops.routes
    root = principal_of({**claims, "realm_access": {"roles": ["root"]}}, s)
    assert (root.admin, root.global_admin) == (True, True)
    nobody = principal_of({**claims, "realm_access": {}}, s)
    assert not nobody.roles
    assert not nobody.routes
    assert not nobody.channels
    fixed = principal_of(
        {"sub": "svc", "tenant": "bank-b"}, settings(tenant_claim="", tenant="bank-c")
    )
    assert fixed.tenant == "bank-c"  # a fixed tenant: the token cannot name another
    for bad in ({"tenant": "bank-a"}, {"sub": "x"}, {"sub": "x", "tenant": "no spaces!"}):
        with pytest.raises(TokenRefused) as caught:
            principal_of(bad, s)
        assert caught.value.code == "token_claims"


def test_the_config_refuses_unsafe_or_incomplete_issuers() -> None:
    good = oidc_toml(URL)
    assert auth_config(auth_toml(extra=good)).auth.oidc[0].algorithms == ["RS256", "ES256"]  # type: ignore[union-attr]
    for extra, says in (
        (oidc_toml(URL, algorithms=["HS256"]), "algorithms"),
        (oidc_toml(URL, algorithms=["none"]), "algorithms"),
        (oidc_toml(URL, tenant_claim=None), "tenant_claim"),
        (oidc_toml(URL, tenant="bank-a"), "tenant_claim"),
        (oidc_toml(URL, audience=[]), "audience"),
        (oidc_toml(URL, jwks_url="ftp://x", jwks_file="x.json"), "jwks_file"),
        (oidc_toml(URL, default_roles=["superuser"]), "role_map"),
        (oidc_toml(URL) + oidc_toml(URL, name="other"), "oidc"),
    ):
        with pytest.raises(ConfigError, match=says):
            auth_config(auth_toml(extra=extra))


def test_the_guides_example_loads_and_maps_as_it_says() -> None:
    text = (Path(__file__).parent.parent / "docs" / "guides" / "access.md").read_text()
    (block,) = [b for b in re.findall(r"```toml\n(.*?)```", text, re.S) if "[[auth.oidc]]" in b]
    auth = auth_config(auth_toml(extra=block)).auth
    assert auth is not None
    (corp,) = auth.oidc
    claims = {"sub": "olga", "tenant": "bank-a", "realm_access": {"roles": ["gateway-operators"]}}
    p = principal_of(claims, corp)
    assert (p.key_id, p.global_admin, p.routes) == ("corp:olga", True, frozenset())


def test_the_largest_jwks_accepted_parses_well_within_the_loops_20_ms() -> None:
    # MAX_KEYS keys are read (RSA and EC), the rest of a document near MAX_JWKS_BYTES is
    # decoded and skipped: what one fetch costs the event loop at most.
    made = [SigningKey.new(f"r{i}").jwk() for i in range(4)]
    made += [SigningKey.new(f"e{i}", "ES256").jwk() for i in range(4)]
    entries = [{**made[i % len(made)], "kid": f"id{i}"} for i in range(MAX_KEYS + 500)]
    data = json.dumps({"keys": entries}).encode()
    while len(data) > MAX_JWKS_BYTES:
        entries.pop()
        data = json.dumps({"keys": entries}).encode()
    assert len(entries) > MAX_KEYS
    took = []
    for _ in range(5):
        start = time.perf_counter()
        keys = parse_jwks(data)
        took.append(time.perf_counter() - start)
    assert len(keys) == MAX_KEYS
    assert min(took) < 0.010, f"{min(took) * 1000:.1f} ms"


def test_verifying_stays_cheap() -> None:
    token, keys, r = issuer().token(now=NOW), keyset(), rules()
    start = time.perf_counter()
    for _ in range(200):
        verify(token, r, keys, NOW)
    each = (time.perf_counter() - start) / 200
    assert each < 0.002, f"{each * 1e6:.0f} us per token"


def served(iss: Issuer) -> Oidc:
    """An Oidc whose fetch answers ``iss``'s discovery document and current JWKS."""

    async def fetch(url: str, limit: int, timeout_s: float) -> bytes:
        if url.endswith("/.well-known/openid-configuration"):
            return json.dumps({"issuer": iss.url, "jwks_uri": f"{iss.url}/jwks"}).encode()
        return json.dumps(iss.jwks()).encode()

    oidc = Oidc(fetch)
    oidc.configure([msgspec.convert({**SETTINGS, "issuer": iss.url}, OidcIssuer)])
    return oidc


SETTINGS: dict[str, Any] = {
    "audience": [AUDIENCE],
    "tenant_claim": "tenant",
    "roles_claim": "groups",
    "role_map": {"gateway-users": ["user"]},
}


async def refused_by(oidc: Oidc, token: str, now: float) -> str:
    with pytest.raises(TokenRefused) as caught:
        await oidc.principal(token, now)
    return caught.value.code


async def test_a_token_verified_once_is_checked_again_for_its_times_keys_and_rules() -> None:
    iss = issuer()
    oidc = served(iss)
    token = iss.token(lifetime_s=300)
    now = time.time()
    assert (await oidc.principal(token, now)).key_id == "sso:alice"
    assert (await oidc.principal(token, now + 100)).key_id == "sso:alice"
    # Remembered, it still expires.
    assert await refused_by(oidc, token, now + 300 + 61) == "token_expired"
    # A reload that changes the audience: the remembered token is checked anew.
    jwks = oidc.issuers[iss.url]
    changed = {**SETTINGS, "issuer": iss.url, "audience": ["another-app"]}
    oidc.configure([msgspec.convert(changed, OidcIssuer)])
    assert oidc.issuers[iss.url] is jwks
    assert await refused_by(oidc, token, now) == "token_wrong_audience"
    oidc.configure([msgspec.convert({**SETTINGS, "issuer": iss.url}, OidcIssuer)])
    assert (await oidc.principal(token, now)).key_id == "sso:alice"
    # The issuer drops the key: once the keys are fetched again, its tokens are refused.
    iss.rotate("k2")
    assert await jwks.refresh()
    assert await refused_by(oidc, token, now) == "token_unknown_kid"


async def test_a_remembered_token_is_not_verified_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A token seen before skips the signature check (PyJWT's, the costly part: its
    cost is bench material, not a unit test's); its times are still checked."""
    iss = issuer()
    oidc = served(iss)
    now = time.time()
    await oidc.principal(iss.token(), now)  # the keys fetched
    verified: list[str] = []
    real = oidc_module.verify

    def counting(token: str, *args: Any) -> dict[str, Any]:
        verified.append(token)
        return real(token, *args)

    monkeypatch.setattr(oidc_module, "verify", counting)
    tokens = [iss.token(sub=f"u{i}", lifetime_s=60, now=now) for i in range(20)]
    first = [(await oidc.principal(t, now)).key_id for t in tokens]
    assert len(verified) == 20
    assert [(await oidc.principal(t, now)).key_id for t in tokens] == first
    assert len(verified) == 20  # none verified again
    with pytest.raises(TokenRefused) as refused:
        await oidc.principal(tokens[0], now + 3600)  # remembered, but expired since
    assert refused.value.code == "token_expired"
