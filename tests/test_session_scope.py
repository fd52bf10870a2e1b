"""What a key sees of its tenant's sessions (issue 51, item 5): only the turns of the
channels it may use, and, for a key whose routes all redact, the turns and variables as
those routes would have let them through -- also when another key of the tenant wrote
them raw on a route without redaction."""

from __future__ import annotations

import json

import trio

from aiserve_trio.config import parse_config
from aiserve_trio.runtime.asgi import App
from aiserve_trio.security.auth import hash_key

from .asgi_client import Client, chat_body
from .authcfg import OFF
from .conftest import config_text
from .test_sessions_http import parse_sse, running, wait_events

KEY_FILL = "aik_fill_" + "1" * 32  # every route and channel
KEY_IVR = "aik_ivr_" + "2" * 32  # the redacting route and the IVR channel only
KEY_TOOL = "aik_tool_" + "3" * 32  # no route, reads sessions (an agent desk's tool)
SID = "call-42"
CARD, MAIL = "4111 1111 1111 1111", "ada.lovelace@example.com"
SECRET = f"echo: card {CARD}, mail {MAIL}"

AUTH = f"""[auth]
enabled = true
token_secret_env = "AISERVE_TEST_TOKEN_SECRET_UNSET"

[[auth.keys]]
id = "fill"
hash = "{hash_key(KEY_FILL)}"
tenant = "bank"

[[auth.keys]]
id = "ivr"
hash = "{hash_key(KEY_IVR)}"
tenant = "bank"
routes = ["/v1/safe/chat"]
channels = ["ivr"]

[[auth.keys]]
id = "tool"
hash = "{hash_key(KEY_TOOL)}"
tenant = "bank"
routes = []
channels = []
sessions = "read"
"""

SAFE_ROUTE = """
[[routes]]
path = "/v1/safe/chat"
name = "safe"
adapter = "mock"
default_model = "aiserve-mock"
policies = ["gdpr-redact"]
"""


def app() -> App:
    text = config_text(ttft_ms="0", inter_token_ms="0").replace(OFF, AUTH) + SAFE_ROUTE
    return App(parse_config(text, source="<test>"))


def h(key: str, channel: str | None = None) -> dict[str, str]:
    out = {"authorization": f"Bearer {key}", "x-session-id": SID}
    if channel is not None:
        out["x-channel"] = channel
    return out


async def fill(client: Client) -> None:
    """The other key's raw turns: on the app and on the IVR channel, no redaction."""
    for channel in ("app", "ivr"):
        body = chat_body(SECRET, metadata={"contact": MAIL})
        r = await client.chat(body, headers=h(KEY_FILL, channel))
        assert r.status == 200, r.body
        assert CARD in r.json()["choices"][0]["message"]["content"]  # this route keeps it


async def test_a_limited_key_reads_its_channels_turns_redacted_by_its_routes() -> None:
    async with running(app()) as a:
        client = Client(a)
        await fill(client)
        path = f"/v1/sessions/{SID}"
        everything = (await client.request("GET", path, headers=h(KEY_FILL))).json()
        assert [t["channel"] for t in everything["turns"]] == ["app", "app", "ivr", "ivr"]
        assert CARD in everything["turns"][0]["content"]  # stored as that route had it
        r = await client.request("GET", path, headers=h(KEY_IVR))
        assert r.status == 200, r.body
        turns = r.json()["turns"]
        assert [t["channel"] for t in turns] == ["ivr", "ivr"]  # not the app's
        text = json.dumps(r.json())
        assert CARD not in text
        assert MAIL not in text
        assert "[CARD]" in turns[0]["content"]
        assert "[EMAIL]" in turns[0]["content"]
        assert r.json()["variables"]["contact"] == "[EMAIL]"
        # A key without routes (an explicit sessions grant) and every channel reads as stored.
        tool = (await client.request("GET", path, headers=h(KEY_TOOL))).json()
        assert tool["turns"] == everything["turns"]


async def test_a_limited_keys_event_stream_has_its_channels_turns_redacted() -> None:
    async with running(app()) as a:
        client = Client(a)
        await fill(client)
        grant = await client.request(
            "POST", f"/v1/sessions/{SID}/stream-token", headers=h(KEY_IVR)
        )
        assert grant.status == 200, grant.body
        token = grant.json()["token"]
        with trio.fail_after(10):
            async with client.open("GET", f"/v1/sessions/{SID}/events?token={token}") as ex:
                replay = await wait_events(ex, 2)
                # A live turn on a channel it may not use is not sent; one on its own is.
                await client.chat(chat_body("echo: app again"), headers=h(KEY_FILL, "app"))
                await client.chat(chat_body(f"echo: {CARD}"), headers=h(KEY_FILL, "ivr"))
                live = await wait_events(ex, 4)
                ex.disconnect()
        turns = [json.loads(e["data"]) for e in live]
        assert [t["channel"] for t in turns] == ["ivr"] * 4
        assert replay == live[:2]
        assert "app again" not in ex.response.body.decode()
        assert CARD not in ex.response.body.decode()
        assert MAIL not in ex.response.body.decode()
        assert turns[2]["content"] == "echo: [CARD]"
        assert all(e.get("event") != "turn" or "ivr" in e["data"] for e in parse_sse(ex.response.body))
