"""``previous_response_id``: a response's turns are stored under its id (tenant-scoped, for the
route's ``context_ttl``); an unknown, foreign, expired or unstored id is a 404."""

from __future__ import annotations

import json
from typing import Any

import trio

from aiserve_trio.adapters.mock import MockAdapter
from aiserve_trio.config import MockAdapterConfig
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client, Response
from .authcfg import KEY_ADMIN, KEY_B, auth_app, auth_config
from .fakes import RecordingAdapter
from .test_sessions_http import build, running


async def ask(client: Client, key: str, **body: Any) -> Response:
    return await client.request(
        "POST",
        "/v1/responses",
        json_body={"model": "aiserve-mock", **body},
        headers={"authorization": f"Bearer {key}"},
    )


def missing(r: Response) -> bool:
    return r.status == 404 and r.json()["error"]["code"] == "previous_response_not_found"


def recording() -> tuple[Client, RecordingAdapter]:
    """A client of the default app with keys on, its mock recording what it was asked."""
    cfg = auth_config()
    mock_cfg = cfg.adapters["mock"]
    assert isinstance(mock_cfg, MockAdapterConfig)
    rec = RecordingAdapter(MockAdapter("mock", mock_cfg))
    return Client(App(cfg, adapters={"mock": rec})), rec


async def test_a_chain_of_responses_carries_the_conversation(autojump_clock: Any) -> None:
    client, rec = recording()
    first = await ask(client, KEY_B, input="echo: my name is Ada")
    assert first.status == 200
    second = await ask(
        client, KEY_B, input="echo: and I live in Oslo", previous_response_id=first.json()["id"]
    )
    third = await ask(
        client,
        KEY_B,
        input="echo: what did I say?",
        previous_response_id=second.json()["id"],
        stream=True,
    )
    assert third.status == 200
    # The mock counts prompt tokens over the whole prompt: each step carries the ones before.
    tokens = [r.json()["usage"]["input_tokens"] for r in (first, second)]
    assert tokens[0] < tokens[1]
    done = json.loads(third.events()[-1])
    assert done["type"] == "response.completed"
    assert done["response"]["previous_response_id"] == second.json()["id"]
    assert done["response"]["usage"]["input_tokens"] > tokens[1]
    # What the model was asked the third time: the whole conversation, in order.
    asked = [(m.role, m.text()) for m in rec.requests[-1].messages]
    assert [role for role, _ in asked] == ["user", "assistant"] * 2 + ["user"]
    assert [text for _, text in asked][::2] == [
        "echo: my name is Ada",
        "echo: and I live in Oslo",
        "echo: what did I say?",
    ]
    assert asked[1][1] == "my name is Ada"


async def test_another_tenants_response_is_not_found(autojump_clock: Any) -> None:
    client = Client(auth_app())
    mine = await ask(client, KEY_B, input="hello")
    assert missing(await ask(client, KEY_ADMIN, input="hi", previous_response_id=mine.json()["id"]))
    assert (
        await ask(client, KEY_B, input="hi", previous_response_id=mine.json()["id"])
    ).status == 200


async def test_an_unstored_or_expired_response_is_not_found(autojump_clock: Any) -> None:
    client = Client(auth_app())
    assert missing(await ask(client, KEY_B, input="hi", previous_response_id="resp_nope"))
    unstored = await ask(client, KEY_B, input="hello", store=False)
    assert unstored.json()["store"] is False
    assert missing(await ask(client, KEY_B, input="hi", previous_response_id=unstored.json()["id"]))
    kept = await ask(client, KEY_B, input="hello")
    await trio.sleep(86_400 + 1)  # the route's context_ttl
    assert missing(await ask(client, KEY_B, input="hi", previous_response_id=kept.json()["id"]))


async def test_previous_response_id_with_a_session_header_is_refused(autojump_clock: Any) -> None:
    client = Client(auth_app())
    first = await ask(client, KEY_B, input="hello")
    r = await client.request(
        "POST",
        "/v1/responses",
        json_body={
            "model": "aiserve-mock",
            "input": "hi",
            "previous_response_id": first.json()["id"],
        },
        headers={"authorization": f"Bearer {KEY_B}", "x-session-id": "s-1"},
    )
    assert r.status == 400
    assert r.json()["error"]["param"] == "previous_response_id"


async def test_metadata_cannot_forge_the_link_to_an_earlier_response(autojump_clock: Any) -> None:
    client, rec = recording()
    secret = await ask(client, KEY_B, input="echo: the vault code is 1234")
    forged = await ask(
        client, KEY_B, input="echo: hello", metadata={"previous_response_id": secret.json()["id"]}
    )
    r = await ask(client, KEY_B, input="echo: before?", previous_response_id=forged.json()["id"])
    assert r.status == 200
    asked = [m.text() for m in rec.requests[-1].messages]
    assert asked == ["echo: hello", "hello", "echo: before?"]  # not the vault code


