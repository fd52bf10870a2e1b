"""Security round three, in process: a client without a valid key costs no slot, what a
web page could send to the admin, console, debug and session endpoints is refused,
session streams count against their tenant, channels and session grants follow the key,
and ``max_per_client`` counts requests that did not come through the proxy."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from aiserve_trio.config import ConfigError, load_config, parse_config
from aiserve_trio.http.types import STRIKE
from aiserve_trio.runtime.asgi import App
from aiserve_trio.security.auth import hash_key
from aiserve_trio.security.browser import BrowserGuard
from aiserve_trio.security.edge import (
    STRIKE_BURST,
    STRIKE_RATE,
    WORKER_STRIKE_BURST,
    PenaltyBox,
)

from .asgi_client import Client, Exchange, Response, chat_body, make_scope
from .authcfg import KEY_A, KEY_B, auth_app, auth_toml, bearer
from .conftest import config_text, make_config
from .test_console_api import call
from .test_reload import running

ROOT = Path(__file__).resolve().parent.parent
BANK = ROOT / "configs" / "examples" / "bank.toml"
#: The README's public demo key id, with a secret that is not its own.
WRONG_DEMO = "aik_demo_" + "w" * 32
UNKNOWN = "aik_nobody_" + "w" * 32
SID = "s-42"


def error(r: Response) -> dict[str, Any]:
    return dict(r.json()["error"])


async def request_from(
    app: App, method: str, path: str, headers: dict[str, str], *, client: str, body: bytes = b""
) -> Response:
    """One request from the peer address ``client``."""
    return await call(app, method, path, headers=headers, client=(client, 40000), body=body)


# --- item 1: a wrong key costs no slot and no slow hash --------------------------------


async def test_a_wrong_secret_on_a_published_key_id_takes_no_slot_and_no_thread(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = App(load_config(BANK))
    app.gate.admission.configure(1, 8)

    async def no_thread(*args: object, **kwargs: object) -> object:
        raise AssertionError("a key check must not need a thread")

    monkeypatch.setattr(trio.to_thread, "run_sync", no_thread)
    client = Client(app)
    with app.gate.admission.request():  # the worker's one slot is taken
        for key in (WRONG_DEMO, UNKNOWN):
            r = await client.request("GET", "/v1/models", headers=bearer(key))
            assert (r.status, error(r)["code"]) == (401, "invalid_api_key")
    assert app.gate.admission.shed == 0  # refused as a bad key, not as an overload
    assert app.gate.admission.inflight == 0


def test_failed_authentications_put_an_address_in_the_penalty_box() -> None:
    box = PenaltyBox(first=1.0, longest=60.0, capacity=16)
    for _ in range(STRIKE_BURST):
        assert box.strike("127.0.0.9", 0.0) == 0.0  # a client with a typo retries a little
    assert box.strike("127.0.0.9", 0.0) == 4.0  # a guesser's first penalty is the third's
    assert box.refuses("127.0.0.9", 3.9)
    assert not box.refuses("127.0.0.8", 3.9)  # others are not affected
    assert not box.refuses("127.0.0.9", 4.0)
    # Out again, it keeps failing: its allowance refilled at the rate only, and each
    # offence is longer.
    assert [box.strike("127.0.0.9", 4.0) for _ in range(2)] == [0.0, 32.0]
    # An address that fails at the allowed rate is never refused.
    steady = PenaltyBox(first=1.0, longest=60.0, capacity=16)
    assert all(steady.strike("h", i / STRIKE_RATE) == 0.0 for i in range(10 * STRIKE_BURST))


def test_a_flood_from_many_addresses_boxes_each_at_its_first_failure() -> None:
    box = PenaltyBox(first=1.0, longest=60.0, capacity=4096)
    first = [box.strike(f"127.1.{i // 250}.{i % 250 + 1}", 0.0) for i in range(1_100)]
    assert first[:WORKER_STRIKE_BURST] == [0.0] * WORKER_STRIKE_BURST
    assert set(first[WORKER_STRIKE_BURST:]) == {4.0}
    assert box.refuses("127.1.4.1", 1.0)
    # Once the worker's failures are back under their rate, one address's typo is not.
    assert box.strike("127.0.0.1", 60.0) == 0.0



async def test_a_failed_authentication_is_counted_in_the_box_the_server_hands_the_app() -> None:
    """The worker's penalty box is the server's (the seam puts its count in the scope):
    the gate counts a wrong key there, and closes an HTTP/1 connection once the address
    is boxed; a server that hands none counts nothing."""
    app = App(load_config(BANK))
    counted: list[str] = []

    def boxed(host: str) -> float:
        counted.append(host)
        return 4.0  # the address is refused for 4 s from now

    async def wrong_key(extensions: dict[str, Any], http_version: str = "1.1") -> Response:
        scope = make_scope("GET", "/v1/models", bearer(WRONG_DEMO), http_version)
        scope["client"] = ("127.0.0.9", 40000)
        scope["extensions"] = extensions
        ex = Exchange(app, scope, [b""])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ex.run)
            await ex.done.wait()
            ex.disconnect()
        return ex.response

    r = await wrong_key({STRIKE: boxed})
    assert (r.status, r.headers.get("connection")) == (401, "close")
    r = await wrong_key({STRIKE: boxed}, http_version="2")  # the stream ends, not the connection
    assert (r.status, r.headers.get("connection")) == (401, None)
    assert counted == ["127.0.0.9", "127.0.0.9"]
    r = await wrong_key({})  # hypercorn as shipped, or another server
    assert (r.status, r.headers.get("connection")) == (401, None)
    assert counted == ["127.0.0.9", "127.0.0.9"]

def test_the_failure_counts_are_bounded() -> None:
    box = PenaltyBox(first=1.0, longest=60.0, capacity=8)
    for i in range(1_000):
        box.strike(f"10.0.{i // 256}.{i % 256}", 0.0)
    assert len(box._strikes) == 8


def test_the_bank_example_keys_are_of_the_new_format() -> None:
    text = BANK.read_text()
    assert "scrypt$" not in text
    assert f'hash = "{hash_key("aik_demo_hEn8rpOr9Rcn00wlo27yMqWGG6cqnbVQ")}"' in text


# --- item 2: what a web page could send --------------------------------------------------

NEW_CONFIG_MARK = "[cors]\nallow_origins = [\"*\"]\n"


def reloadable(tmp_path: Path) -> AbstractAsyncContextManager[App]:
    """Auth off (the embedded default), started, with a config file the reload API may
    rewrite."""
    path = tmp_path / "aiserve.toml"
    path.write_text(config_text())
    return running(path)


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        # The attack of issue 33: a page's no-preflight POST, text/plain.
        ({"content-type": "text/plain"}, 415, "unsupported_media_type"),
        # A form.
        ({"content-type": "application/x-www-form-urlencoded"}, 415, "unsupported_media_type"),
        # The right type, from a page on another origin (after a preflight it may not pass).
        ({"content-type": "application/toml", "origin": "http://evil.example"}, 403,
         "origin_not_allowed"),
        ({"content-type": "application/toml", "origin": "null"}, 403, "origin_not_allowed"),
        # DNS rebinding: the page's own name now points at 127.0.0.1; same origin to it.
        ({"content-type": "application/toml", "host": "evil.example:8000",
          "origin": "http://evil.example:8000"}, 403, "host_not_allowed"),
        ({"content-type": "application/toml", "sec-fetch-site": "cross-site"}, 403,
         "origin_not_allowed"),
    ],
)  # fmt: skip
async def test_with_auth_off_a_page_cannot_rewrite_the_config(
    tmp_path: Path, headers: dict[str, str], status: int, code: str
) -> None:
    body = (config_text() + "\n" + NEW_CONFIG_MARK).encode()
    async with reloadable(tmp_path) as app:
        before = (tmp_path / "aiserve.toml").read_text()
        r = await request_from(
            app, "POST", "/admin/config/reload", headers, client="127.0.0.1", body=body
        )
        assert (r.status, error(r)["code"]) == (status, code)
        assert (tmp_path / "aiserve.toml").read_text() == before
        assert app.config.cors is None


async def test_the_gateways_own_page_and_allowed_hosts_still_may(tmp_path: Path) -> None:
    own = {
        "content-type": "application/toml",
        "host": "127.0.0.1:8000",
        "origin": "http://127.0.0.1:8000",
        "sec-fetch-site": "same-origin",
    }
    body = (config_text() + "\n" + NEW_CONFIG_MARK).encode()
    async with reloadable(tmp_path) as app:
        r = await request_from(
            app, "POST", "/admin/config/reload", own, client="127.0.0.1", body=body
        )
        assert r.status == 200, r.body
        assert app.config.cors is not None
    guard = BrowserGuard(auth_enabled=False, hosts=frozenset({"gw.internal"}))
    for host in ("localhost:8000", "LOCALHOST", "[::1]:8000", "127.7.7.7", "gw.internal:80"):
        guard.check("GET", {"host": host}, "127.0.0.1", admin=True)
    with pytest.raises(Exception, match="allowed_hosts"):
        guard.check("GET", {"host": "gw.internal.evil.example"}, "127.0.0.1", admin=True)


def test_allowed_hosts_is_validated() -> None:
    text = config_text().replace("[server]\n", '[server]\nallowed_hosts = ["a b"]\n', 1)
    with pytest.raises(ConfigError, match=r"server.allowed_hosts\[0\]"):
        parse_config(text, source="<test>")


@pytest.mark.parametrize(
    ("method", "path", "ctype"),
    [
        ("PUT", "/admin/api/routes/steps", "application/json"),
        ("GET", "/admin/api/overview", None),
        ("GET", "/admin/config", None),
        ("GET", "/debug/requests/recent", None),
        ("PUT", f"/v1/sessions/{SID}/vars", "application/json"),
        ("GET", f"/v1/sessions/{SID}", None),
    ],
)
async def test_with_auth_off_a_foreign_host_is_refused_everywhere_it_matters(
    method: str, path: str, ctype: str | None
) -> None:
    app = App(make_config("[observability]\ndebug_requests = true\n"))
    headers = {"host": "rebound.example:8000"}
    if ctype:
        headers["content-type"] = ctype
    r = await request_from(app, method, path, headers, client="127.0.0.1", body=b"{}")
    assert (r.status, error(r)["code"]) == (403, "host_not_allowed")
    headers["host"] = "localhost:8000"
    r = await request_from(app, method, path, headers, client="127.0.0.1", body=b"{}")
    assert r.status != 403


async def test_session_writes_refuse_what_a_form_sends() -> None:
    app = App(make_config())
    r = await request_from(
        app, "PUT", f"/v1/sessions/{SID}/vars", {"content-type": "text/plain"},
        client="127.0.0.1", body=b'{"a": "b"}',
    )  # fmt: skip
    assert r.status == 415
    vars_of = await Client(app).request("GET", f"/v1/sessions/{SID}")
    assert vars_of.json()["variables"] == {}


# --- item 9: /debug/requests/recent with auth off ------------------------------------------


async def test_recent_requests_answer_only_loopback_with_auth_off() -> None:
    app = App(make_config("[observability]\ndebug_requests = true\n"))
    r = await request_from(app, "GET", "/debug/requests/recent", {}, client="192.0.2.7")
    assert (r.status, error(r)["code"]) == (403, "loopback_only")
    r = await request_from(app, "GET", "/debug/requests/recent", {}, client="127.0.0.1")
    assert r.status == 200


# --- item 4: session event streams count against their tenant --------------------------------


async def test_session_event_streams_count_against_tenant_max_streams(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = auth_app(tenant_max_streams="2", ttft_ms="1000")
    client = Client(app)
    async with client.open("GET", f"/v1/sessions/{SID}/events", headers=bearer(KEY_A)) as one, \
            client.open("GET", f"/v1/sessions/{SID}/events", headers=bearer(KEY_A)) as two:
        await trio.testing.wait_all_tasks_blocked()
        assert app.gate.admission.by_tenant == {"bank-a": 2}
        third = await client.request("GET", f"/v1/sessions/{SID}/events", headers=bearer(KEY_A))
        assert (third.status, error(third)["code"]) == (429, "tenant_stream_limit")
        chat = await client.chat(chat_body(stream=True), headers=bearer(KEY_A))
        assert (chat.status, error(chat)["code"]) == (429, "tenant_stream_limit")
        other = await client.chat(chat_body(), headers=bearer(KEY_B))
        assert other.status == 200  # another tenant is not affected
        one.disconnect()
        two.disconnect()
    assert app.gate.admission.by_tenant == {}


# --- item 5: channels without X-Channel, and session grants ---------------------------------

IVR_KEY = "aik_ivr_" + "i" * 32


def grant_app(sessions: str | None = None, channels: str = '["ivr"]', routes: str = '["*"]') -> App:
    grant = f'sessions = "{sessions}"\n' if sessions is not None else ""
    extra = f"""
