"""CORS: ``[cors]`` validated at load, preflights answered before the gate, and the
headers on every response to an allowed origin (JSON, errors, chat and session streams).

The real browser, on another origin, is in tests/test_browser.py.
"""

from __future__ import annotations

import re

import pytest
import trio

from aiserve_trio.config import (
    CORS_ALLOW_HEADERS,
    CORS_EXPOSE_HEADERS,
    ConfigError,
    CorsConfig,
    default_config_text,
    parse_config,
)
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client, chat_body
from .authcfg import KEY_A, OFF, auth_toml, bearer
from .conftest import config_text

PAGE = "https://app.bank.example"
OTHER = "https://evil.example"
CORS = f'[cors]\nallow_origins = ["{PAGE}", "http://127.0.0.1:3000"]\nmax_age_s = 120\n'
SID = "session:20240521:cors1"


def cors_app(cors: str = CORS, *, auth: bool = True, **values: str) -> App:
    text = config_text(**values)
    if auth:
        text = text.replace(OFF, auth_toml())
    return App(parse_config(text + "\n" + cors, source="<test>"))


def preflight(origin: str, method: str = "POST", headers: str = "") -> dict[str, str]:
    h = {"origin": origin, "access-control-request-method": method}
    if headers:
        h["access-control-request-headers"] = headers
    return h


# --- the config ---------------------------------------------------------------------


def test_cors_is_off_unless_configured():
    cfg = parse_config(config_text(), source="<test>")
    assert cfg.cors is None


def test_cors_defaults():
    cfg = parse_config(config_text() + '\n[cors]\nallow_origins = ["https://a.example"]\n')
    assert cfg.cors is not None
    assert cfg.cors.allow_headers == [
        "authorization", "content-type", "x-session-id", "x-channel",
        "x-request-timeout-ms", "last-event-id",
    ]  # fmt: skip
    assert {"x-request-id", "traceresponse", "x-aiserve-degraded"} <= set(cfg.cors.expose_headers)
    assert {"x-aiserve-trimmed-messages", "x-aiserve-session-events"} <= set(cfg.cors.expose_headers)


@pytest.mark.parametrize(
    ("cors", "key", "why"),
    [
        ('allow_origins = ["*"]', "cors.allow_origins", "only with auth off"),
        ("allow_origins = []", "cors.allow_origins", "at least one origin"),
        ('allow_origins = ["https://a.example/"]', "cors.allow_origins[0]", "no path"),
        ('allow_origins = ["https://A.example"]', "cors.allow_origins[0]", "lower case"),
        ('allow_origins = ["a.example"]', "cors.allow_origins[0]", "scheme://host"),
        ('allow_origins = ["https://a.example:443"]', "cors.allow_origins[0]", "default port"),
        ('allow_origins = ["https://a.example", "*"]', "cors.allow_origins[1]", "alone"),
        ('allow_origins = ["https://a.example"]\nallow_headers = ["x bad"]', "cors.allow_headers[0]", "header name"),
        ('allow_origins = ["https://a.example"]\nmax_age_s = -1', "cors.max_age_s", "negative"),
        ('allow_origins = ["https://a.example"]\ncolour = "red"', "colour", ""),
    ],
)
def test_bad_cors_is_refused_naming_the_key(cors, key, why):
    text = config_text().replace(OFF, auth_toml()) + f"\n[cors]\n{cors}\n"
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="gw.toml")
    assert str(info.value).startswith("gw.toml: ")
    assert f"`{key}`" in str(info.value) or key in str(info.value)
    assert why in str(info.value)


def test_the_default_configs_commented_cors_table_shows_the_defaults():
    text = default_config_text()
    block = re.search(r"(?m)^# \[cors\]\n(?:# .*\n)+", text)
    assert block is not None
    table = re.sub(r"(?m)^# ", "", block[0])
    cfg = parse_config(text + "\n" + table, source="<test>")
    assert cfg.cors is not None
    assert cfg.cors.allow_origins == ["https://app.example.com"]
    assert cfg.cors.allow_headers == list(CORS_ALLOW_HEADERS)
    assert cfg.cors.expose_headers == list(CORS_EXPOSE_HEADERS)
    assert cfg.cors.max_age_s == CorsConfig(allow_origins=["https://a.example"]).max_age_s


def test_any_origin_is_allowed_with_auth_off():
    cfg = parse_config(config_text() + '\n[cors]\nallow_origins = ["*"]\n')
    assert cfg.cors is not None
    assert cfg.cors.allow_origins == ["*"]


# --- preflight ----------------------------------------------------------------------


