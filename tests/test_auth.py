"""Access control: key hashing, the key store, stream tokens, and the gate in the app --
401/403 envelopes, admin-only paths, and tenant isolation tried every way we know."""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import sys
from typing import Any

import pytest
import trio

from aiserve_trio.config import ConfigError
from aiserve_trio.core.errors import Forbidden, Unauthorized
from aiserve_trio.security import auth
from aiserve_trio.security.auth import (
    KeyEntry,
    KeyStore,
    Principal,
    StreamTokens,
    bearer,
    hash_key,
    legacy_hash,
    new_key,
)

from .asgi_client import Client, Exchange, chat_body, make_scope
from .authcfg import KEY_A, KEY_ADMIN, KEY_B, auth_app, auth_config, auth_toml
from .authcfg import bearer as auth_headers

SID = "session:20240521:abc789"


def principal(key_id: str = "alice", tenant: str = "bank-a", **kw: Any) -> Principal:
    return Principal(
        key_id=key_id, tenant=tenant, routes=frozenset(["*"]), channels=frozenset(["*"]), **kw
    )


# --- hashing and the key store (sans-IO) --------------------------------------------


def test_hash_is_the_sha256_of_the_whole_key() -> None:
    stored = hash_key(KEY_A)
    assert stored.startswith("sha256$")
    assert KEY_A not in stored
    store = KeyStore([KeyEntry(principal(), stored)])
    assert store.check(KEY_A) == principal()
    with pytest.raises(Unauthorized):
        store.check(KEY_B)


@pytest.mark.parametrize("bad", ["", "sk-123", "aik_x_short", "aik_UPPER_" + "a" * 20])
def test_malformed_keys_cannot_be_hashed(bad: str) -> None:
    with pytest.raises(ValueError, match="aik_"):
        hash_key(bad)


def test_new_key_is_random_and_well_formed() -> None:
    k1, k2 = new_key("demo"), new_key("demo")
    assert k1 != k2
    assert auth.KEY_RE.match(k1)
    with pytest.raises(ValueError, match="key_id"):
        new_key("Bad Id")


def test_every_wrong_key_is_refused_by_the_same_work() -> None:
    """Malformed, unknown id, known id with a wrong secret: one SHA-256 and one
    constant-time comparison each, so an answer's time does not tell ids apart."""
    store = KeyStore([KeyEntry(principal(), hash_key(KEY_A))])
    for wrong in ("aik_alice_" + "z" * 32, "aik_nobody_" + "a" * 32, "not-a-key", ""):
        with pytest.raises(Unauthorized, match="not valid"):
            store.check(wrong)
    assert store.check(KEY_A) == principal()


def test_unknown_ids_and_wrong_secrets_cost_the_same_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    store = KeyStore([KeyEntry(principal(), hash_key(KEY_A))])
    calls: list[str] = []
    sha256, compare = hashlib.sha256, hmac.compare_digest

    def counted_sha256(data: bytes) -> Any:
        calls.append("sha256")
        return sha256(data)

    def counted_compare(a: bytes, b: bytes) -> bool:
        calls.append(f"compare {len(a)} {len(b)}")
        return bool(compare(a, b))

    def no_scrypt(*args: object, **kwargs: object) -> bytes:
        raise AssertionError("no scrypt for a key of the new format")

    monkeypatch.setattr(hashlib, "sha256", counted_sha256)
    monkeypatch.setattr(hmac, "compare_digest", counted_compare)
    monkeypatch.setattr(hashlib, "scrypt", no_scrypt)
    work = {}
    for name, key in (("unknown", "aik_nobody_" + "a" * 32), ("known", "aik_alice_" + "z" * 32)):
        calls.clear()
        with pytest.raises(Unauthorized):
            store.check(key)
        work[name] = list(calls)
    assert work["unknown"] == work["known"] == ["sha256", "compare 32 32"]