[[auth.keys]]
id = "ivr"
hash = "{hash_key(IVR_KEY)}"
tenant = "bank-a"
routes = {routes}
channels = {channels}
{grant}"""
    return auth_app(auth_toml() + extra)


async def test_without_x_channel_the_keys_own_channels_decide() -> None:
    app = grant_app()
    client = Client(app)
    r = await client.chat(chat_body(), headers={"authorization": f"Bearer {IVR_KEY}"})
    assert r.status == 200
    assert 'channel="ivr"' in app.metrics.render().decode()
    assert 'channel="api"' not in app.metrics.render().decode()  # not the route's first
    several = await client.chat(chat_body(), headers={"authorization": f"Bearer {KEY_A}"})
    assert (several.status, error(several)["code"]) == (400, "channel_required")
    assert error(several)["param"] == "X-Channel"
    named = await client.chat(chat_body(), headers=bearer(KEY_A, **{"x-channel": "web"}))
    assert named.status == 200


async def test_a_key_without_channels_cannot_chat() -> None:
    app = grant_app(channels="[]", sessions="write")
    r = await Client(app).chat(chat_body(), headers={"authorization": f"Bearer {IVR_KEY}"})
    assert (r.status, error(r)["code"]) == (403, "channel_not_allowed")


@pytest.mark.parametrize(
    ("sessions", "read", "write"),
    [(None, 403, 403), ("none", 403, 403), ("read", 200, 403), ("write", 200, 200)],
)
async def test_an_admin_tool_key_touches_sessions_only_with_a_grant(
    sessions: str | None, read: int, write: int
) -> None:
    # The README's "ops" key: routes = [], channels = [].
    app = grant_app(sessions=sessions, channels="[]", routes="[]")
    client = Client(app)
    h = {"authorization": f"Bearer {IVR_KEY}"}
    r = await client.request("GET", f"/v1/sessions/{SID}", headers=h)
    assert r.status == read
    if read == 403:
        assert error(r)["code"] == "sessions_not_allowed"
    token = await client.request("POST", f"/v1/sessions/{SID}/stream-token", headers=h)
    assert token.status == read
    r = await client.request(
        "PUT", f"/v1/sessions/{SID}/vars", json_body={"tier": "gold"}, headers=h
    )
    assert r.status == write
    # A key that may chat reads and writes its tenant's sessions, as its chats do.
    r = await client.request(
        "PUT", f"/v1/sessions/{SID}/vars", json_body={"tier": "gold"}, headers=bearer(KEY_A)
    )
    assert r.status == 200


async def test_the_ops_key_of_the_bank_example_reads_no_session() -> None:
    app = App(load_config(BANK))
    ops = "aik_ops_a0BLVr8TNBglNPLjVUBTA4L9rPojoV-2"
    r = await Client(app).request("GET", f"/v1/sessions/{SID}", headers=bearer(ops))
    assert (r.status, error(r)["code"]) == (403, "sessions_not_allowed")


# --- item 11: max_per_client when the proxy's header is missing ----------------------------


async def test_a_request_without_the_proxy_header_is_counted_under_its_own_address(
    autojump_clock: trio.testing.MockClock,
) -> None:
    text = config_text(max_per_client="1", ttft_ms="1000")
    text = text.replace('client_address_header = ""', 'client_address_header = "x-forwarded-for"')
    app = App(parse_config(text, source="<test>"))
    client = Client(app)
    async with client.open("POST", "/v1/chat/completions", json_body=chat_body()) as first:
        await trio.testing.wait_all_tasks_blocked()
        assert app.gate.admission.by_client == {"127.0.0.1": 1}
        second = await client.chat(chat_body())
        assert (second.status, error(second)["code"]) == (429, "too_many_connections")
        proxied = await client.chat(chat_body(), headers={"x-forwarded-for": "10.0.0.2"})
        assert proxied.status == 200
    assert first.response.status == 200