async def test_preflight_from_an_allowed_origin_needs_no_key(autojump_clock):
    app = cors_app()
    r = await Client(app).request(
        "OPTIONS", "/v1/chat/completions",
        headers=preflight(PAGE, "POST", "Authorization, Content-Type, X-Session-Id"),
    )  # fmt: skip
    assert r.status == 204
    assert r.body == b""
    h = r.headers
    assert h["access-control-allow-origin"] == PAGE
    assert h["vary"] == "origin"
    assert set(h["access-control-allow-methods"].split(", ")) == {"GET", "POST", "PUT"}
    assert "authorization" in h["access-control-allow-headers"].split(", ")
    assert "last-event-id" in h["access-control-allow-headers"].split(", ")
    assert h["access-control-max-age"] == "120"
    # nothing ran: no request counted, no admission slot taken
    assert "aiserve_requests_total{" not in app.metrics.render().decode()


async def test_preflight_is_answered_before_admission(autojump_clock):
    app = cors_app(max_inflight="1")
    with app.gate.admission.request():  # the one slot is taken
        busy = await Client(app).chat(chat_body(), headers=bearer(KEY_A))
        r = await Client(app).request("OPTIONS", "/v1/sessions/s1/events", headers=preflight(PAGE, "GET", "last-event-id"))
    assert busy.status == 503
    assert r.status == 204


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        (preflight(OTHER), "cors_origin_not_allowed"),
        (preflight("null"), "cors_origin_not_allowed"),
        (preflight(PAGE, "DELETE"), "cors_method_not_allowed"),
        (preflight(PAGE, "POST", "authorization, x-api-key"), "cors_header_not_allowed"),
    ],
)
async def test_preflight_refused_in_the_envelope(headers, code, autojump_clock):
    r = await Client(cors_app()).request("OPTIONS", "/v1/chat/completions", headers=headers)
    assert r.status == 403
    assert r.json()["error"]["code"] == code
    assert r.json()["error"]["type"] == "permission_error"
    if code == "cors_origin_not_allowed":
        assert "access-control-allow-origin" not in r.headers


async def test_options_without_cors_is_not_a_preflight(autojump_clock):
    app = App(parse_config(config_text().replace(OFF, auth_toml()), source="<test>"))
    r = await Client(app).request("OPTIONS", "/v1/chat/completions", headers=preflight(PAGE))
    assert r.status == 401  # no [cors]: the gate, as before
    assert "access-control-allow-origin" not in r.headers


# --- actual responses ---------------------------------------------------------------


def assert_cors(headers: dict[str, str], origin: str = PAGE) -> None:
    assert headers["access-control-allow-origin"] == origin
    assert headers["vary"] == "origin"
    exposed = headers["access-control-expose-headers"].split(", ")
    assert {"x-request-id", "traceresponse", "x-aiserve-degraded"} <= set(exposed)


async def test_a_streamed_chat_carries_the_cors_headers(autojump_clock):
    r = await Client(cors_app()).chat(
        chat_body("echo: hi there", stream=True),
        headers=bearer(KEY_A, origin=PAGE, **{"x-channel": "web"}),
    )
    assert r.status == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text() == "hi there"
    assert_cors(r.headers)


@pytest.mark.parametrize(
    ("method", "path", "headers", "status"),
    [
        ("POST", "/v1/chat/completions", {}, 401),  # no key
        ("GET", "/v1/nowhere", bearer(KEY_A), 404),
        ("GET", "/v1/models", bearer(KEY_A), 200),
        ("GET", "/metrics", {}, 200),
    ],
)
async def test_every_response_to_an_allowed_origin_carries_them(method, path, headers, status, autojump_clock):
    r = await Client(cors_app()).request(method, path, headers={**headers, "origin": PAGE})
    assert r.status == status
    assert_cors(r.headers)


async def test_the_session_event_stream_carries_them(autojump_clock):
    client = Client(cors_app())
    # Verify the key once first: scrypt runs in a thread, and while it does the
    # virtual clock would jump straight to the deadline below.
    assert (await client.request("GET", "/v1/models", headers=bearer(KEY_A))).status == 200
    with trio.fail_after(10):
        async with client.open(
            "GET", f"/v1/sessions/{SID}/events", headers=bearer(KEY_A, origin=PAGE)
        ) as ex:
            await ex.wait_for_bytes()
            ex.disconnect()
    assert ex.response.status == 200
    assert_cors(ex.response.headers)


async def test_another_origin_gets_no_allow_origin(autojump_clock):
    r = await Client(cors_app()).request("GET", "/v1/models", headers=bearer(KEY_A, origin=OTHER))
    assert r.status == 200  # the browser, not the server, withholds the answer
    assert "access-control-allow-origin" not in r.headers
    assert "access-control-expose-headers" not in r.headers
    assert r.headers["vary"] == "origin"


async def test_any_origin_with_auth_off(autojump_clock):
    app = cors_app('[cors]\nallow_origins = ["*"]\n', auth=False)
    r = await Client(app).chat(chat_body("echo: x", stream=True), headers={"origin": OTHER})
    assert r.headers["access-control-allow-origin"] == "*"
    assert "x-request-id" in r.headers["access-control-expose-headers"]
    pre = await Client(app).request("OPTIONS", "/v1/chat/completions", headers=preflight(OTHER, "POST", "content-type"))
    assert pre.status == 204
    assert pre.headers["access-control-allow-origin"] == "*"