def test_a_legacy_scrypt_key_is_migrated_on_first_use(caplog: pytest.LogCaptureFixture) -> None:
    store = KeyStore([KeyEntry(principal(), legacy_hash(KEY_A, log_n=4))])
    assert store.legacy == ["alice"]
    assert store.check(KEY_A) is None  # needs the slow check, in a thread
    wrong = "aik_alice_" + "z" * 32
    assert store.check(wrong) is None
    with pytest.raises(Unauthorized):
        store.migrate(wrong, store.verify_legacy(wrong))
    with pytest.raises(Unauthorized):
        store.check(wrong)  # refused from memory: no second scrypt for it
    with caplog.at_level("WARNING", logger="aiserve_trio.security"):
        assert store.migrate(KEY_A, store.verify_legacy(KEY_A)).key_id == "alice"
    assert f'hash = "{hash_key(KEY_A)}"' in caplog.text
    assert store.legacy == []
    assert store.check(KEY_A) is not None  # re-hashed: constant time from now on


@pytest.mark.parametrize(
    ("header", "code"),
    [(None, "missing_api_key"), ("Basic abc", "invalid_api_key"), ("Bearer ", "invalid_api_key")],
)
def test_bearer_header_is_required(header: str | None, code: str) -> None:
    with pytest.raises(Unauthorized) as info:
        bearer(header)
    assert info.value.code == code


def test_bearer_takes_the_key() -> None:
    assert bearer(f"bearer  {KEY_A} ") == KEY_A


def test_principal_rights() -> None:
    p = Principal(key_id="a", tenant="t", routes=frozenset(["/x"]), channels=frozenset(["app"]))
    p.check_route("/x")
    p.check_channel("app")
    with pytest.raises(Forbidden):
        p.check_route("/y")
    with pytest.raises(Forbidden):
        p.check_channel("ivr")
    with pytest.raises(Forbidden):
        p.check_admin("/debug")


def test_stream_tokens_are_scoped_signed_and_expire() -> None:
    tokens = StreamTokens(b"s" * 32, ttl_s=300)
    tenants = {"alice": "bank-a", "bob": "bank-b"}
    tok = tokens.issue(principal(), SID, now=1000.0)
    assert tokens.check(tok, tenants, SID, now=1100.0) == "alice"
    with pytest.raises(Unauthorized, match="expired"):
        tokens.check(tok, tenants, SID, now=1301.0)
    with pytest.raises(Unauthorized):
        tokens.check(tok, tenants, "session:other", now=1100.0)
    expiry, key_id, sig = tok.split(".")
    with pytest.raises(Unauthorized):  # re-labelled for another key (another tenant)
        tokens.check(f"{expiry}.bob.{sig}", tenants, SID, now=1100.0)
    with pytest.raises(Unauthorized):  # a later expiry is not signed
        tokens.check(f"{int(expiry) + 999}.{key_id}.{sig}", tenants, SID, now=1100.0)
    with pytest.raises(Unauthorized):  # another server's secret
        StreamTokens(b"t" * 32, 300).check(tok, tenants, SID, now=1100.0)
    for junk in ("", "...", "x.alice.y", "9" * 40 + ".alice.x"):
        with pytest.raises(Unauthorized):
            tokens.check(junk, tenants, SID, now=1100.0)