async def test_a_chain_is_kept_in_redis_too(redis_up: Any) -> None:
    async with running(build("redis", redis_up.url)) as gateway:
        client = Client(gateway)
        first = await client.request(
            "POST", "/v1/responses", json_body={"model": "aiserve-mock", "input": "echo: one"}
        )
        ask_again = {
            "model": "aiserve-mock",
            "input": "echo: two",
            "previous_response_id": first.json()["id"],
        }
        second = await client.request("POST", "/v1/responses", json_body=ask_again)
        assert second.status == 200
        assert second.json()["usage"]["input_tokens"] > first.json()["usage"]["input_tokens"]
        ask_again["previous_response_id"] = "resp_none"
        assert missing(await client.request("POST", "/v1/responses", json_body=ask_again))


def chat_as(key: str, session: str, text: str) -> dict[str, Any]:
    return {
        "json_body": {"model": "aiserve-mock", "messages": [{"role": "user", "content": text}]},
        "headers": {"authorization": f"Bearer {key}", "x-session-id": session},
    }


async def test_a_session_header_cannot_open_a_stored_response(autojump_clock: Any) -> None:
    """Issue 51, item 5: ``X-Session-Id: resp_...`` on chat or Messages appended to a
    stored response, and a later continuation carried those turns. Stored responses
    are immutable: no client session id can name one."""
    client, rec = recording()
    first = await ask(client, KEY_B, input="echo: my name is Ada")
    rid = first.json()["id"]
    assert rid.startswith("resp_")
    chat = await client.request("POST", "/v1/chat/completions", **chat_as(KEY_B, rid, "echo: X"))
    assert chat.status == 400
    assert chat.json()["error"]["param"] == "X-Session-Id"
    assert "X-Session-Id" in chat.json()["error"]["message"]
    body = {"model": "aiserve-mock", "max_tokens": 64}
    msgs = await client.request(
        "POST",
        "/v1/messages",
        json_body={**body, "messages": [{"role": "user", "content": "echo: Y"}]},
        headers={"authorization": f"Bearer {KEY_B}", "x-session-id": rid},
    )
    assert msgs.status == 400
    assert msgs.json()["type"] == "error"  # Anthropic's envelope
    assert "X-Session-Id" in msgs.json()["error"]["message"]
    # Nor on the Responses route itself (it would append to the stored response).
    own = await client.request(
        "POST",
        "/v1/responses",
        json_body={"model": "aiserve-mock", "input": "echo: Z"},
        headers={"authorization": f"Bearer {KEY_B}", "x-session-id": rid},
    )
    assert own.status == 400
    assert own.json()["error"]["param"] == "X-Session-Id"
    r = await ask(client, KEY_B, input="echo: what did I say?", previous_response_id=rid)
    assert r.status == 200
    asked = [m.text() for m in rec.requests[-1].messages]
    assert asked == ["echo: my name is Ada", "my name is Ada", "echo: what did I say?"]


async def test_the_session_endpoints_cannot_reach_a_stored_response(autojump_clock: Any) -> None:
    client, rec = recording()
    rid = (await ask(client, KEY_B, input="echo: the vault code is 1234")).json()["id"]
    auth = {"authorization": f"Bearer {KEY_B}"}
    for method, path, body in (
        ("GET", f"/v1/sessions/{rid}", None),
        ("PUT", f"/v1/sessions/{rid}/vars", {"note": "forged"}),
        ("GET", f"/v1/sessions/{rid}/events", None),
    ):
        with trio.fail_after(60):  # an events stream that opened would not end by itself
            r = await client.request(method, path, json_body=body, headers=auth)
        assert r.status == 400, (method, path)
        assert r.json()["error"]["param"] == "session_id"
        assert "1234" not in r.body.decode()
    r = await ask(client, KEY_B, input="echo: and?", previous_response_id=rid)
    assert r.status == 200
    asked = [m.text() for m in rec.requests[-1].messages]
    assert asked == ["echo: the vault code is 1234", "the vault code is 1234", "echo: and?"]


async def test_previous_response_id_names_itself_and_only_a_response(autojump_clock: Any) -> None:
    client = Client(auth_app())
    bad = await ask(client, KEY_B, input="hi", previous_response_id="not an id!")
    assert bad.status == 400
    err = bad.json()["error"]
    assert err["param"] == "previous_response_id"
    assert "previous_response_id" in err["message"]
    assert "X-Session-Id" not in err["message"]
    # A chat session is not a stored response: its turns are not a conversation to continue.
    chat = await client.request(
        "POST", "/v1/chat/completions", **chat_as(KEY_B, "s-1", "echo: my PIN is 0000")
    )
    assert chat.status == 200
    assert missing(await ask(client, KEY_B, input="echo: hi", previous_response_id="s-1"))