def test_cli_prints_a_key_and_its_hash(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert auth.main(["new", "demo"]) == 0
    out = capsys.readouterr().out
    key = out.split("key:", 1)[1].split()[0]
    stored = out.split('hash = "', 1)[1].split('"')[0]
    assert stored.startswith("sha256$")
    store = KeyStore([KeyEntry(principal("demo"), stored)])
    assert store.check(key) is not None
    monkeypatch.setattr(sys, "stdin", io.StringIO(key + "\n"))
    assert auth.main(["hash"]) == 0
    assert capsys.readouterr().out.strip() == stored
    assert auth.main(["bogus"]) == 2


# --- config ------------------------------------------------------------------------


def test_plain_keys_never_in_config_and_bad_hashes_refused() -> None:
    with pytest.raises(ConfigError, match=r"auth.keys\[0\].hash"):
        auth_config(auth_toml().replace('hash = "sha256', 'hash = "plain', 1))


def test_auth_on_without_keys_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"auth\.keys"):
        auth_config("[auth]\nenabled = true\n")


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (('tenant = "bank-a"', 'tenant = "a:b"'), r"auth.keys\[0\].tenant"),
        (('channels = ["app", "web"]', 'channels = ["fax"]'), r"auth.keys\[0\].channels\[0\]"),
        (('routes = ["/v1/chat/completions"]', 'routes = ["/v2"]'), r"auth.keys\[0\].routes\[0\]"),
        (('id = "bob"', 'id = "alice"'), r"auth.keys\[1\].id"),
    ],
)
def test_key_validation_names_the_key(edit: tuple[str, str], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        auth_config(auth_toml().replace(*edit, 1))


def test_keys_file_is_read_relative_to_the_config(tmp_path: Any) -> None:
    from aiserve_trio.config import load_config

    from .conftest import config_text

    body = auth_toml().split("[[auth.keys]]", 1)[1]
    (tmp_path / "keys.toml").write_text("[[keys]]" + body.replace("[[auth.keys]]", "[[keys]]"))
    text = config_text().replace(
        "[auth]\nenabled = false\n", '[auth]\nenabled = true\nkeys_file = "keys.toml"\n'
    )
    (tmp_path / "gw.toml").write_text(text)
    cfg = load_config(tmp_path / "gw.toml")
    assert cfg.auth is not None
    assert [k.id for k in cfg.auth.keys] == ["alice", "bob", "ops"]


def test_auth_off_warns_loudly(caplog: pytest.LogCaptureFixture) -> None:
    from aiserve_trio.runtime.asgi import App

    from .conftest import make_config

    App(make_config()).gate.announce()
    assert "AUTH IS OFF" in caplog.text


# --- the gate in the app -----------------------------------------------------------


@pytest.fixture
def client() -> Client:
    return Client(auth_app())


def envelope(r: Any) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"}
    return dict(body["error"])


async def test_no_key_is_401_envelope(client: Client) -> None:
    r = await client.chat(chat_body())
    assert r.status == 401
    assert envelope(r)["type"] == "authentication_error"
    assert envelope(r)["code"] == "missing_api_key"
    # Nothing was sent: the challenge names the scheme, and no error (RFC 6750 3.1).
    assert r.headers["www-authenticate"] == 'Bearer realm="aiserve-trio"'


async def test_wrong_key_is_401_and_not_echoed(client: Client) -> None:
    wrong = "aik_alice_" + "x" * 32
    r = await client.chat(chat_body(), auth_headers(wrong))
    assert r.status == 401
    assert wrong not in r.body.decode()
    challenge = r.headers["www-authenticate"]
    assert 'error="invalid_token"' in challenge
    assert wrong not in challenge


async def test_good_key_streams(client: Client) -> None:
    r = await client.chat(chat_body(stream=True), auth_headers(KEY_A, **{"x-channel": "app"}))
    assert r.status == 200
    assert r.events()[-1] == "[DONE]"


async def test_channel_rights_are_403() -> None:
    a = auth_app(auth_toml().replace('["/v1/chat/completions"]', '["*"]', 1))
    client = Client(a)
    r = await client.chat(chat_body(), auth_headers(KEY_A, **{"x-channel": "ivr"}))
    assert (r.status, envelope(r)["code"]) == (403, "channel_not_allowed")
    r = await client.chat(chat_body(), auth_headers(KEY_A, **{"x-channel": "web"}))
    assert r.status == 200


async def test_route_not_allowed_is_403() -> None:
    extra = (
        '[[routes]]\npath = "/v1/other"\nname = "other"\nadapter = "mock"\n'
        'default_model = "aiserve-mock"\n'
    )
    from aiserve_trio.config import parse_config
    from aiserve_trio.runtime.asgi import App

    from .conftest import config_text

    text = config_text().replace("[auth]\nenabled = false\n", auth_toml()) + extra
    client = Client(App(parse_config(text)))
    r = await client.request(
        "POST", "/v1/other", json_body=chat_body(), headers=auth_headers(KEY_A)
    )
    assert (r.status, envelope(r)["code"]) == (403, "route_not_allowed")
    r = await client.request(
        "POST", "/v1/other", json_body=chat_body(), headers=auth_headers(KEY_B)
    )
    assert r.status == 200


async def test_probes_stay_open_and_metrics_follow_config(client: Client) -> None:
    assert (await client.request("GET", "/healthz")).status == 200
    assert (await client.request("GET", "/metrics")).status == 200
    closed = Client(auth_app(auth_toml(metrics="admin")))
    assert (await closed.request("GET", "/metrics")).status == 401
    assert (await closed.request("GET", "/metrics", headers=auth_headers(KEY_B))).status == 403
    assert (await closed.request("GET", "/metrics", headers=auth_headers(KEY_ADMIN))).status == 200


async def test_metrics_need_a_credential_by_default_and_take_a_scrape_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without `metrics = ...` in [auth]: closed (it lists every tenant, key id and spend).
    default = auth_toml().replace('metrics = "open"\n', "")
    closed = Client(auth_app(default))
    assert (await closed.request("GET", "/metrics")).status == 401
    assert (await closed.request("GET", "/metrics", headers=auth_headers(KEY_ADMIN))).status == 200
    token = "prometheus-scrape-token-0123456789"
    monkeypatch.setenv("AISERVE_TEST_METRICS_TOKEN", token)
    scraped = Client(
        auth_app(
            default.replace(
                "[auth]\n", '[auth]\nmetrics_token_env = "AISERVE_TEST_METRICS_TOKEN"\n', 1
            )
        )
    )
    scrape = {"authorization": f"Bearer {token}"}
    assert (await scraped.request("GET", "/metrics", headers=scrape)).status == 200
    wrong = {"authorization": f"Bearer {token}x"}
    assert (await scraped.request("GET", "/metrics", headers=wrong)).status == 401
    # The scrape token opens /metrics and nothing else.
    assert (await scraped.request("GET", "/v1/models", headers=scrape)).status == 401
    monkeypatch.setenv("AISERVE_TEST_METRICS_TOKEN", "short")
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        auth_app(
            default.replace(
                "[auth]\n", '[auth]\nmetrics_token_env = "AISERVE_TEST_METRICS_TOKEN"\n', 1
            )
        )


async def test_debug_is_admin_only(client: Client) -> None:
    assert (await client.request("GET", "/debug/tasks")).status == 401
    r = await client.request("GET", "/debug/tasks", headers=auth_headers(KEY_A))
    assert (r.status, envelope(r)["code"]) == (403, "admin_only")
    r = await client.request("GET", "/debug/tasks", headers=auth_headers(KEY_ADMIN))
    assert r.status == 404  # allowed through the gate; no such page


async def test_models_need_a_key(client: Client) -> None:
    assert (await client.request("GET", "/v1/models")).status == 401
    assert (await client.request("GET", "/v1/models", headers=auth_headers(KEY_B))).status == 200


# --- tenant isolation ---------------------------------------------------------------


async def events_with(client: Client, path: str, query: bytes, headers: dict[str, str]) -> Any:
    """Open an event stream, read what the replay sends, disconnect."""
    scope = make_scope("GET", path, headers)
    scope["query_string"] = query
    ex = Exchange(client.app, scope, [b""])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ex.run)
        with trio.move_on_after(1.0):
            await ex.wait_for_bytes(1)
        ex.disconnect()
    return ex.response


async def test_tenant_b_cannot_read_tenant_a_session_any_way(autojump_clock: Any) -> None:
    app = auth_app()
    client = Client(app)
    secret = "my card is 4111 and income 9000"
    # Tenant A (alice) writes a turn and a variable into SID.
    hdr_a = auth_headers(KEY_A, **{"x-session-id": SID, "x-channel": "app"})
    r = await client.chat(chat_body("echo: " + secret), hdr_a)
    assert r.status == 200
    r = await client.request(
        "PUT", f"/v1/sessions/{SID}/vars", json_body={"income": "9000"}, headers=auth_headers(KEY_A)
    )
    assert r.status == 200
    mine = await client.request("GET", f"/v1/sessions/{SID}", headers=auth_headers(KEY_A))
    assert secret in mine.body.decode()

    hb = auth_headers(KEY_B)
    # 1. The same session id, read directly.
    view = await client.request("GET", f"/v1/sessions/{SID}", headers=hb)
    assert view.status == 200
    assert view.json()["turns"] == []
    assert view.json()["variables"] == {}
    # 2. Claiming tenant A in the session id, headers or query: ignored.
    for path in (f"/v1/sessions/bank-a:{SID}", f"/v1/sessions/bank-a%3A{SID}"):
        r = await client.request("GET", path, headers=hb)
        assert "9000" not in r.body.decode()
    for claim in (
        {"x-tenant": "bank-a"},
        {"x-aiserve-tenant": "bank-a"},
        {"openai-organization": "bank-a"},
    ):
        r = await client.request("GET", f"/v1/sessions/{SID}", headers={**hb, **claim})
        assert secret not in r.body.decode()
    # 3. The event stream, with B's key, and with Last-Event-ID from the start.
    ev = await events_with(
        client, f"/v1/sessions/{SID}/events", b"", {**hb, "last-event-id": "0-0"}
    )
    assert ev.status == 200
    assert secret not in ev.body.decode()
    # 4. A stream token: B's token for the same id, A's token replayed by B for
    # another id, a token forged from A's by changing the key id.
    tok_b = await client.request("POST", f"/v1/sessions/{SID}/stream-token", headers=hb)
    ev = await events_with(
        client, f"/v1/sessions/{SID}/events", b"token=" + tok_b.json()["token"].encode(), {}
    )
    assert secret not in ev.body.decode()
    tok_a = (
        await client.request(
            "POST", f"/v1/sessions/{SID}/stream-token", headers=auth_headers(KEY_A)
        )
    ).json()["token"]
    exp, _, sig = tok_a.split(".")
    forged = f"{exp}.bob.{sig}".encode()
    ev = await events_with(client, f"/v1/sessions/{SID}/events", b"token=" + forged, {})
    assert ev.status == 401
    ev = await events_with(
        client, "/v1/sessions/session:other/events", b"token=" + tok_a.encode(), {}
    )
    assert ev.status == 401
    # A's token works for A's session (the positive control for the above).
    ev = await events_with(client, f"/v1/sessions/{SID}/events", b"token=" + tok_a.encode(), {})
    assert ev.status == 200
    assert secret in ev.body.decode()
    # 5. Chatting in the same session with B's key: A's history does not reach the model.
    r = await client.chat(
        chat_body("tell me about my session"),
        auth_headers(KEY_B, **{"x-session-id": SID}),
    )
    assert r.status == 200
    assert "9000" not in r.body.decode()
    # 6. Writing variables as B does not touch A's session.
    await client.request("PUT", f"/v1/sessions/{SID}/vars", json_body={"income": "1"}, headers=hb)
    mine = await client.request("GET", f"/v1/sessions/{SID}", headers=auth_headers(KEY_A))
    assert mine.json()["variables"] == {"income": "9000"}
    # 7. A token in the query does not open anything but the events stream.
    r = await client.request("GET", f"/v1/sessions/{SID}?token={tok_a}")
    assert r.status == 401


async def test_stream_token_needs_post_and_a_key(client: Client) -> None:
    r = await client.request("POST", f"/v1/sessions/{SID}/stream-token")
    assert r.status == 401
    r = await client.request("GET", f"/v1/sessions/{SID}/stream-token", headers=auth_headers(KEY_A))
    assert r.status == 405
    r = await client.request(
        "POST", f"/v1/sessions/{SID}/stream-token", headers=auth_headers(KEY_A)
    )
    body = json.loads(r.body)
    assert (r.status, body["session_id"], body["expires_in"]) == (200, SID, 300)
